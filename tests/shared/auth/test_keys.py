"""Node identities: load or create the key file, sign, verify (shared.auth.keys)."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from protocols.peer_id import public_key_from_peer_id
from shared.auth.keys import IDENTITY_FILE, Identity, verify, verify_by_peer_id
from shared.errors import ConfigError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_identity_load_or_create_creates_private_key_file_with_mode_600(tmp_path: Path) -> None:
    data_dir = tmp_path / "nested" / "data"

    identity = Identity.load_or_create(data_dir)

    key_file = data_dir / IDENTITY_FILE
    assert _mode(key_file) == 0o600
    assert key_file.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert not list(data_dir.glob("*.tmp"))
    assert identity.peer_id.startswith("12D3KooW")


def test_identity_load_or_create_loads_the_same_identity_again(tmp_path: Path) -> None:
    first = Identity.load_or_create(tmp_path)

    second = Identity.load_or_create(tmp_path)

    assert second.peer_id == first.peer_id
    assert second.public_key_bytes == first.public_key_bytes


def test_identity_load_or_create_tightens_group_readable_file_to_600(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    created = Identity.load_or_create(tmp_path)
    key_file = tmp_path / IDENTITY_FILE
    key_file.chmod(0o644)

    with caplog.at_level(logging.WARNING, logger="shared.auth.keys"):
        loaded = Identity.load_or_create(tmp_path)

    assert _mode(key_file) == 0o600
    assert loaded.peer_id == created.peer_id
    assert "tightening to 600" in caplog.text


def test_identity_load_or_create_rejects_corrupt_file_naming_it(tmp_path: Path) -> None:
    key_file = tmp_path / IDENTITY_FILE
    key_file.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n")

    with pytest.raises(ConfigError, match="not a PEM private key") as info:
        Identity.load_or_create(tmp_path)

    assert str(key_file) in str(info.value)
    assert key_file.read_bytes().startswith(b"-----BEGIN")  # never overwritten


def test_identity_load_or_create_rejects_empty_file_naming_it(tmp_path: Path) -> None:
    key_file = tmp_path / IDENTITY_FILE
    key_file.write_bytes(b"")

    with pytest.raises(ConfigError, match="not a PEM private key") as info:
        Identity.load_or_create(tmp_path)

    assert str(key_file) in str(info.value)


def test_identity_load_or_create_rejects_non_ed25519_key_naming_it(tmp_path: Path) -> None:
    key_file = tmp_path / IDENTITY_FILE
    key_file.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )

    with pytest.raises(ConfigError, match="not an Ed25519 key") as info:
        Identity.load_or_create(tmp_path)

    assert str(key_file) in str(info.value)


def test_identity_load_or_create_rejects_unreadable_path_naming_it(tmp_path: Path) -> None:
    (tmp_path / IDENTITY_FILE).mkdir()

    with pytest.raises(ConfigError, match="cannot read identity file") as info:
        Identity.load_or_create(tmp_path)

    assert str(tmp_path / IDENTITY_FILE) in str(info.value)


def test_identity_signature_verifies_with_public_key_and_peer_id() -> None:
    identity = Identity.generate()
    data = b"the bytes that were signed"

    signature = identity.sign(data)

    assert len(signature) == 64
    assert verify(identity.public_key_bytes, signature, data)
    assert verify_by_peer_id(identity.peer_id, signature, data)
    assert public_key_from_peer_id(identity.peer_id) == identity.public_key_bytes


def test_verify_rejects_tampered_data_signature_or_key() -> None:
    identity, other = Identity.generate(), Identity.generate()
    data = b"payload"
    signature = identity.sign(data)
    flipped = bytes([signature[0] ^ 1]) + signature[1:]

    assert not verify(identity.public_key_bytes, signature, b"payloaD")
    assert not verify(identity.public_key_bytes, flipped, data)
    assert not verify(identity.public_key_bytes, signature[:63], data)
    assert not verify(other.public_key_bytes, signature, data)
    assert not verify(b"k" * 31, signature, data)
    assert not verify_by_peer_id(other.peer_id, signature, data)
    assert not verify_by_peer_id(identity.peer_id, signature, b"payloaD")


@pytest.mark.parametrize(
    "peer_id", ["", "garbage", "12D3KooW", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]
)
def test_verify_by_peer_id_is_false_for_malformed_peer_id(peer_id: str) -> None:
    identity = Identity.generate()

    assert verify_by_peer_id(peer_id, identity.sign(b"data"), b"data") is False
