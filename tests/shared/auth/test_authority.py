"""Authority keys, pinned run ids, tokens and revocations; the replay cache."""

from __future__ import annotations

import time

import msgspec
import pytest

from protocols.auth import SignedToken, authority_fingerprint, split_run_id
from protocols.codes import ErrorCode
from shared.auth.authority import Authority, AuthorityKey, pin_run_id
from shared.auth.guard import ReplayCache, RunAuthenticator
from shared.auth.keys import Identity
from shared.errors import AuthError, ConfigError


def test_pin_run_id_appends_the_authority_fingerprint_and_checks_an_existing_one() -> None:
    authority = Authority(Identity.generate())
    pinned = pin_run_id("my-run", authority)
    assert pinned == f"my-run@{authority.fingerprint}"
    assert split_run_id(pinned) == ("my-run", authority.fingerprint)
    assert pin_run_id(pinned, authority) == pinned
    with pytest.raises(ConfigError, match=r"copy the run's authority\.key"):
        pin_run_id(pinned, Authority(Identity.generate()))
    with pytest.raises(ConfigError, match="invalid"):
        pin_run_id("bad name!", authority)


def test_split_run_id_treats_ids_without_fingerprint_as_open() -> None:
    assert split_run_id("demo") == ("demo", None)
    assert split_run_id("@x") == ("@x", None)


def test_authority_key_for_run_accepts_only_the_pinned_key() -> None:
    authority = Authority(Identity.generate())
    run = pin_run_id("r", authority)
    assert AuthorityKey.for_run(run, authority.identity.public_key_bytes).fingerprint == authority.fingerprint
    with pytest.raises(AuthError):
        AuthorityKey.for_run(run, Identity.generate().public_key_bytes)
    with pytest.raises(AuthError):
        AuthorityKey.for_run("open-run", authority.identity.public_key_bytes)
    assert authority_fingerprint(authority.identity.public_key_bytes) == authority.fingerprint


def test_tokens_verify_and_any_tampering_breaks_them() -> None:
    authority = Authority(Identity.generate())
    member = Identity.generate()
    run = pin_run_id("r", authority)
    signed = authority.issue_token(run, "alice", member.peer_id, member.public_key_bytes, time.time(), 60)
    access = authority.key.verify_token(signed)
    assert (access.username, access.peer_id, access.run_id) == ("alice", member.peer_id, run)
    for i in range(0, len(signed.token), 7):
        tampered = bytearray(signed.token)
        tampered[i] ^= 1
        with pytest.raises(AuthError) as info:
            authority.key.verify_token(SignedToken(token=bytes(tampered), signature=signed.signature))
        assert info.value.code == ErrorCode.BAD_TOKEN


def test_revocations_verify_only_for_their_run_and_authority() -> None:
    authority = Authority(Identity.generate())
    run = pin_run_id("r", authority)
    signed = authority.revoke(run, "bob", 123.0)
    assert authority.key.verify_revocation(signed, run).username == "bob"
    with pytest.raises(AuthError):
        authority.key.verify_revocation(signed, pin_run_id("other", authority))
    with pytest.raises(AuthError):
        Authority(Identity.generate()).key.verify_revocation(signed, run)
    forged = msgspec.structs.replace(signed, signature=bytes(64))
    with pytest.raises(AuthError):
        authority.key.verify_revocation(forged, run)


def test_run_authenticator_refuses_to_adopt_a_token_of_another_peer() -> None:
    authority = Authority(Identity.generate())
    run = pin_run_id("r", authority)
    me, other = Identity.generate(), Identity.generate()
    auth = RunAuthenticator(run, authority.key, me)
    with pytest.raises(AuthError) as info:
        auth.sign_request("x", "k", 1, b"")
    assert info.value.code == ErrorCode.UNAUTHENTICATED
    with pytest.raises(AuthError):
        auth.set_token(
            authority.issue_token(run, "a", other.peer_id, other.public_key_bytes, time.time(), 60)
        )
    auth.set_token(authority.issue_token(run, "a", me.peer_id, me.public_key_bytes, time.time(), 60))
    assert auth.token is not None


def test_replay_cache_forgets_after_its_window_and_stays_bounded() -> None:
    cache = ReplayCache(window=10, max_entries=3)
    assert cache.check_and_add("p", b"1", now=0)
    assert not cache.check_and_add("p", b"1", now=5)
    assert cache.check_and_add("q", b"1", now=5)  # per peer
    assert cache.check_and_add("p", b"1", now=20)  # window passed
    for i in range(10):
        cache.check_and_add("p", bytes([i]), now=21)
    assert len(cache._seen) <= 3
