"""Authenticated connections: TLS 1.3 plus the in-band identity proof (:mod:`protocols.handshake`).

:func:`dial` and :func:`accept` return a :class:`SecureConnection` whose ``remote_peer`` is proven:
the listener's by its certificate key, the dialer's by its signature over the listener's certificate
and nonce. Both refuse peers of another run. Deadlines are the caller's cancel scopes.

Limits (DESIGN D10a): until the identity proof is complete, a frame may announce at most
:data:`~protocols.envelope.HANDSHAKE_FRAME_BYTES`; afterwards the lane's limit applies (RPC:
``MAX_FRAME_BYTES``, bulk: ``BULK_FRAME_BYTES``). Every announced length is checked before a byte of it
is buffered, and a frame's buffer grows only as its bytes arrive. Frames above
``INLINE_DECODE_BYTES`` are decoded in a worker thread (:func:`decode_frame`, :func:`decode_payload`),
so no decode holds the event loop for long. The dialer's advertised listen addresses are kept only when
the connection vouches for them (:func:`shared.net.dialing.vouched_addresses`).
"""

from __future__ import annotations

import logging
import secrets
import socket
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import trio

from protocols.codes import ErrorCode
from protocols.envelope import (
    BULK_FRAME_BYTES,
    FRAME_HEADER,
    HANDSHAKE_FRAME_BYTES,
    INLINE_DECODE_BYTES,
    MAX_FRAME_BYTES,
    Envelope,
    ErrorReply,
    Flags,
    Message,
    check_envelope,
    decode_message,
    encode_frame,
    parse_envelope,
)
from protocols.errors import ProtocolError
from protocols.handshake import ClientProof, Lane, ServerHello, Welcome, proof_payload
from protocols.peer_id import PeerId, peer_id_from_public_key

from ..auth.keys import Identity, verify
from ..errors import BadIdentityProof, PeerIdMismatch, PeerUnavailable, WrongRun, remote_error
from .addresses import PeerAddress, local_hosts
from .dialing import vouched_addresses
from .ratelimit import Throttle
from .tls import client_context, peer_id_from_certificate, server_context
from .tls_socket import BufferedReceiver, TlsSocket, Traffic, connect_tcp

__all__ = [
    "DECODE_THREADS",
    "LocalEndpoint",
    "SecureConnection",
    "accept",
    "decode_frame",
    "decode_payload",
    "dial",
    "parse_frame",
]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
AGENT = "dedloc/0.1"
#: Worker threads decoding large frames, process-wide (msgspec holds the GIL while it decodes, so the
#: loop still gets its turn every switch interval; the limiter keeps a flood from queueing many).
DECODE_THREADS = trio.CapacityLimiter(2)
_LANE_FRAME_BYTES = {"rpc": MAX_FRAME_BYTES, "bulk": BULK_FRAME_BYTES, "reverse": BULK_FRAME_BYTES}


async def parse_frame(body: bytes) -> Envelope:
    """:func:`~protocols.envelope.parse_envelope`, in a worker thread when ``body`` is large."""
    if len(body) <= INLINE_DECODE_BYTES:
        return parse_envelope(body)
    return await trio.to_thread.run_sync(parse_envelope, body, limiter=DECODE_THREADS)


async def decode_frame(body: bytes) -> Envelope:
    """:func:`~protocols.envelope.decode_envelope`, in a worker thread when ``body`` is large."""
    return check_envelope(await parse_frame(body))


async def decode_payload(envelope: Envelope, expected: type[M] | None = None) -> Message:
    """:func:`~protocols.envelope.decode_message`, in a worker thread when the payload is large."""
    if len(envelope.payload) <= INLINE_DECODE_BYTES:
        return decode_message(envelope, expected)
    return await trio.to_thread.run_sync(decode_message, envelope, expected, limiter=DECODE_THREADS)


@dataclass
class LocalEndpoint:
    """What this node presents in every handshake."""

    identity: Identity
    run_id: str
    listen_addrs: list[str] = field(default_factory=list)
    agent: str = AGENT
    #: upload/download caps every connection of this node shares (shared.net.ratelimit); None: none
    throttle: Throttle | None = None
    #: what every connection of this node sent and received, RPC and bulk lanes alike
    traffic: Traffic = field(default_factory=Traffic)

    def __post_init__(self) -> None:
        self.server_ctx, self.cert_der = server_context(self.identity)
        self.client_ctx = client_context()

    @property
    def peer_id(self) -> PeerId:
        return self.identity.peer_id


class SecureConnection:
    """A TLS connection to a proven peer, carrying length-prefixed envelope frames."""

    def __init__(
        self,
        tls: TlsSocket,
        receiver: BufferedReceiver,
        remote_peer: PeerId,
        remote_addrs: tuple[str, ...],
        lane: Lane,
        initiator: bool,
        max_frame: int | None = None,
    ) -> None:
        self.tls = tls
        self.receiver = receiver
        self.remote_peer = remote_peer
        self.remote_addrs = remote_addrs
        self.lane = lane
        self.initiator = initiator
        #: the largest frame this side accepts now (the handshake's limit until the peer is proven)
        self.max_frame = _LANE_FRAME_BYTES[lane] if max_frame is None else max_frame
        #: trio time this connection was last used (idle reaping)
        self.last_used = trio.current_time()
        #: how the bytes travel: "direct", "relayed" (spliced by a relay) or "punched" (hole punched)
        self.via = "direct"
        self._write_lock = trio.StrictFIFOLock()

    @property
    def remote_host(self) -> str:
        """The remote end's host as this side sees it: the IP an accepted connection comes from, or the
        host we dialed (``tls.peer`` is ``host:port``; IPv6 hosts contain colons, the port never does)."""
        return self.tls.peer.rpartition(":")[0].strip("[]")

    async def send_frame(self, frame: bytes) -> None:
        async with self._write_lock:
            await self.tls.send_all(frame)

    async def send_message(self, message: Message, request_id: int = 0, flags: Flags = Flags.NOTIFY) -> None:
        await self.send_frame(encode_frame(message, request_id, flags))

    async def receive_frame(self, max_bytes: int | None = None) -> bytes:
        """The next frame's body.

        Raises:
            EOFError: clean close between frames.
            ProtocolError: the announced length exceeds ``max_bytes`` (default: :attr:`max_frame`; code
                ``TOO_LARGE``); the stream cannot be resynchronised, so the caller must close the connection.
            PeerUnavailable: the connection broke.
        """
        if max_bytes is None:
            max_bytes = self.max_frame
        (length,) = FRAME_HEADER.unpack(await self.receiver.read_exactly(FRAME_HEADER.size))
        if length > max_bytes:
            raise ProtocolError(
                f"frame of {length} bytes exceeds the limit of {max_bytes}", ErrorCode.TOO_LARGE
            )
        return await self.receiver.read_exactly(length)

    async def receive_message(self, expected: type[M]) -> M:
        """Receive one message that must be ``expected``; an :class:`ErrorReply` raises its error."""
        try:
            body = await self.receive_frame()
        except EOFError as exc:
            raise PeerUnavailable(f"{self.tls.peer} closed the connection") from exc
        message = await decode_payload(await decode_frame(body), expected)
        if isinstance(message, ErrorReply):
            raise remote_error(message.code, message.message)
        if not isinstance(message, expected):
            raise ProtocolError(f"expected {expected.kind}, got {message.kind}")
        return message

    def close(self) -> None:
        self.tls.close()


async def dial(
    endpoint: LocalEndpoint, address: PeerAddress, lane: Lane, raw: socket.socket | None = None
) -> SecureConnection:
    """Connect to ``address`` and authenticate both ends (over ``raw``, a connected TCP socket, when
    given: a relay's circuit or a punched connection).

    Raises:
        PeerUnavailable: nobody answered, or the connection broke during the handshake.
        PeerIdMismatch: the listener is not ``address.peer_id`` (when one is given).
        WrongRun: the listener serves another run.
        RemoteError: the listener refused our proof (``BAD_IDENTITY``, ``WRONG_RUN``).
        ProtocolError: the listener sent garbage.
    """
    peer = f"{address.host}:{address.port}"
    if raw is None:
        raw = await connect_tcp(address.host, address.port)
    tls = await TlsSocket.handshake(raw, endpoint.client_ctx, server_side=False, peer=peer)
    tls.throttle, tls.traffic = endpoint.throttle, endpoint.traffic
    try:
        cert = tls.peer_certificate()
        remote = peer_id_from_certificate(cert)
        if address.peer_id is not None and remote != address.peer_id:
            raise PeerIdMismatch(f"{peer} is {remote}, not the {address.peer_id} we dialed")
        conn = SecureConnection(
            tls,
            BufferedReceiver(tls),
            remote,
            (str(address.with_peer(remote)),),
            lane,
            True,
            HANDSHAKE_FRAME_BYTES,
        )
        hello = await conn.receive_message(ServerHello)
        if hello.run_id != endpoint.run_id:
            raise WrongRun(f"{peer} serves run {hello.run_id!r}, not {endpoint.run_id!r}")
        unsigned = ClientProof(
            run_id=endpoint.run_id,
            lane=lane,
            public_key=endpoint.identity.public_key_bytes,
            listen_addrs=endpoint.listen_addrs[:16],
            agent=endpoint.agent,
            signature=b"\0" * 64,
        )
        assert cert is not None  # peer_id_from_certificate raised otherwise
        signature = endpoint.identity.sign(proof_payload(cert, hello.nonce, unsigned))
        await conn.send_message(msgspec.structs.replace(unsigned, signature=signature))
        await conn.receive_message(Welcome)
        conn.max_frame = _LANE_FRAME_BYTES[lane]
    except BaseException:
        tls.close()
        raise
    return conn


async def accept(endpoint: LocalEndpoint, raw: socket.socket, peer: str) -> SecureConnection:
    """Authenticate an accepted TCP socket ``raw`` (see :func:`dial` for the errors).

    Raises:
        BadIdentityProof: the dialer's signature did not verify (it was told ``BAD_IDENTITY``).
        WrongRun: the dialer belongs to another run (it was told ``WRONG_RUN``).
    """
    tls = await TlsSocket.handshake(raw, endpoint.server_ctx, server_side=True, peer=peer)
    tls.throttle, tls.traffic = endpoint.throttle, endpoint.traffic
    try:
        receiver = BufferedReceiver(tls)
        nonce = secrets.token_bytes(32)
        pending = SecureConnection(tls, receiver, PeerId(""), (), "rpc", False, HANDSHAKE_FRAME_BYTES)
        await pending.send_message(ServerHello(run_id=endpoint.run_id, nonce=nonce, agent=endpoint.agent))
        proof = await pending.receive_message(ClientProof)
        if proof.run_id != endpoint.run_id:
            await _refuse(pending, ErrorCode.WRONG_RUN, f"this node serves run {endpoint.run_id!r}")
            raise WrongRun(f"{peer} belongs to run {proof.run_id!r}, not {endpoint.run_id!r}")
        if not verify(proof.public_key, proof.signature, proof_payload(endpoint.cert_der, nonce, proof)):
            await _refuse(pending, ErrorCode.BAD_IDENTITY, "identity proof does not verify")
            raise BadIdentityProof(f"{peer} sent an identity proof that does not verify")
        remote = peer_id_from_public_key(proof.public_key)
        observed = peer.rpartition(":")[0].strip("[]")
        addrs, dropped = vouched_addresses(proof.listen_addrs, observed, local_hosts())
        if dropped:
            logger.info(
                "%s (%s) advertised %d address(es) its connection does not vouch for", peer, remote, dropped
            )
        conn = SecureConnection(tls, receiver, remote, addrs, proof.lane, False)
        await conn.send_message(Welcome())
    except BaseException:
        tls.close()
        raise
    return conn


async def _refuse(conn: SecureConnection, code: ErrorCode, message: str) -> None:
    with trio.move_on_after(1):
        await conn.send_message(ErrorReply(code=int(code), message=message), flags=Flags.ERROR)
