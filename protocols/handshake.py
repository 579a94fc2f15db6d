"""The identity handshake that follows every TLS 1.3 handshake (DESIGN D1).

TLS authenticates the *listener*: its self-signed certificate carries its Ed25519 identity key, and the
dialer checks that key against the peer id it dialed. The standard library cannot verify a self-signed
*client* certificate, so the dialer proves its identity in-band, bound to this very channel::

    listener -> dialer   ServerHello{run_id, nonce(32 random bytes), agent}
    dialer   -> listener ClientProof{run_id, lane, public_key, listen_addrs, agent, signature}
    listener -> dialer   Welcome{}                    (or ErrorReply{code} and close)

``signature`` is Ed25519 by the dialer's identity key over :func:`proof_payload`:
``"dedloc-identity-v1" || sha256(listener certificate DER) || nonce || msgpack(ClientProof fields
without signature)``. It is useless on any other channel: another listener has another certificate and
nonce. The listener derives the dialer's peer id from ``public_key``; ``listen_addrs`` are the dialer's
own claims about where it can be reached (empty for peers that accept no connections).

Both sides refuse a peer of another run (``WRONG_RUN``). ``lane`` says what the connection is for:
``"rpc"`` (multiplexed framed requests), ``"bulk"`` (exclusive raw byte transfers) or ``"reverse"`` (a bulk
lane whose *listener* sends the transfers: a client-mode peer dialing back, :mod:`protocols.reversal`).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, ClassVar, Literal

import msgspec

from .envelope import Message, register
from .types import Bytes32, Bytes64, MultiaddrStr, RunIdStr

__all__ = ["ClientProof", "Lane", "ServerHello", "Welcome", "proof_payload"]

Lane = Literal["rpc", "bulk", "reverse"]
AgentStr = Annotated[str, msgspec.Meta(max_length=64)]
_DOMAIN = b"dedloc-identity-v1"


@register
class ServerHello(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "hs.hello"
    max_bytes: ClassVar[int] = 1024
    run_id: RunIdStr
    nonce: Bytes32
    agent: AgentStr = ""


@register
class ClientProof(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "hs.proof"
    max_bytes: ClassVar[int] = 8192
    run_id: RunIdStr
    lane: Lane
    public_key: Bytes32
    listen_addrs: Annotated[list[MultiaddrStr], msgspec.Meta(max_length=16)] = []
    agent: AgentStr = ""
    signature: Bytes64


@register
class Welcome(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "hs.welcome"
    max_bytes: ClassVar[int] = 256


def proof_payload(listener_cert_der: bytes, nonce: bytes, proof: ClientProof) -> bytes:
    """The bytes the dialer signs (``proof.signature`` itself is left out)."""
    unsigned = msgspec.structs.replace(proof, signature=b"\0" * 64)
    return b"".join(
        (_DOMAIN, hashlib.sha256(listener_cert_der).digest(), nonce, msgspec.msgpack.encode(unsigned))
    )
