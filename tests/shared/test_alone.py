"""Lone-step evidence and the high-water mark (shared.alone), and the read behind them."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.auth import MAX_CLOCK_SKEW
from protocols.presence import PRESENCE_KEY, Presence
from protocols.training import PROGRESS_KEY, PROGRESS_TTL, Progress
from shared.alone import (
    EVIDENCE_MAX_AGE,
    HIGH_WATER_FILE,
    HIGH_WATER_TTL,
    SAVE_PERIOD,
    HighWater,
    Reading,
    binding,
    load_high_water,
    lone_step,
    observe,
    save_high_water,
    state_lost,
    worth_saving,
)
from shared.auth.keys import Identity
from shared.node import Node, open_node
from shared.progress import plausible
from shared.progress_records import known_backbones, read_progress_everywhere

NOW = 1_000_000.0
TARGET = 100
RUN = "alone-test"


def rec(step: int, *, age: float = 0.0, left: bool = False) -> Progress:
    return Progress(step=step, samples=0, samples_per_second=1.0, time=NOW - age, left=left, params=b"p")


def read(records: dict[str, Progress], answered: bool = True, source: str = "dht") -> Reading:
    return Reading(source, answered, records, {})


def verdict(readings: list[Reading], step: int = 10, mark: HighWater | None = None, read_at: float = NOW):  # type: ignore[no-untyped-def]
    return lone_step(readings, "me", step, mark, now=NOW, read_at=read_at, target_batch=TARGET)


def test_a_peer_joining_from_our_state_forbids_the_lone_step() -> None:
    """Rule (c): it loads the state we hold now; a lone step would leave it behind a step it cannot follow."""
    alone = [read({"me": rec(10)})]
    assert verdict(alone).allowed
    joining = lone_step(alone, "me", 10, None, now=NOW, read_at=NOW, target_batch=TARGET, joining="newcomer")
    assert not joining.allowed and "newcomer is joining from our state" in joining.why


def test_a_peer_seen_only_through_a_backbone_forbids_the_lone_step() -> None:
    assert verdict([read({"me": rec(10)})]).allowed
    through_backbone = [read({"me": rec(10)}), read({"other": rec(124)}, source="/ip4/1.2.3.4/tcp/1")]
    assert not verdict(through_backbone).allowed
    # an unreachable backbone adds nothing either way
    assert verdict([read({}), read({}, answered=False, source="bb")]).allowed


def test_no_answer_or_old_evidence_is_no_evidence() -> None:
    assert not verdict([read({}, answered=False)]).allowed
    assert not verdict([]).allowed
    assert not verdict([read({})], read_at=NOW - EVIDENCE_MAX_AGE - 1).allowed


def test_expired_and_departed_peers_are_no_company() -> None:
    assert verdict(
        [read({"old": rec(5, age=PROGRESS_TTL + MAX_CLOCK_SKEW + 1), "gone": rec(5, left=True)})]
    ).allowed


def test_the_issue_restart_waits_for_the_collaboration_then_resumes_within_the_ttl() -> None:
    """The issue's failure: restarted, alone through a split DHT, on the backbone's step-90 checkpoint
    while the collaboration had shown step 124: no lone step, until the mark stops binding."""
    mark = HighWater(run_id=RUN, step=124, seen=NOW - 5)
    assert not verdict([read({})], step=90, mark=mark).allowed
    assert verdict([read({})], step=124, mark=mark).allowed  # at (or past) the mark: fine
    late = NOW + HIGH_WATER_TTL
    assert lone_step([read({})], "me", 90, mark, now=late, read_at=late, target_batch=TARGET).allowed
    future = HighWater(run_id=RUN, step=124, seen=NOW + 3600)  # a clock set back, a damaged file
    assert not binding(future, NOW)


def test_the_mark_follows_the_survivor_down_and_ignores_our_own_steps() -> None:
    mark = observe(None, 568, RUN, NOW)
    assert mark == HighWater(run_id=RUN, step=568, seen=NOW)
    assert observe(mark, None, RUN, NOW + 1) == mark  # nobody else in the survivor: unchanged
    assert observe(mark, 250, RUN, NOW + 2) == HighWater(run_id=RUN, step=250, seen=NOW + 2)  # merged


@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.dictionaries(
                st.sampled_from(["me", "a", "b"]),
                st.tuples(st.integers(0, 200), st.floats(-10, 100), st.booleans()),
                max_size=3,
            ),
        ),
        max_size=3,
    ),
    st.integers(0, 200),
    st.one_of(st.none(), st.tuples(st.integers(0, 200), st.floats(-200, 200))),
)
def test_a_lone_step_is_allowed_only_with_evidence_and_on_a_state_not_older_than_the_mark(
    raw: list[tuple[bool, dict[str, tuple[int, float, bool]]]],
    step: int,
    raw_mark: tuple[int, float] | None,
) -> None:
    readings = [
        read({p: rec(s, age=age, left=left) for p, (s, age, left) in records.items()}, answered)
        for answered, records in raw
    ]
    mark = None if raw_mark is None else HighWater(run_id=RUN, step=raw_mark[0], seen=NOW - raw_mark[1])
    if verdict(readings, step, mark).allowed:
        assert any(r.answered for r in readings)
        for r in readings:
            if r.answered:
                assert all(p == "me" or q.left or not plausible(q, NOW, TARGET) for p, q in r.records.items())
        assert mark is None or step >= mark.step or not binding(mark, NOW)


def test_the_mark_is_written_when_it_moves_and_confirmed_every_few_seconds() -> None:
    saved = HighWater(run_id=RUN, step=124, seen=NOW)
    assert worth_saving(None, saved) and not worth_saving(saved, None)
    assert not worth_saving(saved, HighWater(run_id=RUN, step=124, seen=NOW + SAVE_PERIOD / 2))
    assert worth_saving(saved, HighWater(run_id=RUN, step=124, seen=NOW + SAVE_PERIOD))
    assert worth_saving(saved, HighWater(run_id=RUN, step=125, seen=NOW + 0.3))


def test_the_mark_survives_a_restart_and_damage_reads_as_no_mark(tmp_path: Path) -> None:
    assert load_high_water(tmp_path, RUN) is None
    mark = HighWater(run_id=RUN, step=124, seen=NOW)
    save_high_water(tmp_path, mark)
    assert load_high_water(tmp_path, RUN) == mark
    assert load_high_water(tmp_path, "another-run") is None
    for garbage in [b"", b"{", b"\xff" * 10, b'{"run_id": 1}', b"[" * 100_000, msgspec.json.encode([1, 2])]:
        (tmp_path / HIGH_WATER_FILE).write_bytes(garbage)
        assert load_high_water(tmp_path, RUN) is None
    assert [p.name for p in tmp_path.iterdir()] == [HIGH_WATER_FILE]  # no temporary file left


# ------------------------------------------------------------------ the read, on a split DHT


async def start_node(nursery: trio.Nursery, role: str, initial: Node | None = None) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with open_node(
            Identity.generate(),
            RUN,
            role,  # type: ignore[arg-type]
            listen=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=[initial.host.listen_addrs[0]] if initial else [],
        ) as node:
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


async def publish(node: Node, step: int) -> None:
    progress = Progress(step=step, samples=0, samples_per_second=1.0, time=time.time(), params=b"p")
    value = msgspec.msgpack.encode(progress)
    await node.dht.store(PROGRESS_KEY, value, time.time() + PROGRESS_TTL, subkey=node.peer_id.encode())


async def test_a_split_dht_is_read_through_the_other_sides_backbone(nursery: trio.Nursery) -> None:
    """After a backbone restart the DHT was in two halves: our own lookup saw nobody, so the volunteer
    stepped alone. A lookup seeded at each known backbone sees the other half."""
    restarted, other = await start_node(nursery, "backbone"), await start_node(nursery, "backbone")
    me = await start_node(nursery, "volunteer", restarted)
    trainer = await start_node(nursery, "volunteer", other)  # the collaboration, on the other half
    await publish(trainer, 124)
    await publish(me, 90)
    # the manifest lists the other half's backbone; our half's backbone is found by its presence record
    presence = Presence(role="backbone", addrs=restarted.host.listen_addrs[:8])
    await restarted.dht.store(
        PRESENCE_KEY, msgspec.msgpack.encode(presence), time.time() + 60, subkey=restarted.peer_id.encode()
    )
    listed = [other.host.listen_addrs[0], "/ip4/127.0.0.1/tcp/1", "not an address"]
    seeds = await known_backbones(me.dht, listed)
    assert {s.peer_id for s in seeds} == {restarted.peer_id, other.peer_id}
    own_only = await read_progress_everywhere(me, [])
    assert [set(r.records) for r in own_only] == [{me.peer_id}]
    readings = await read_progress_everywhere(me, seeds)
    assert all(r.answered for r in readings) and len(readings) == 3
    assert any(trainer.peer_id in r.records for r in readings)
    now = time.time()
    assert lone_step(own_only, me.peer_id, 90, None, now=now, read_at=now, target_batch=TARGET).allowed
    assert not lone_step(readings, me.peer_id, 90, None, now=now, read_at=now, target_batch=TARGET).allowed


def test_the_marks_state_is_lost_only_when_its_announced_holders_failed_us_and_we_are_not_alone() -> None:
    """Rule (d): a witness (every announced holder of step >= H failed our download), not an absence."""
    failed = {"dead", "liar"}.__contains__
    died = [(9, ["dead"]), (1, ["backbone"])]
    assert state_lost(9, died, failed, company=True)
    assert state_lost(9, [(12, ["liar"]), *died], failed, company=True)  # every holder of >= H failed
    # alone: whatever we witnessed, we may be the one cut off (rule (b) keeps us waiting)
    assert not state_lost(9, died, failed, company=False)
    # nothing of step >= H announced: no witness (a split DHT's half reads no announcement of H at all)
    assert not state_lost(9, [(1, ["backbone"])], failed, company=True)
    assert not state_lost(9, [], failed, company=True)
    # one holder of step >= H that did not fail us: the state is there
    assert not state_lost(9, [(9, ["dead", "alive"]), (1, ["backbone"])], failed, company=True)
    assert not state_lost(9, [(10, ["alive"]), *died], failed, company=True)


def test_the_marks_state_is_lost_when_every_peer_that_held_it_restarted_or_failed_us() -> None:
    """Rule (d), witness (B): nothing of step >= H is announced, and every peer that held H when the
    collaboration last showed it to us is seen holding an older state (restarted), left, or failed us."""
    failed = {"dead"}.__contains__
    restarted = {"v1", "v2"}.__contains__
    assert state_lost(9, [(1, ["backbone"])], failed, company=True, holders=["v1", "v2"], gone=restarted)
    assert state_lost(9, [], failed, company=True, holders=["v1", "dead"], gone=restarted)
    # one holder we do not see at all (the other half of a split?): no witness
    assert not state_lost(9, [], failed, company=True, holders=["v1", "v3"], gone=restarted)
    # no holders known (a mark read back from disk), or alone: no witness
    assert not state_lost(9, [], failed, company=True, holders=[], gone=restarted)
    assert not state_lost(9, [], failed, company=False, holders=["v1"], gone=restarted)
    # somebody still announces it and did not fail us: it is there
    assert not state_lost(9, [(9, ["alive"])], failed, company=True, holders=["v1"], gone=restarted)
