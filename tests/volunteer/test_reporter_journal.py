"""The reporter survives a SIGKILL (volunteer.journal) and owns the process's session in the ledger:
a real child process is killed after recording steps, a new reporter in its data dir reports them and the
ledger credits them once; heartbeats open a session, leaving closes it, a restart opens another, and the
backbone closes a silent one."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import trio

from backbone.sessions import close_silent_sessions_forever
from shared.faults import ENV
from tests.backbone.ledger.reports import part_receipt
from tests.backbone.pinned_api import PinnedApi, member_client, serve_pinned_api
from volunteer.api_client import ApiClient
from volunteer.journal import JOURNAL_FILE, JournaledStep
from volunteer.reporting import Reporter

from .journal_child import SAMPLES, VOLUNTEER, WITNESS

STEPS = 5


def admit_fixed(api: PinnedApi) -> ApiClient:
    """Admit the child's deterministic identities (the volunteer as ``vera``, the witness as ``will``)."""
    now = time.time()
    for username, who in (("vera", VOLUNTEER), ("will", WITNESS)):
        api.store.add_user(username, now=now)
        secret = api.store.create_invite(username, now=now)
        api.store.redeem_invite(secret, who.peer_id, who.public_key_bytes, now=now)
    token = api.authority.issue_token(
        api.run_id, "vera", VOLUNTEER.peer_id, VOLUNTEER.public_key_bytes, now, 600
    )
    return ApiClient(api.run_id, api.urls, identity=VOLUNTEER, token=lambda: token)


def credited(api: PinnedApi) -> dict[str, int]:
    return {row.username: row.samples for row in api.store.leaderboard()}


async def test_steps_journaled_before_a_sigkill_are_reported_by_the_next_process_and_credited_once(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "vera"
    data_dir.mkdir()
    async with serve_pinned_api(tmp_path / "bb") as api:
        client = admit_fixed(api)
        for number in range(1, STEPS + 1):  # the collaboration took these steps
            api.store.record_step(number, finished_at=time.time(), loss=None, samples=0, peers=2)
        child = await trio.run_process(
            [sys.executable, "-m", "tests.volunteer.journal_child", str(data_dir), api.run_id, str(STEPS)],
            env={**os.environ, ENV: "test.steps_recorded=kill"},
            capture_stdout=True,
            check=False,
        )
        assert child.returncode == -signal.SIGKILL, child.stdout
        assert child.stdout.decode().split() == ["1", "queued"]  # report 0 queued, steps 4-5 open
        with (data_dir / JOURNAL_FILE).open("ab") as journal:
            journal.write(b'0badc0de {"k":"stepped","step":9')  # a torn last line: dropped, no crash

        second = Reporter(api.run_id, VOLUNTEER, client, data_dir)
        assert second.recovered == (1, 2) and second.pending == 2
        await second.flush()
        assert (second.sent, second.pending) == (2, 0)
        assert credited(api) == {"vera": STEPS * SAMPLES, "will": 0}
        reports = api.store.peer_reports(VOLUNTEER.peer_id)
        assert [(r.seq, r.samples) for r in reports] == [(0, 3 * SAMPLES), (1, 2 * SAMPLES)]

        third = Reporter(api.run_id, VOLUNTEER, client, data_dir)  # nothing left to send: credited once
        assert third.recovered == (0, 0) and third.pending == 0
        third.close_all()  # only what is new (nothing) and a seq never used before
        await third.flush()
        assert credited(api) == {"vera": STEPS * SAMPLES, "will": 0}
        assert third._seq == 2


async def test_a_process_opens_its_session_leaving_closes_it_and_a_restart_opens_another(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "alice"
    data_dir.mkdir()
    async with serve_pinned_api(tmp_path / "bb") as api:
        client = member_client(api, "alice")
        assert client.identity is not None
        peer = client.identity.peer_id
        first = Reporter(api.run_id, client.identity, client, data_dir)
        await first.heartbeat()
        assert [(s.token, s.end_reason) for s in api.store.sessions(peer)] == [(first.session, None)]
        first.close_all()
        await first.flush()
        [session] = api.store.sessions(peer)
        assert session.end_reason == "leave" and session.ended_at is not None

        second = Reporter(api.run_id, client.identity, client, data_dir)
        await second.heartbeat()
        assert [(s.token, s.end_reason) for s in api.store.sessions(peer)] == [
            (first.session, "leave"),
            (second.session, None),
        ]

        with trio.fail_after(60):  # the backbone closes the silent session (here after 0.5 s)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_silent_sessions_forever, api.store, 0.5)
                while api.store.sessions(peer)[-1].end_reason is None:
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
        assert api.store.sessions(peer)[-1].end_reason == "timeout"


async def test_steps_a_volunteer_discards_after_re_syncing_are_taken_back_by_the_ledger(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "vera"
    data_dir.mkdir()
    async with serve_pinned_api(tmp_path / "bb") as api:
        client = admit_fixed(api)
        for number in range(1, 7):
            api.store.record_step(number, finished_at=time.time(), loss=None, samples=0, peers=2)
        reporter = Reporter(api.run_id, VOLUNTEER, client, data_dir, interval=1e9)
        start = time.time()
        for number in range(1, 7):  # steps 4-6 turn out to be a fork's
            signed = part_receipt(WITNESS, VOLUNTEER.peer_id, number, SAMPLES, api.run_id, 100, start)
            reporter.book.add(number, [(WITNESS.peer_id, signed)])
            reporter.record(JournaledStep(number, SAMPLES, 0.5, 0, start + number / 10))
        reporter.close_interval()
        await reporter.flush()
        assert credited(api) == {"vera": 6 * SAMPLES, "will": 0}
        reporter.discard(4, 6)  # the state it re-synced to replaced them
        reporter.close_interval()
        await reporter.flush()
        assert credited(api) == {"vera": 3 * SAMPLES, "will": 0}
        [vera, _] = api.store.leaderboard()
        assert vera.discarded_samples == 3 * SAMPLES
        assert api.store.discards(VOLUNTEER.peer_id) == [(4, 6)]
