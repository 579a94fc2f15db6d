"""Who was removed from a run is the organizers' business (issue 11, item 7): a volunteer logs its own
user's removal by name, and other users' removals (and their dropped DHT records) only as counts at
DEBUG; a backbone names every removed user."""

from __future__ import annotations

import logging
import time

import pytest
import trio

from protocols.presence import Role
from protocols.training import PROGRESS_KEY
from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import RunAuthenticator
from shared.auth.keys import Identity
from shared.dht.admission import AdmissionValidator
from shared.dht.keys import key_id
from shared.dht.node import DHTConfig
from shared.dht.records import sign_record
from shared.errors import RecordRejected
from shared.node import Node, open_node

AUTHORITY = Authority(Identity.generate())
RUN = pin_run_id("revocation-log", AUTHORITY)
CONFIG = DHTConfig(rpc_deadline=5.0, leave_deadline=1.0)


async def run_node(
    nursery: trio.Nursery, user: str, role: Role, initial: list[str], stop: trio.CancelScope | None = None
) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        identity = Identity.generate()
        token = AUTHORITY.issue_token(
            RUN, user, identity.peer_id, identity.public_key_bytes, time.time(), 3600
        )
        auth = RunAuthenticator(RUN, AUTHORITY.key, identity, token)
        with stop or trio.CancelScope():
            async with open_node(
                identity,
                RUN,
                role,
                listen=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=initial,
                dht_config=CONFIG,
                authenticator=auth,
            ) as node:
                task_status.started(node)
                await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


async def until(condition: object) -> None:
    with trio.fail_after(60):
        while not condition():  # type: ignore[operator]
            await trio.sleep(0.05)


def revoked(node: Node) -> set[str]:
    auth = node.host.authenticator
    assert isinstance(auth, RunAuthenticator)
    return auth.revoked


@pytest.mark.parametrize("role", ["volunteer", "backbone"])
async def test_a_volunteer_does_not_log_other_users_names_when_they_are_removed(
    role: Role, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with trio.open_nursery() as nursery:
        carol = await run_node(nursery, "carol", role, [])
        dave = await run_node(nursery, "dave", role, [carol.host.listen_addrs[0]])
        gone = trio.CancelScope()
        alice = await run_node(nursery, "alice", role, [carol.host.listen_addrs[0]], gone)
        mine = alice.peer_id.encode()
        await alice.dht.store(PROGRESS_KEY, b"p", time.time() + 60, subkey=mine)
        await until(lambda: any(r.writer == alice.peer_id for r in carol.dht.storage.records()))
        gone.cancel()  # alice's machine is off: only carol and dave watch her removal
        await dave.publish_revocation("alice", AUTHORITY.revoke(RUN, "alice", time.time()))
        await until(lambda: "alice" in revoked(carol) and "alice" in revoked(dave))
        await until(lambda: not any(r.writer == alice.peer_id for r in carol.dht.storage.records()))
        await dave.publish_revocation("carol", AUTHORITY.revoke(RUN, "carol", time.time()))
        await until(lambda: "carol" in revoked(carol))
        nursery.cancel_scope.cancel()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("shared.")]
    named = [(level, text) for level, text in lines if "alice" in text]
    own = (logging.WARNING, "user carol has been removed from the run")
    assert own in lines  # carol's own removal is logged by name either way
    if role == "backbone":
        assert any(level == logging.WARNING and "user alice has been removed" in t for level, t in named)
    else:
        assert named == []
        counts = [text for level, text in lines if level == logging.DEBUG and "other user(s) removed" in text]
        assert counts


@pytest.mark.parametrize("revoked_too", [True, False])
def test_a_rejected_record_of_a_removed_or_expired_user_does_not_name_the_user(revoked_too: bool) -> None:
    """Nodes log the records they reject (``ignoring an invalid record in a lookup: …``)."""
    writer = Identity.generate()
    now = time.time()
    token = AUTHORITY.issue_token(RUN, "alice", writer.peer_id, writer.public_key_bytes, now - 7200, 3600)
    record = sign_record(writer, key_id(PROGRESS_KEY), b"p", now + 86400, writer.peer_id.encode(), token)
    validator = AdmissionValidator(RUN, AUTHORITY.key, {"alice"} if revoked_too else set())
    with pytest.raises(RecordRejected) as rejected:
        validator.validate(record, now)
    assert "alice" not in str(rejected.value)
    assert ("has been removed" if revoked_too else "token expired") in str(rejected.value)
