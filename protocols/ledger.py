"""Contribution reports and measured capabilities: what the SQL ledger credits (DESIGN D5).

A volunteer describes each stretch of its work in a :class:`ContributionReport`, encodes it with msgpack
and signs :func:`report_payload` of those exact bytes with its identity key (Ed25519; the public key is
inside the peer id, so anyone can verify without a lookup). It sends both as a :class:`SignedReport`; the
backbone keeps the original bytes and signature, so every credited row can be re-verified later.

**Discarded steps.** A volunteer that re-syncs after its state diverged (it stepped on a fork that did not
survive, e.g. a partition's minority) lists its own steps the loaded state replaced in ``discarded``
(inclusive ranges of global steps). The ledger credits no receipts of those steps as run progress (see
:mod:`backbone.ledger.accounting`). Compatibility: the field is new and omitted when empty
(``omit_defaults``, as are empty ``receipts`` and ``pulled``), so a report without discards decodes on
backbones of every version; one with discards is refused by a backbone older than the field (and given
up by the volunteer, its receipts carried by a later report).

**Discarded stage steps** (issue 17, swarm runs). A stage server whose stage's state it loaded replaced
stage steps only it (and its side of a partition) took, or that its earlier process took before a
restart, lists them in ``stage_discarded``: inclusive ranges of *that stage's* steps
(:class:`StageStepRange`: stage, first, last; at most :data:`MAX_STAGE_DISCARDED_PER_REPORT`). A stage
counts its own steps, so a data-parallel ``StepRange`` cannot say which stage; and ``StepRange`` gets no
``stage`` field, since msgspec encodes a defaulted trailing field of an array-like struct and every
data-parallel discard's bytes would change. The ledger treats them as ``discarded``, per stage
(:mod:`backbone.ledger.accounting`, "Swarm runs"). Compatibility: omitted when empty, so a report without
stage discards decodes on backbones of every version; one with them is refused by a backbone older than
the field (the swarm mode has no released version, so every peer of a swarm run runs one version).

**Relayed bytes.** ``bytes_relayed`` is what this peer's relay service spliced for others in the
interval (a claim, like ``bytes_aggregated``); ``relayed_through`` is the evidence of *other* peers'
relaying: per relay peer id, the bytes this peer *received* in the interval over connections that went
through that relay's circuits (:class:`RelayedBytes`; TLS plaintext, so a little less than the relay
spliced for that direction; at most :data:`MAX_RELAYED_PER_REPORT` relays, each listed once). The ledger
credits a relay no more than the peers of other users received through it (see
:mod:`backbone.ledger.accounting`). Compatibility: the field is new and omitted when empty, so a report
of a peer that used no relay decodes on backbones of every version; one with relayed bytes is refused by
a backbone older than the field (the volunteer gives it up: a later report carries its relayed bytes
claim and receipts, while its relay evidence is dropped, since resending it would have every later report
refused too).

**Swarm bytes** (issue 17 item 6). In a swarm run, ``bytes_sent`` is what this peer sent over the
pipeline's bulk lane in the interval (a claim): as a stage server, the payload bytes of its answers
(activations forward, input gradients backward); as a trainer, the payload bytes of its requests that a
server answered (inputs, activations, output gradients). ``received_from`` is the evidence of *other*
peers' sending: per stage server peer id, the answer payload bytes this peer's trainers received from it
and accepted in the interval (:class:`ReceivedBytes`; at most :data:`MAX_RECEIVED_PER_REPORT` servers,
each listed once). A trainer's sending is evidenced by the servers instead, in the ``nbytes`` of the
carried receipts they sign (:mod:`protocols.receipts`, "Trainers' receipts"). The ledger credits
``min(claim, what peers of other users signed they received)`` (:mod:`backbone.ledger.accounting`, "Swarm
bytes"). Compatibility: both are omitted at their defaults, so every other report's bytes are unchanged;
a report with them is refused by a backbone older than the fields (the swarm mode has no released
version, so every peer of a swarm run runs one version).

``(peer_id, seq)`` is the idempotency key: ``seq`` counts a peer's reports from 0 upwards, and a report
sent twice (a retry after a lost reply, a second backbone) is credited once.

:class:`Capabilities` is what a peer *measured* about itself (samples/s on the run's model, bandwidth;
see :mod:`protocols.probe`); the ledger's plausibility checks compare reports against it. A peer sends
them as :class:`SignedCapabilities` (``POST capabilities``): the msgpack bytes of its
:class:`Capabilities`, its peer id, the run id and a unix timestamp, signed by its identity key over
:func:`capabilities_payload`. The backbone accepts them only within ``protocols.auth.MAX_CLOCK_SKEW`` of
its clock, so an old message cannot be replayed later to overwrite newer numbers. ``precision`` and
``memory_bytes`` (the accelerator's) are newer fields, omitted at their defaults (fp32, 0: a CPU), so a CPU
peer's capabilities decode on backbones older than them; an accelerator's are refused there.

Example (volunteer side)::

    data = msgspec.msgpack.encode(report)
    signed = SignedReport(report=data, signature=identity.sign(report_payload(data)))
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from .errors import ProtocolError
from .receipts import MAX_PULLED_PER_REPORT, MAX_RECEIPTS_PER_REPORT, MAX_STAGES, PulledSlice, SignedReceipt
from .types import Bytes64, PeerIdStr, RunIdStr

__all__ = [
    "MAX_CAPABILITIES_BYTES",
    "MAX_COUNT",
    "MAX_DISCARDED_PER_REPORT",
    "MAX_INTERVAL_S",
    "MAX_REPORT_AGE_S",
    "MAX_RECEIVED_PER_REPORT",
    "MAX_RELAYED_PER_REPORT",
    "MAX_REPORT_BYTES",
    "MAX_STAGE_DISCARDED_PER_REPORT",
    "Capabilities",
    "CapabilitiesReceipt",
    "ContributionReport",
    "ReceivedBytes",
    "RelayedBytes",
    "SignedCapabilities",
    "SignedReport",
    "StageStepRange",
    "StepRange",
    "capabilities_payload",
    "decode_capabilities",
    "report_payload",
]

#: A report with its full load of receipts and pull records (about 12 KiB) fits with room to spare.
MAX_REPORT_BYTES = 24 * 1024
#: The longest interval one report may cover, and how long ago it may have begun, when it arrives (the
#: ledger flags reports beyond them; see backbone.ledger.accounting). A volunteer splits longer stretches.
MAX_INTERVAL_S = 3600.0
MAX_REPORT_AGE_S = 24 * 3600.0
#: Upper bound of every integer field: exact as a float, far beyond any real interval's work.
MAX_COUNT = 2**53
#: Ranges of discarded steps one report lists (a volunteer re-syncs rarely; ranges are merged).
MAX_DISCARDED_PER_REPORT = 16
#: Ranges of discarded stage steps one report lists (merged per stage; a server serves one stage at a time).
MAX_STAGE_DISCARDED_PER_REPORT = 16
#: Relays one report names (a peer behind NAT holds a reservation at a few; reachable peers need none).
MAX_RELAYED_PER_REPORT = 16
#: Stage servers one report names in ``received_from`` (the busiest; the rest waits for the next report).
MAX_RECEIVED_PER_REPORT = 32
#: Unix times beyond this (year ~33658) are garbage, not clocks.
_MAX_TIME = 1e12
#: Capability ceilings, far above any real device or link (1e13 B/s = 80 Tbit/s).
_MAX_RATE = 1e13
_REPORT_DOMAIN = b"dedloc-report-v1"
_CAPABILITIES_DOMAIN = b"dedloc-capabilities-v1"
MAX_CAPABILITIES_BYTES = 1024

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=_MAX_TIME)]
UnixTime = Annotated[float, msgspec.Meta(ge=-_MAX_TIME, le=_MAX_TIME)]
Rate = Annotated[float, msgspec.Meta(ge=0, le=_MAX_RATE)]


def _check(name: str, value: float, low: float, high: float) -> None:
    # msgspec enforces the Meta bounds only when decoding; this also covers direct construction and
    # rejects NaN/inf, which compare false against every bound.
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} {value!r} is not within [{low}, {high}]")


class StepRange(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Global steps ``first..last``, both included."""

    first: Count
    last: Count

    def __post_init__(self) -> None:
        _check("first", self.first, 0, MAX_COUNT)
        _check("last", self.last, self.first, MAX_COUNT)


class StageStepRange(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Steps ``first..last`` (both included) of swarm pipeline stage ``stage`` (module docstring)."""

    stage: Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)]
    first: Count
    last: Count

    def __post_init__(self) -> None:
        _check("stage", self.stage, 0, MAX_STAGES - 1)
        _check("first", self.first, 0, MAX_COUNT)
        _check("last", self.last, self.first, MAX_COUNT)


class RelayedBytes(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """In a peer's report: it received ``nbytes`` through circuits of relay ``relay`` in the interval."""

    relay: PeerIdStr
    nbytes: Count

    def __post_init__(self) -> None:
        _check("nbytes", self.nbytes, 0, MAX_COUNT)


class ReceivedBytes(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """In a swarm trainer's report: it received and accepted ``nbytes`` of answers from stage server
    ``server`` in the interval (module docstring, "Swarm bytes")."""

    server: PeerIdStr
    nbytes: Count

    def __post_init__(self) -> None:
        _check("nbytes", self.nbytes, 0, MAX_COUNT)


class ContributionReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One peer's work over ``[interval_start, interval_end]`` (unix seconds), report number ``seq``."""

    run_id: RunIdStr
    peer_id: PeerIdStr
    seq: Count
    global_step: Count
    samples: Count
    compute_seconds: Seconds
    bytes_aggregated: Count
    bytes_relayed: Count
    interval_start: UnixTime
    interval_end: UnixTime
    #: receipts other peers signed for this peer's work (see :mod:`protocols.receipts`)
    receipts: Annotated[list[SignedReceipt], msgspec.Meta(max_length=MAX_RECEIPTS_PER_REPORT)] = []
    #: averaged bytes this peer pulled from each aggregator (evidence of *their* aggregation work)
    pulled: Annotated[list[PulledSlice], msgspec.Meta(max_length=MAX_PULLED_PER_REPORT)] = []
    #: our own steps that a state we loaded replaced: not run progress (module docstring)
    discarded: Annotated[list[StepRange], msgspec.Meta(max_length=MAX_DISCARDED_PER_REPORT)] = []
    #: bytes this peer received through each relay (evidence of *their* relaying; module docstring)
    relayed_through: Annotated[list[RelayedBytes], msgspec.Meta(max_length=MAX_RELAYED_PER_REPORT)] = []
    #: swarm runs: bytes this peer sent over the pipeline in the interval (a claim; module docstring)
    bytes_sent: Count = 0
    #: swarm runs: answer bytes our trainers received from each stage server (evidence of *their* sending)
    received_from: Annotated[list[ReceivedBytes], msgspec.Meta(max_length=MAX_RECEIVED_PER_REPORT)] = []
    #: swarm runs: our stage steps that a stage state we loaded replaced (module docstring)
    stage_discarded: Annotated[
        list[StageStepRange], msgspec.Meta(max_length=MAX_STAGE_DISCARDED_PER_REPORT)
    ] = []

    def __post_init__(self) -> None:
        for name in ("seq", "global_step", "samples", "bytes_aggregated", "bytes_relayed", "bytes_sent"):
            _check(name, getattr(self, name), 0, MAX_COUNT)
        _check("compute_seconds", self.compute_seconds, 0, _MAX_TIME)
        _check("interval_start", self.interval_start, -_MAX_TIME, _MAX_TIME)
        _check("interval_end", self.interval_end, -_MAX_TIME, _MAX_TIME)
        if len(self.discarded) > MAX_DISCARDED_PER_REPORT:
            raise ValueError(f"a report lists at most {MAX_DISCARDED_PER_REPORT} discarded step ranges")
        if len(self.stage_discarded) > MAX_STAGE_DISCARDED_PER_REPORT:
            raise ValueError(
                f"a report lists at most {MAX_STAGE_DISCARDED_PER_REPORT} discarded stage step ranges"
            )
        if len(self.receipts) > MAX_RECEIPTS_PER_REPORT or len(self.pulled) > MAX_PULLED_PER_REPORT:
            raise ValueError(
                f"a report carries at most {MAX_RECEIPTS_PER_REPORT} receipts and "
                f"{MAX_PULLED_PER_REPORT} pull records"
            )
        if len(self.relayed_through) > MAX_RELAYED_PER_REPORT:
            raise ValueError(f"a report names at most {MAX_RELAYED_PER_REPORT} relays")
        relays = [r.relay for r in self.relayed_through]
        if len(set(relays)) != len(relays):
            raise ValueError("a report names each relay at most once")
        if len(self.received_from) > MAX_RECEIVED_PER_REPORT:
            raise ValueError(f"a report names at most {MAX_RECEIVED_PER_REPORT} stage servers")
        servers = [r.server for r in self.received_from]
        if len(set(servers)) != len(servers):
            raise ValueError("a report names each stage server at most once")
        if self.interval_end < self.interval_start:
            raise ValueError(
                f"interval_end {self.interval_end!r} is before interval_start {self.interval_start!r}"
            )


class SignedReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A msgpack-encoded :class:`ContributionReport` and its writer's signature over
    :func:`report_payload` of those bytes."""

    report: Annotated[bytes, msgspec.Meta(max_length=MAX_REPORT_BYTES)]
    signature: Bytes64


def report_payload(report_bytes: bytes) -> bytes:
    """The bytes a volunteer signs for a report: a domain tag, then the report's msgpack bytes."""
    return _REPORT_DOMAIN + report_bytes


class Capabilities(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a peer measured about itself: training throughput on the run's model (in ``precision``, on
    ``device``, whose accelerator has ``memory_bytes``; 0 for a CPU) and link bandwidth."""

    samples_per_second: Rate
    upload_bps: Rate
    download_bps: Rate
    device: Annotated[str, msgspec.Meta(max_length=128)]
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    memory_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0

    def __post_init__(self) -> None:
        _check("samples_per_second", self.samples_per_second, 0, _MAX_RATE)
        _check("upload_bps", self.upload_bps, 0, _MAX_RATE)
        _check("download_bps", self.download_bps, 0, _MAX_RATE)
        _check("memory_bytes", self.memory_bytes, 0, MAX_COUNT)
        if len(self.device) > 128:
            raise ValueError(f"device name has {len(self.device)} characters, at most 128 are allowed")


class SignedCapabilities(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A peer's msgpack-encoded :class:`Capabilities`, signed by it over :func:`capabilities_payload`."""

    run_id: RunIdStr
    peer_id: PeerIdStr
    timestamp: UnixTime
    capabilities: Annotated[bytes, msgspec.Meta(max_length=MAX_CAPABILITIES_BYTES)]
    signature: Bytes64


def capabilities_payload(run_id: str, peer_id: str, timestamp: float, capabilities_bytes: bytes) -> bytes:
    """The bytes a volunteer signs for its capabilities: a domain tag, then msgpack of (run id, peer id,
    timestamp, the capabilities' msgpack bytes)."""
    return _CAPABILITIES_DOMAIN + msgspec.msgpack.encode((run_id, peer_id, timestamp, capabilities_bytes))


_CAPABILITIES_DECODER = msgspec.msgpack.Decoder(Capabilities)


def decode_capabilities(data: bytes | memoryview) -> Capabilities:
    """Decode msgpack :class:`Capabilities` (as inside :class:`SignedCapabilities`).

    Raises:
        ProtocolError: more than :data:`MAX_CAPABILITIES_BYTES`, malformed, or a value out of range.
    """
    if len(data) > MAX_CAPABILITIES_BYTES:
        raise ProtocolError(f"capabilities of {len(data)} bytes exceed {MAX_CAPABILITIES_BYTES}")
    try:
        return _CAPABILITIES_DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:  # __post_init__ checks too
        raise ProtocolError(f"invalid capabilities: {exc}") from exc


class CapabilitiesReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The backbone's answer to ``POST capabilities``: what it now holds for ``peer_id``."""

    peer_id: PeerIdStr
    capabilities: Capabilities
