"""A volunteer remembers the run's backbones from the manifest served at each start
(:func:`volunteer.admission.remember_manifest`): backbones added after its admission are known at its next
start, a manifest that lists fewer makes it forget none, and another run's manifest is refused."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from protocols.api import Manifest
from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import OpenAuthenticator
from shared.auth.keys import Identity
from shared.errors import AdmissionError
from volunteer.admission import CREDENTIAL_FILE, Admission, Credential, remember_manifest

ONE = "https://127.0.0.1:8443"
TWO = "https://127.0.0.1:9443"
BB1 = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWAJjbRkp8FPF5MKgMU53aUTxWkqvDrs4zc1VMbwRwfsbE"
BB2 = "/ip4/127.0.0.1/tcp/4002/p2p/12D3KooWAJjbRkp8FPF5MKgMU53aUTxWkqvDrs4zc1VMbwRwfsbE"


def admitted(tmp_path: Path) -> tuple[Admission, Manifest]:
    authority = Authority.load_or_create(tmp_path / "authority.key")
    run_id = pin_run_id("run", authority)
    me = Identity.generate()
    token = authority.issue_token(run_id, "alice", me.peer_id, me.public_key_bytes, time.time(), 600)
    manifest = Manifest(run_id, authority.identity.public_key_bytes, backbones=[BB1], api=[ONE])
    credential = Credential(run_id, "alice", token, manifest)
    return Admission(run_id, OpenAuthenticator(), [BB1], credential), manifest


def test_a_new_backbone_is_remembered_and_none_forgotten(tmp_path: Path) -> None:
    admission, saved = admitted(tmp_path)
    assert not remember_manifest(admission, tmp_path, saved)  # nothing new: nothing written
    assert not (tmp_path / CREDENTIAL_FILE).exists()

    grown = msgspec.structs.replace(saved, backbones=[BB2], api=[TWO])  # served by backbone 2
    assert remember_manifest(admission, tmp_path, grown)
    assert admission.credential is not None
    assert admission.credential.manifest.api == [TWO, ONE]
    assert admission.credential.manifest.backbones == [BB2, BB1]
    on_disk = msgspec.json.decode((tmp_path / CREDENTIAL_FILE).read_bytes(), type=Credential)
    assert on_disk == admission.credential
    assert not remember_manifest(admission, tmp_path, saved)  # backbone 1 alone again: nothing lost


def test_a_manifest_of_another_run_is_refused(tmp_path: Path) -> None:
    admission, saved = admitted(tmp_path)
    other = Authority.load_or_create(tmp_path / "other.key")
    foreign = msgspec.structs.replace(saved, authority_public_key=other.identity.public_key_bytes, api=[TWO])
    with pytest.raises(AdmissionError):
        remember_manifest(admission, tmp_path, foreign)
    assert admission.credential is not None and admission.credential.manifest.api == [ONE]
