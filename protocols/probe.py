"""Measuring a peer from the outside: bandwidth and reachability probes, and the capability record they feed.

A volunteer measures what the adaptive-averaging LP needs about it (DESIGN §1, §2: u_i, d_i, and whether
it accepts inbound connections) against a backbone, which serves these probes.

**Bandwidth** travels on the bulk lane (:mod:`protocols.bulk`), so it measures the path gradients take::

    probe.up    client -> server  BulkHeader{topic="probe.up", nbytes=N}  + N raw bytes
                server -> client  BulkAck{meta=ProbeReceipt{nbytes=N}}
    probe.down  client -> server  BulkHeader{topic="probe.down", nbytes=0, meta=DownloadProbe{nbytes=N}}
                server -> client  BulkAck{meta=ProbeReceipt{nbytes=N}, nbytes=N}  + N raw bytes

(``meta`` values are msgpack.)

The download comes back as the reply payload of a transfer the *client* opened, so a client-mode peer
(one that accepts no connections) measures its download too. ``N`` is at most :data:`MAX_PROBE_BYTES`; a
larger probe is refused with ``TOO_LARGE``. A server busy with other probes refuses with ``OVERLOADED``
at once rather than queueing (a queued upload would be timed as a slow one).

**Reachability** is an RPC::

    client -> server  ReachRequest{addrs: the client's listen multiaddrs}
    server -> client  ReachReply{reachable: the subset it dialed back, observed: the client's IP as seen}

For each address the server opens a *fresh* connection (never a pooled one) and completes the full
authenticated handshake expecting the requester's peer id, within :data:`REACH_DEADLINE` seconds: an
answer proves that the requester itself (its identity key) accepts connections there. As in libp2p's
AutoNAT, the server dials only addresses on the IP the request came from — otherwise any peer could aim
it at third parties — and only IP literals (no name resolution on the requester's behalf). ``observed``
lets a peer behind a NAT with a forwarded port ask again about its public IP.

**Capability records** (DHT): key :data:`CAPABILITIES_KEY`, subkey = the writer's peer id (ASCII), value =
msgpack :class:`CapabilityRecord`, written only by that peer (subkey-owner validation), expiring after
:data:`CAPABILITIES_TTL`. A peer republishes when its numbers drift (``volunteer.capabilities.DriftTracker``)
and at least every third of the TTL. The same :class:`~protocols.ledger.Capabilities` go to the ledger,
signed, through the backbone API (:class:`protocols.ledger.SignedCapabilities`).
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar

import msgspec

from .envelope import Message, Request, register
from .errors import decode_typed
from .ledger import Capabilities, UnixTime
from .types import MultiaddrStr

__all__ = [
    "CAPABILITIES_KEY",
    "CAPABILITIES_TTL",
    "MAX_PROBE_BYTES",
    "MAX_REACH_ADDRS",
    "PROBE_DOWN",
    "PROBE_UP",
    "REACH_DEADLINE",
    "CapabilityRecord",
    "DownloadProbe",
    "ProbeReceipt",
    "ReachReply",
    "ReachRequest",
    "decode_capability_record",
    "decode_download_probe",
    "decode_probe_receipt",
    "encode_probe_meta",
]

PROBE_UP = "probe.up"
PROBE_DOWN = "probe.down"
#: Largest probe transfer a server serves (either direction).
MAX_PROBE_BYTES = 64 * 1024 * 1024
#: Addresses one reachability request may ask about (a listener on 0.0.0.0 expands to a few).
MAX_REACH_ADDRS = 8
#: Seconds a server spends dialing back one address (TCP connect + TLS + identity proof).
REACH_DEADLINE = 3.0
CAPABILITIES_KEY = "train.capabilities"
CAPABILITIES_TTL = 900.0

_ProbeBytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBE_BYTES)]
_Addrs = Annotated[list[MultiaddrStr], msgspec.Meta(max_length=MAX_REACH_ADDRS)]


class DownloadProbe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``meta`` of a ``probe.down`` transfer: "send me ``nbytes`` bytes"."""

    nbytes: _ProbeBytes


class ProbeReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ack ``meta`` of both probes: how many bytes the server received (up) or sends (down)."""

    nbytes: _ProbeBytes


def encode_probe_meta(meta: DownloadProbe | ProbeReceipt) -> bytes:
    return msgspec.msgpack.encode(meta)


_DOWNLOAD_DECODER = msgspec.msgpack.Decoder(DownloadProbe)
_RECEIPT_DECODER = msgspec.msgpack.Decoder(ProbeReceipt)


def decode_download_probe(meta: bytes | memoryview) -> DownloadProbe:
    """Raises ProtocolError for malformed msgpack or ``nbytes`` beyond :data:`MAX_PROBE_BYTES`."""
    return decode_typed(_DOWNLOAD_DECODER, meta, "download probe")


def decode_probe_receipt(meta: bytes | memoryview) -> ProbeReceipt:
    """Raises ProtocolError for malformed msgpack or ``nbytes`` beyond :data:`MAX_PROBE_BYTES`."""
    return decode_typed(_RECEIPT_DECODER, meta, "probe receipt")


@register
class ReachReply(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "probe.reach.reply"
    max_bytes: ClassVar[int] = 4096
    reachable: _Addrs = []
    observed: Annotated[str, msgspec.Meta(max_length=64)] = ""


@register
class ReachRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "probe.reach"
    max_bytes: ClassVar[int] = 4096
    response: ClassVar[type[Message]] = ReachReply
    addrs: _Addrs


class CapabilityRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A peer's measured capabilities as published in the DHT (see the module docstring)."""

    capabilities: Capabilities
    reachable: _Addrs = []  # the addresses a backbone dialed back; empty = client mode
    client_mode: bool = True
    measured_at: UnixTime = 0.0
    #: our IP as the checking backbone saw it: the NAT's public address when it differs from ours
    observed: Annotated[str, msgspec.Meta(max_length=64)] = ""
    #: how others reach us: "direct", "relayed", "client" (we dial out only) or "unchecked" (no check yet)
    connectivity: Annotated[str, msgspec.Meta(max_length=16)] = "unchecked"

    def __post_init__(self) -> None:
        if len(self.reachable) > MAX_REACH_ADDRS:
            raise ValueError(f"{len(self.reachable)} reachable addresses, at most {MAX_REACH_ADDRS}")
        if self.client_mode and self.reachable:
            raise ValueError("a client-mode peer has no reachable address")
        if not math.isfinite(self.measured_at):
            raise ValueError(f"measured_at {self.measured_at!r} is not a finite time")


_RECORD_DECODER = msgspec.msgpack.Decoder(CapabilityRecord)


def decode_capability_record(value: bytes | memoryview) -> CapabilityRecord:
    """Decode the DHT value under :data:`CAPABILITIES_KEY`.

    Raises:
        ProtocolError: malformed msgpack or a field out of range.
    """
    return decode_typed(_RECORD_DECODER, value, "capability record")
