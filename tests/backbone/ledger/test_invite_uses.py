"""Invites with a maximum number of uses (``backbone allow add --max-uses N``), on SQLite and PostgreSQL:
a use is a machine that was not a peer of the invite's user yet, and the last use goes to one machine
however many join at once, also through two backbones (two stores) on one database."""

from __future__ import annotations

import pytest

from backbone.ledger import InviteRejected, LedgerStore
from shared.errors import ConfigError

from .reports import T0, identity
from .test_store import race

MACHINES = [identity(n) for n in range(100, 110)]
LAPTOP, DESKTOP, SERVER = MACHINES[:3]


def redeem(store: LedgerStore, secret: str, n: int) -> str:
    machine = MACHINES[n]
    return store.redeem_invite(secret, machine.peer_id, machine.public_key_bytes, now=T0 + 1)


def outcome(store: LedgerStore, secret: str, n: int) -> str:
    try:
        return redeem(store, secret, n)
    except InviteRejected as exc:
        return exc.reason


def test_a_use_is_a_new_machine_of_the_user_and_the_last_one_is_refused(store: LedgerStore) -> None:
    store.add_user("alice", now=T0)
    store.add_user("bob", now=T0)
    secret = store.create_invite("alice", now=T0, max_uses=2)
    assert redeem(store, secret, 0) == "alice"
    assert redeem(store, secret, 0) == "alice"  # the same machine again: a restart, not a use
    bobs = store.create_invite("bob", now=T0)
    assert redeem(store, bobs, 1) == "bob"
    assert redeem(store, secret, 1) == "alice"  # bob's machine moves to alice: a use
    with pytest.raises(InviteRejected) as rejected:
        redeem(store, secret, 2)
    assert rejected.value.reason == "used up"
    assert str(rejected.value) == "the invite has been used by as many machines as it allows"
    assert redeem(store, secret, 1) == "alice"  # machines it admitted still re-join with it
    assert store.user_of_peer(SERVER.peer_id) is None
    assert redeem(store, store.create_invite("alice", now=T0), 2) == "alice"  # another invite has room


def test_an_invite_without_max_uses_admits_any_number_of_machines(store: LedgerStore) -> None:
    store.add_user("carol", now=T0)
    secret = store.create_invite("carol", now=T0)
    assert [redeem(store, secret, n) for n in range(len(MACHINES))] == ["carol"] * len(MACHINES)


@pytest.mark.parametrize("bad", [0, -1, 10**7])
def test_max_uses_must_be_positive_and_bounded(store: LedgerStore, bad: int) -> None:
    store.add_user("dave", now=T0)
    with pytest.raises(ConfigError, match="uses"):
        store.create_invite("dave", now=T0, max_uses=bad)


def test_machines_racing_for_the_last_use_admit_exactly_one(ledger_url: str) -> None:
    """Two backbones on one database (two stores, two connection pools) and several joins each: every
    machine races for the one use left; exactly one is admitted."""
    with LedgerStore.open(ledger_url) as first, LedgerStore.open(ledger_url) as second:
        first.add_user("erin", now=T0)
        secret = first.create_invite("erin", now=T0, max_uses=2)
        assert redeem(first, secret, 9) == "erin"
        stores = [first, second]
        results = race(8, lambda n: outcome(stores[n % 2], secret, n))
        assert sorted(results) == ["erin"] + ["used up"] * 7
        [erin] = first.list_users()
        assert len(erin.peers) == 2


def test_one_machine_joining_twice_at_once_with_the_last_use_is_admitted_both_times(ledger_url: str) -> None:
    with LedgerStore.open(ledger_url) as first, LedgerStore.open(ledger_url) as second:
        first.add_user("finn", now=T0)
        secret = first.create_invite("finn", now=T0, max_uses=1)
        stores = [first, second]
        assert race(6, lambda n: redeem(stores[n % 2], secret, 0)) == ["finn"] * 6
        assert outcome(second, secret, 1) == "used up"
