"""A volunteer redeeming invites at a real pinned API in this process (issue 11, item 7): a refused invite
says what happened once and what to do; a machine admitted before carries on with its saved credential
when the invite it is (still) given has been used up or revoked since."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from protocols.api import Invite, encode_invite
from shared.auth.keys import Identity
from shared.errors import AdmissionError
from tests.backbone.pinned_api import PinnedApi, serve_pinned_api
from volunteer.admission import admit


def invite(api: PinnedApi, username: str, max_uses: int | None = None) -> str:
    api.store.add_user(username, now=time.time())
    secret = api.store.create_invite(username, now=time.time(), max_uses=max_uses)
    return encode_invite(Invite(api.run_id, api.urls, secret))


async def test_a_used_up_invite_is_refused_once_with_what_to_do(tmp_path: Path) -> None:
    for machine in ("a", "b"):
        (tmp_path / machine).mkdir()  # the CLI has made and locked the data dir
    async with serve_pinned_api(tmp_path / "bb") as api:
        code = invite(api, "alice", max_uses=1)
        first = await admit(api.run_id, tmp_path / "a", Identity.generate(), code, [])
        assert first.credential is not None and first.credential.username == "alice"
        with pytest.raises(AdmissionError) as refused:
            await admit(api.run_id, tmp_path / "b", Identity.generate(), code, [])
        assert str(refused.value) == (
            "the invite has been used by as many machines as it allows: ask the run's organizers for a "
            "new invite"
        )


async def test_a_machine_admitted_before_carries_on_when_its_invite_is_refused_now(tmp_path: Path) -> None:
    async with serve_pinned_api(tmp_path / "bb") as api:
        machine, data_dir = Identity.generate(), tmp_path / "a"
        data_dir.mkdir()
        (tmp_path / "new").mkdir()
        code = invite(api, "bob")
        await admit(api.run_id, data_dir, machine, code, [])
        api.store.remove_user("bob", now=time.time())  # revokes the invite too ...
        api.store.add_user("bob", now=time.time())  # ... and bob is back, his machines with him
        again = await admit(api.run_id, data_dir, machine, code, [])  # VOLUNTEER_INVITE still set
        assert again.credential is not None and again.credential.username == "bob"
        with pytest.raises(AdmissionError, match=r"^the invite has been revoked: ask the run's organizers"):
            await admit(api.run_id, tmp_path / "new", Identity.generate(), code, [])
