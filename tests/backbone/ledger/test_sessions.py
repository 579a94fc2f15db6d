"""Sessions in the ledger: one per volunteer process, opened by its first heartbeat, closed by its leave,
by a restart of the same peer (a new token) or by silence (SQLite and PostgreSQL, see ``ledger_url``)."""

from __future__ import annotations

from backbone.ledger import LedgerStore, SessionRow

from .reports import T0, identity
from .test_store import join

LAPTOP, DESKTOP = identity(31), identity(32)
ADDRESS = "192.0.2.1"
FIRST, SECOND = "a" * 32, "b" * 32


def ended(store: LedgerStore) -> list[tuple[str | None, float | None, str | None]]:
    return [(s.token, s.ended_at, s.end_reason) for s in store.sessions(LAPTOP.peer_id)]


def test_a_heartbeat_opens_a_session_and_the_leave_closes_it(store: LedgerStore) -> None:
    join(store, "ana", LAPTOP)
    assert store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0) is True
    assert store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0 + 20) is True
    [session] = store.sessions(LAPTOP.peer_id)
    assert session == SessionRow(LAPTOP.peer_id, FIRST, ADDRESS, T0, T0 + 20, None, None)
    assert store.leave_session(LAPTOP.peer_id, FIRST, now=T0 + 25) is True
    assert ended(store) == [(FIRST, T0 + 25, "leave")]
    # a late heartbeat or a second leave of that process changes nothing
    assert store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0 + 30) is False
    assert store.leave_session(LAPTOP.peer_id, FIRST, now=T0 + 31) is False
    assert ended(store) == [(FIRST, T0 + 25, "leave")]


def test_a_restart_opens_a_new_session_and_closes_the_killed_ones_at_its_last_heartbeat(
    store: LedgerStore,
) -> None:
    join(store, "ana", LAPTOP, DESKTOP)
    store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0)
    store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0 + 20)
    store.session_heartbeat(DESKTOP.peer_id, FIRST, ADDRESS, now=T0 + 21)  # another machine: its own
    # SIGKILL at T0 + 30, restarted with the same data dir (same peer id) at T0 + 40
    store.session_heartbeat(LAPTOP.peer_id, SECOND, ADDRESS, now=T0 + 40)
    assert ended(store) == [(FIRST, T0 + 20, "replaced"), (SECOND, None, None)]
    assert [(s.ended_at, s.end_reason) for s in store.sessions(DESKTOP.peer_id)] == [(None, None)]


def test_a_silent_session_is_closed_at_its_last_heartbeat_and_reopened_if_it_was_alive(
    store: LedgerStore,
) -> None:
    join(store, "ana", LAPTOP, DESKTOP)
    store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0)
    store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0 + 20)
    store.session_heartbeat(DESKTOP.peer_id, FIRST, ADDRESS, now=T0 + 100)
    assert store.close_silent_sessions(silent_since=T0 + 20) == 0  # heard at the cutoff: open
    assert store.close_silent_sessions(silent_since=T0 + 50) == 1  # the laptop only
    assert ended(store) == [(FIRST, T0 + 20, "timeout")]
    assert [s.end_reason for s in store.sessions(DESKTOP.peer_id)] == [None]
    assert store.close_silent_sessions(silent_since=T0 + 150) == 1  # the desktop; the laptop is closed
    assert [s.ended_at for s in store.sessions(DESKTOP.peer_id)] == [T0 + 100]
    # the laptop was alive all along (the backbone could not hear it): its next heartbeat reopens it
    assert store.session_heartbeat(LAPTOP.peer_id, FIRST, ADDRESS, now=T0 + 300) is True
    assert ended(store) == [(FIRST, None, None)]
    assert store.leave_session(LAPTOP.peer_id, FIRST, now=T0 + 310) is True
    assert ended(store) == [(FIRST, T0 + 310, "leave")]
