"""TLS 1.3 contexts bound to node identities (DESIGN D1).

The listener's certificate is self-signed *by its Ed25519 identity key* and carries that key as its
subject public key, so TLS 1.3's CertificateVerify proves the listener holds the key behind its peer id.
The dialer does not trust any CA: it reads the certificate, derives the peer id from its key
(:func:`peer_id_from_certificate`) and refuses the connection if that is not the id it dialed. The dialer
proves its own identity in-band afterwards (:mod:`protocols.handshake`).

TLS 1.3 only; no session tickets (each connection is authenticated afresh and nothing is resumable).
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from protocols.peer_id import PeerId, peer_id_from_public_key

from ..auth.keys import Identity
from ..errors import PeerIdMismatch

__all__ = ["client_context", "peer_id_from_certificate", "self_signed_certificate", "server_context"]


def self_signed_certificate(identity: Identity) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.peer_id)])
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(identity.private_key, algorithm=None)
    )


def _base_context(purpose: ssl.Purpose) -> ssl.SSLContext:
    ctx = ssl.SSLContext(
        ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    )
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def server_context(identity: Identity) -> tuple[ssl.SSLContext, bytes]:
    """A listener context presenting ``identity``'s certificate; also returns the certificate's DER."""
    cert = self_signed_certificate(identity)
    ctx = _base_context(ssl.Purpose.CLIENT_AUTH)
    ctx.num_tickets = 0
    key_pem = identity.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # The ssl module loads certificates only from files: write both to a private temporary directory.
    with tempfile.TemporaryDirectory(prefix="dedloc-tls-") as tmp:
        cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx, cert.public_bytes(serialization.Encoding.DER)


def client_context() -> ssl.SSLContext:
    """A dialer context: no CA, no hostname check; the certificate is checked by peer id instead."""
    ctx = _base_context(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_id_from_certificate(der: bytes | None) -> PeerId:
    """The peer id of the Ed25519 key a listener's certificate carries.

    Raises:
        PeerIdMismatch: no certificate, or its key is not Ed25519 (it cannot belong to any peer id).
    """
    if not der:
        raise PeerIdMismatch("the peer presented no certificate")
    try:
        key = x509.load_der_x509_certificate(der).public_key()
    except ValueError as exc:
        raise PeerIdMismatch(f"the peer's certificate does not parse: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise PeerIdMismatch(f"the peer's certificate carries a {type(key).__name__}, not an Ed25519 key")
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return peer_id_from_public_key(raw)
