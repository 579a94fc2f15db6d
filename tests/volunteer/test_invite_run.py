"""Which run `volunteer join [RUN_ID] [--invite CODE]` joins (issue 11, item 7): the invite pins its run,
a run id that contradicts it is refused naming the invite's run, and a garbled code is one plain
sentence, not a decoder's message."""

from __future__ import annotations

import base64
from pathlib import Path

import msgspec
import pytest

from protocols.api import Invite, Manifest, encode_invite
from shared.auth.authority import Authority, pin_run_id
from shared.auth.keys import Identity
from shared.errors import ConfigError
from volunteer.admission import CREDENTIAL_FILE, Credential, run_to_join

AUTHORITY = Authority(Identity.generate())
RUN = pin_run_id("inv", AUTHORITY)
CODE = encode_invite(Invite(RUN, ["https://127.0.0.1:8443"], "s" * 43))


@pytest.mark.parametrize("run_id", [None, "inv", RUN])
def test_the_invite_pins_the_run(tmp_path: Path, run_id: str | None) -> None:
    assert run_to_join(run_id, CODE, tmp_path) == RUN


@pytest.mark.parametrize(
    "run_id", ["other", "inv@" + "x" * 16, pin_run_id("inv", Authority(Identity.generate()))]
)
def test_a_run_id_the_invite_is_not_for_is_refused_naming_the_invites_run(
    tmp_path: Path, run_id: str
) -> None:
    with pytest.raises(
        ConfigError, match=f"this invite is for run {RUN}, not {run_id}: leave the run id out"
    ):
        run_to_join(run_id, CODE, tmp_path)


@pytest.mark.parametrize(
    "garbled",
    [
        "hello",
        "dli1_",
        "dli1_" + base64.urlsafe_b64encode(msgspec.msgpack.encode({"a": 1})).decode(),  # not an array
        CODE[:40],  # cut short
        CODE[:-3] + "!!!",
        "dli1_" + "A" * 3000,
    ],
)
def test_a_garbled_invite_is_one_plain_sentence(tmp_path: Path, garbled: str) -> None:
    with pytest.raises(ConfigError) as refused:
        run_to_join(None, garbled, tmp_path)
    message = str(refused.value)
    assert message.startswith("this is not a valid invite code (") and message.endswith(")")
    assert "Expected" not in message and "\n" not in message


def test_without_an_invite_a_bare_name_or_nothing_means_the_run_this_data_dir_joined(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="which run"):
        run_to_join(None, None, tmp_path)
    assert run_to_join("inv", None, tmp_path) == "inv"  # never admitted: an open run of that name
    identity = Identity.generate()
    token = AUTHORITY.issue_token(RUN, "alice", identity.peer_id, identity.public_key_bytes, 0.0, 3600)
    manifest = Manifest(run_id=RUN, authority_public_key=AUTHORITY.identity.public_key_bytes)
    (tmp_path / CREDENTIAL_FILE).write_bytes(msgspec.json.encode(Credential(RUN, "alice", token, manifest)))
    assert run_to_join(None, None, tmp_path) == RUN
    assert run_to_join("inv", None, tmp_path) == RUN
    assert run_to_join("other", None, tmp_path) == "other"


def test_an_unreadable_credential_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """run_to_join reads the credential before the data dir is checked: an unreadable one (here a
    directory in its place; root reads any file) escaped as a traceback (review)."""
    (tmp_path / CREDENTIAL_FILE).mkdir()
    with pytest.raises(ConfigError, match=f"cannot read {tmp_path / CREDENTIAL_FILE}"):
        run_to_join("my-run", None, tmp_path)
