"""Getting admitted to a pinned run, staying admitted, and noticing when we are not any more.

1. **Credential**: an invite (``--invite`` / ``VOLUNTEER_INVITE``) is redeemed at the backbone API for an
   access token; the token, the username and the run's manifest are saved as ``credential.json`` (0600) in
   the data dir, so later joins need no invite. A saved token close to expiry is refreshed first.
2. **Trust**: the manifest's authority key must be the one the run id pins; the token must be that
   authority's, for this run and this peer.
3. **Backbones**: the manifest a backbone serves at each start is merged into the saved one
   (:func:`remember_manifest`): its API URLs and backbone addresses first, then the saved ones it does
   not list (up to the manifest's bounds), so that backbones added after our admission are known at the
   next start, and one backbone that does not know the others makes us forget none. Its authority key
   must be the one the run id pins: it is believed exactly as much as the manifest saved at admission.
4. **Freshness**: :func:`keep_admitted` refreshes the token at two thirds of its lifetime without
   interrupting work, and ends the daemon with a clear error when the run has removed our user.
Open runs (no ``@`` in the run id) skip all of this.

**Which run.** An invite names its run (``name@fingerprint``): it pins the run, so ``volunteer join
--invite CODE`` needs no run id, and a run id given with it must be that run (or its bare name) —
anything else is refused with the invite's run named. Without an invite, a bare name (or no run id at
all) means the pinned run of that name this data dir was admitted to, if any (:func:`run_to_join`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from protocols.api import Invite, Manifest, decode_invite
from protocols.auth import AccessToken, SignedToken, split_run_id
from protocols.errors import DECODE_FAILURES
from shared.auth.authority import AuthorityKey
from shared.auth.guard import Authenticator, OpenAuthenticator, RunAuthenticator
from shared.auth.keys import Identity
from shared.errors import AdmissionError, AuthError, ConfigError, PeerUnavailable

from .api_client import ApiClient, Refused

__all__ = ["Admission", "Credential", "admit", "keep_admitted", "remember_manifest", "run_to_join"]

logger = logging.getLogger("volunteer")
CREDENTIAL_FILE = "credential.json"
RETRY = 30.0
MAX_API_URLS = 16  # protocols.api.Manifest's bounds
MAX_BACKBONES = 64


class Credential(msgspec.Struct, frozen=True):
    run_id: str
    username: str
    token: SignedToken
    manifest: Manifest


@dataclass
class Admission:
    run_id: str
    authenticator: Authenticator
    initial_peers: list[str]
    credential: Credential | None = None
    access: AccessToken | None = None


def _load(data_dir: Path, run_id: str) -> Credential | None:
    try:
        credential = msgspec.json.decode((data_dir / CREDENTIAL_FILE).read_bytes(), type=Credential)
    except FileNotFoundError:
        return None
    except DECODE_FAILURES:
        logger.warning("ignoring a damaged %s", data_dir / CREDENTIAL_FILE)
        return None
    return credential if credential.run_id == run_id else None


def _decoded(invite: str) -> Invite:
    try:
        return decode_invite(invite)
    except ValueError as exc:
        raise ConfigError(f"this is not a valid invite code ({exc})") from exc


def run_to_join(run_id: str | None, invite: str | None, data_dir: Path) -> str:
    """The run ``volunteer join [RUN_ID] [--invite CODE]`` joins (see **Which run** above).

    Raises:
        ConfigError: the invite is not a valid code, names another run than ``run_id``, or neither a run
            id nor an invite was given and the data dir holds no credential.
    """
    if invite:
        code = _decoded(invite)
        if run_id is not None and run_id not in (code.run_id, split_run_id(code.run_id)[0]):
            raise ConfigError(
                f"this invite is for run {code.run_id}, not {run_id}: leave the run id out to join "
                f"{code.run_id}, or ask the organizers of {run_id} for their invite"
            )
        return code.run_id
    if run_id is not None and split_run_id(run_id)[1] is not None:
        return run_id
    saved = _load_any(data_dir)
    if saved is not None and (run_id is None or split_run_id(saved.run_id)[0] == run_id):
        logger.info("joining run %s (admitted before, see %s)", saved.run_id, data_dir / CREDENTIAL_FILE)
        return saved.run_id
    if run_id is None:
        raise ConfigError(
            "which run? give its run id, or the invite code its organizers sent you (--invite, or the "
            "VOLUNTEER_INVITE environment variable)"
        )
    return run_id  # an open run (no '@'): no admission


def _load_any(data_dir: Path) -> Credential | None:
    try:
        return msgspec.json.decode((data_dir / CREDENTIAL_FILE).read_bytes(), type=Credential)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # unreadable (permissions, an I/O error): the user's data dir, not ours to guess
        raise ConfigError(f"cannot read {data_dir / CREDENTIAL_FILE}: {exc.strerror or exc}") from exc
    except DECODE_FAILURES:
        return None  # _load warns when the run's join reads it


def _save(data_dir: Path, credential: Credential) -> None:
    path = data_dir / CREDENTIAL_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(credential))
    tmp.replace(path)


def _checked(run_id: str, credential: Credential, identity: Identity) -> tuple[AuthorityKey, AccessToken]:
    try:
        authority = AuthorityKey.for_run(run_id, credential.manifest.authority_public_key)
        access = authority.verify_token(credential.token)
    except AuthError as exc:
        raise AdmissionError(f"the backbone's answer does not check out against run {run_id}: {exc}") from exc
    if access.run_id != run_id or access.peer_id != identity.peer_id:
        raise AdmissionError("the backbone issued a token for another run or peer")
    return authority, access


async def admit(
    run_id: str, data_dir: Path, identity: Identity, invite: str | None, initial_peers: Sequence[str]
) -> Admission:
    """Get (or reload) this peer's credential for ``run_id``.

    Raises:
        ConfigError: the invite is malformed or for another run.
        AdmissionError: no invite and no saved credential, or the backbone refused us.
        PeerUnavailable: no backbone API answered.
    """
    if split_run_id(run_id)[1] is None:
        return Admission(run_id, OpenAuthenticator(), list(initial_peers))
    saved = _load(data_dir, run_id)
    if invite:
        code = _decoded(invite)
        if code.run_id != run_id:
            raise ConfigError(f"this invite is for run {code.run_id}, not {run_id}")
        try:
            response = await ApiClient(run_id, code.api).join(code.secret, identity)
        except Refused as exc:
            if exc.code != "invite_rejected":
                raise
            if saved is None:
                raise AdmissionError(f"{exc.reason}: ask the run's organizers for a new invite") from exc
            # Admitted before (VOLUNTEER_INVITE stays set in a notebook): the saved credential decides.
            logger.warning(
                "%s; joining with the credential saved in %s", exc.reason, data_dir / CREDENTIAL_FILE
            )
            credential, invite = saved, None
        else:
            credential = Credential(run_id, response.username, response.token, response.manifest)
            logger.info("admitted to run %s as user %s", run_id, response.username)
    elif saved is not None:
        credential = saved
    else:
        raise AdmissionError(
            f"run {run_id} admits invited volunteers only: ask its organizers for an invite code and "
            "pass it with --invite (or set VOLUNTEER_INVITE)"
        )
    authority, access = _checked(run_id, credential, identity)
    if invite is None and _needs_refresh(access, time.time()):
        credential, access = await _refresh(credential, identity)
    _save(data_dir, credential)
    auth = RunAuthenticator(run_id, authority, identity, credential.token)
    return Admission(
        run_id, auth, list(initial_peers) or list(credential.manifest.backbones), credential, access
    )


def remember_manifest(admission: Admission, data_dir: Path, manifest: Manifest) -> bool:
    """Merge ``manifest`` (served by a backbone of the run, checked by :meth:`ApiClient.manifest`) into
    the saved credential's (point 3 of the module docstring); returns whether the saved one changed.

    Raises:
        AdmissionError: the manifest is not one of this run (another run id or authority key).
    """
    credential = admission.credential
    if credential is None:
        return False
    if manifest.run_id != credential.run_id or manifest.authority_public_key != (
        credential.manifest.authority_public_key
    ):
        raise AdmissionError(f"a manifest of another run than {credential.run_id} was served")
    saved = credential.manifest
    merged = msgspec.structs.replace(
        manifest,
        api=_merged(manifest.api, saved.api, MAX_API_URLS),
        backbones=_merged(manifest.backbones, saved.backbones, MAX_BACKBONES),
    )
    if set(merged.api) == set(saved.api) and set(merged.backbones) == set(saved.backbones):
        return False  # nothing new (the order is the first manifest's: no rewrite at every start)
    fresh = msgspec.structs.replace(credential, manifest=merged)
    _save(data_dir, fresh)
    admission.credential = fresh
    return True


def _merged(first: list[str], then: list[str], limit: int) -> list[str]:
    return list(dict.fromkeys([*first, *then]))[:limit]


def _needs_refresh(access: AccessToken, now: float) -> bool:
    return now >= access.issued_at + (access.expires_at - access.issued_at) * 2 / 3


async def _refresh(credential: Credential, identity: Identity) -> tuple[Credential, AccessToken]:
    token = await ApiClient(credential.run_id, credential.manifest.api).refresh(credential.token, identity)
    fresh = msgspec.structs.replace(credential, token=token)
    return fresh, _checked(credential.run_id, fresh, identity)[1]


async def keep_admitted(admission: Admission, identity: Identity, data_dir: Path) -> None:
    """Refresh the token ahead of expiry; raise :class:`AdmissionError` once our user is removed."""
    auth = admission.authenticator
    if not isinstance(auth, RunAuthenticator) or admission.credential is None or admission.access is None:
        await trio.sleep_forever()  # open runs have nothing to keep fresh
    assert admission.credential is not None
    assert admission.access is not None
    credential, access = admission.credential, admission.access
    while True:
        if credential.username in auth.revoked:
            raise AdmissionError(f"user {credential.username} has been removed from run {admission.run_id}")
        # A peer said REVOKED: error replies are unsigned, so ask the authority (pinned HTTPS) before
        # believing it; a refresh refused as revoked raises AdmissionError and ends the daemon.
        confirm = auth.refused_as_revoked
        auth.refused_as_revoked = False
        if confirm or _needs_refresh(access, time.time()):
            try:
                credential, access = await _refresh(credential, identity)
            except PeerUnavailable as exc:
                logger.warning("could not refresh the access token (%s); retrying in %.0f s", exc, RETRY)
                await trio.sleep(RETRY)
                continue
            auth.set_token(credential.token)
            await trio.to_thread.run_sync(_save, data_dir, credential)
            logger.info("access token refreshed; valid for %.1f h", (access.expires_at - time.time()) / 3600)
        await trio.sleep(1.0)
