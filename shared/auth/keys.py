"""Ed25519 node identities: load, create, sign, verify (DESIGN D1).

Each node has one persistent identity key in its data dir (``identity.key``, PKCS#8 PEM, mode 0600).
Its peer id is derived from the public key (:mod:`protocols.peer_id`), so a peer id is also the key that
verifies everything the peer signs.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocols.peer_id import PeerId, peer_id_from_public_key, public_key_from_peer_id

from ..errors import ConfigError

__all__ = ["IDENTITY_FILE", "Identity", "verify", "verify_by_peer_id"]

logger = logging.getLogger(__name__)
IDENTITY_FILE = "identity.key"


@dataclass(frozen=True, eq=False)
class Identity:
    """A node's Ed25519 key pair."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: Path, filename: str = IDENTITY_FILE) -> Identity:
        """Load ``data_dir/filename``, creating the directory and a new key the first time.

        Raises:
            ConfigError: the file exists but is not an Ed25519 private key, or cannot be written.
        """
        path = data_dir / filename
        try:
            data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            pem = path.read_bytes()
        except FileNotFoundError:
            identity = cls.generate()
            identity._save(path)
            return identity
        except OSError as exc:
            raise ConfigError(f"cannot read identity file {path}: {exc.strerror}") from exc
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{path} is not a PEM private key; move it away to create a new identity"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("identity file %s had mode %o; tightening to 600", path, mode)
            path.chmod(0o600)
        return cls(key)

    def _save(self, path: Path) -> None:
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise ConfigError(f"cannot write identity file {path}: {exc.strerror}") from exc

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @property
    def public_key_bytes(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def peer_id(self) -> PeerId:
        return peer_id_from_public_key(self.public_key_bytes)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True if ``signature`` is a valid Ed25519 signature of ``data`` by the raw 32-byte ``public_key``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def verify_by_peer_id(peer_id: str, signature: bytes, data: bytes) -> bool:
    """True if ``signature`` over ``data`` was made by the key inside ``peer_id``."""
    try:
        public_key = public_key_from_peer_id(peer_id)
    except ValueError:
        return False
    return verify(public_key, signature, data)
