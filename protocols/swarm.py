"""The SWARM pipeline's wire: a trainer's forward and backward requests to a stage server, and the DHT
record a server announces itself with (issue 17 items 2-3; seed 004 §3.2, App. C, App. I; DESIGN D9).

**Roles.** A stage server holds the parameters of one pipeline stage (:mod:`volunteer.tasks.stages`
fixes what a stage computes); a trainer holds no parameters, streams data and carries each micro-batch
through one server per stage. Requests travel on the bulk lane (:mod:`protocols.bulk`), signed and
authenticated like every RPC (the header is a signed request; the raw bytes after it are bound to the
same TLS channel)::

    trainer -> server  BulkHeader{topic="swarm.stage", nbytes=N, meta=StageRequest}
                       + N raw bytes: [hidden][grad][field 0][field 1]...
    server  -> trainer BulkAck{meta=StageAnswer, nbytes=M} + M raw bytes: [output]

(``meta`` values are msgpack.) ``hidden`` is the stage's input (absent for stage 0), ``grad`` the
gradient of the stage's output (backward of every stage but the last), each encoded with its
:class:`TensorSpec`'s codec (``none``, ``fp16`` or ``int8-blockwise``: App. I compresses activations and
their gradients to 8 bits blockwise). The fields are the task's collated batch (token ids, labels, masks)
as raw little-endian arrays, named and shaped by their :class:`FieldSpec`: a trainer sends every field of
its batch (at most :data:`MAX_FIELDS`), and the stage uses those it needs.

**Operations.**

* ``forward``: the server runs its stage on ``hidden`` without keeping anything (no autograd graph) and
  answers with its output: the next stage's ``hidden``, shape ``(samples, length, width)``. The last
  stage is never asked to run forward alone.
* ``backward``: the server runs its stage *again* on ``hidden`` with autograd (activation checkpointing as
  in SWARM: servers keep no state between the two passes, so any server of the stage may take the
  backward and a server's memory does not grow with the micro-batches in flight), back-propagates
  ``grad`` (for the last stage: its loss times ``samples``, so gradients are per-sample *sums* as in the
  batch mode), adds the parameters' gradients into its accumulators, counts ``samples`` toward its
  stage's next step, and answers with the gradient of ``hidden`` (none for stage 0) and, from the last
  stage, the micro-batch's mean ``loss``.

A backward is counted toward the step the server is at when it runs (``StageAnswer.step``): like the
batch mode's surplus samples, a micro-batch that reaches a stage after its step went into the next one.

**Answers.** ``status`` is ``"ok"``, or ``"busy"``: the server's queue of admitted requests
(:class:`~volunteer.swarm.server.StageServerConfig` ``max_queue``) is full; ``retry_after`` seconds is its
estimate of when a slot frees up. A busy server is alive and is not banned (:mod:`shared.swarm.wiring`);
the request's bytes were read and dropped. Every other refusal is an ``ErrorReply`` (``BAD_REQUEST``,
``TOO_LARGE``, ``WRONG_RUN`` for another stage), after which the trainer bans the server for this stage
like a failure.

**Receipts** (issue 17 item 6; :mod:`protocols.receipts`, "Trainers' receipts"). A backward request with
``receipt = True`` asks the server for evidence of the trainer's work: when the backward completes and is
counted, the answer carries a :class:`~protocols.receipts.SignedReceipt` of a ``PartReceipt`` with
``carried = True``, signed by the server, about the trainer (the request's authenticated peer), of the
request's stage and the stage step the samples were counted toward, with the samples and the request
bytes the server received from that trainer for that stage step (of its forwards too), cumulative. A
forward, a ``busy`` answer or a request that did not ask carries none. Both fields are omitted at their
defaults (``omit_defaults``), so requests and answers without them decode on peers older than them; a
server older than the flag refuses a request that asks (``forbid_unknown_fields``), and a trainer older
than the field never asks, so it never gets an answer it cannot decode. The receipt is at most
:data:`~protocols.receipts.MAX_RECEIPT_BYTES` + 64 bytes.

**Bounds** (checked before anything is allocated, DESIGN D10): a request's declared sizes must add up to
the header's ``nbytes`` exactly and stay under the server's limit (at most :data:`MAX_STAGE_BYTES`);
every tensor has 1-4 dimensions of 1 to :data:`MAX_DIM` elements and at most :data:`MAX_NUMEL` in all;
every tensor's and field's first dimension is ``samples``; field names are unique. What only the model
can check (the width of ``hidden``, token ids inside the vocabulary, ``grad`` of the output's shape) is
checked by running it: a failure is the request's ``BAD_REQUEST``, never the server's crash.

**Each stage is a collaboration of its own** (DESIGN D9): its servers publish progress records, announce
states and match for averaging rounds under :func:`stage_training_keys` ``(k)``, exactly as the run's
data-parallel peers do under the ``train.*`` keys, so a stage steps when its servers together counted the
target batch, averages with the LP's roles, and a newcomer downloads the stage's state.

**Announcements** (DHT): key ``swarm.stage.<k>``, subkey = the server's peer id (ASCII), value = msgpack
:class:`StageRecord`, written only by that peer, expiring after :data:`STAGE_RECORD_TTL` and republished
every third of it. A server that leaves stops republishing; trainers forget it when the record expires.

**Link records** (DHT, issue 17 item 5; the rule that reads them is :mod:`shared.swarm.links`): while a
swarm run forms, every server publishes under key :data:`LINKS_KEY` (subkey = its peer id, ASCII; written
only by that peer, expiring after :data:`LINK_RECORD_TTL`) a :class:`LinkRecord`: the stage count, when it
joined the formation (unix time), its direct addresses, and the round-trip times it measured to at most
:data:`MAX_LINK_SAMPLES` other servers (an authenticated DHT ping, timed). Every value is bounded by the
type (lengths, counts, physical ranges) so a decoded record never allocates or claims more than that.
A server of a run that the scheduler re-places keeps its record alive while it serves (re-measured and
republished every third of :data:`LINK_RECORD_TTL`, newcomers included: ``started`` is then when the writer
began serving), so a re-placement in a long run reads measured links, not the fill rule's defaults.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, TypeVar

import msgspec

from .averaging import INT8_BLOCK, CodecName
from .errors import ProtocolError
from .receipts import SignedReceipt
from .training import TrainingKeys
from .types import MultiaddrStr, PeerIdStr

__all__ = [
    "FIELD_DTYPES",
    "LINKS_KEY",
    "LINK_RECORD_TTL",
    "MAX_LINK_RTT",
    "MAX_LINK_SAMPLES",
    "MAX_DIM",
    "MAX_FIELDS",
    "MAX_NUMEL",
    "MAX_STAGES",
    "MAX_STAGE_BYTES",
    "STAGE_RECORD_TTL",
    "STAGE_TOPIC",
    "FieldSpec",
    "LinkRecord",
    "LinkSample",
    "StageAnswer",
    "StageRecord",
    "StageRequest",
    "TensorSpec",
    "decode_link_record",
    "decode_stage_answer",
    "decode_stage_record",
    "decode_stage_request",
    "encoded_nbytes",
    "request_nbytes",
    "stage_key",
    "stage_tag",
    "stage_training_keys",
]

T = TypeVar("T")

STAGE_TOPIC = "swarm.stage"
#: The most stages a run may declare (DESIGN D9: a handful; the DHT holds one key per stage).
MAX_STAGES = 64
#: The largest request or answer payload: 64 micro-batch samples x 2048 tokens x 2048 wide in float32.
MAX_STAGE_BYTES = 1 << 30
MAX_DIM = 1 << 24
MAX_NUMEL = 1 << 28
MAX_FIELDS = 8
#: Short: a dead server's record misleads rebalancing until it expires (trainers ban it at once).
STAGE_RECORD_TTL = 12.0
#: The DHT key of the servers' link measurements while a run forms (module docstring, "Link records").
LINKS_KEY = "swarm.links"
#: Long enough to outlive a formation window; a formation reads them only once, when it closes.
LINK_RECORD_TTL = 300.0
#: The most measured links one record carries (a server samples, it does not measure all n - 1).
MAX_LINK_SAMPLES = 64
#: The largest round-trip time a record may state, in seconds (beyond it a link is useless anyway).
MAX_LINK_RTT = 60.0
#: Field dtypes a trainer may send (little-endian) and their item sizes.
FIELD_DTYPES: dict[str, int] = {"int64": 8, "int32": 4, "float32": 4, "bool": 1, "uint8": 1}

_Shape = Annotated[
    list[Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]], msgspec.Meta(min_length=1, max_length=4)
]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")]
_Dtype = Literal["int64", "int32", "float32", "bool", "uint8"]
_Stage = Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)]
_Samples = Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A float tensor on the wire: its shape and the codec its bytes are encoded with."""

    shape: _Shape
    codec: CodecName = "none"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FieldSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One field of the task's batch, as raw little-endian bytes."""

    name: _Name
    dtype: _Dtype
    shape: _Shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * FIELD_DTYPES[self.dtype]


class StageRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A trainer's request to a stage server (module docstring)."""

    stage: _Stage
    op: Literal["forward", "backward"]
    samples: _Samples
    hidden: TensorSpec | None = None
    grad: TensorSpec | None = None
    fields: Annotated[list[FieldSpec], msgspec.Meta(max_length=MAX_FIELDS)] = []
    #: the codec the server should encode its answer with
    answer_codec: CodecName = "none"
    #: a backward: answer with a signed receipt of the samples carried (module docstring, "Receipts")
    receipt: bool = False


class StageAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A stage server's answer (module docstring); the output's bytes follow the ack."""

    status: Literal["ok", "busy"]
    #: the server's stage step (a backward's samples went toward ``step + 1``)
    step: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    retry_after: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0
    output: TensorSpec | None = None
    #: the micro-batch's mean loss (a backward of the last stage)
    loss: float | None = None
    #: the server's receipt for the trainer, when the backward's request asked (module docstring)
    receipt: SignedReceipt | None = None


class StageRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A stage server's DHT announcement (module docstring)."""

    stage: _Stage
    stages: Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)]
    addrs: Annotated[list[MultiaddrStr], msgspec.Meta(max_length=8)]
    step: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0
    #: requests admitted and not answered yet, and the server's limit (the load it reports)
    queued: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    #: samples per second its backward passes ran at lately (0: not measured yet)
    samples_per_second: Annotated[float, msgspec.Meta(ge=0.0, le=1e12)] = 0.0


class LinkSample(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One measured link: to ``peer``, the round trip in seconds."""

    peer: PeerIdStr
    rtt: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_LINK_RTT)]


class LinkRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A server's link measurements while its run forms (module docstring, "Link records")."""

    stages: Annotated[int, msgspec.Meta(ge=1, le=MAX_STAGES)]
    #: when the writer joined the formation (unix time; a claim, bounded by the reader)
    started: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    addrs: Annotated[list[MultiaddrStr], msgspec.Meta(max_length=8)]
    links: Annotated[list[LinkSample], msgspec.Meta(max_length=MAX_LINK_SAMPLES)] = []


def stage_training_keys(stage: int) -> TrainingKeys:
    """The keys the servers of ``stage`` meet under as a collaboration of their own (progress records,
    state announcements, averaging rounds): ``swarm.s<k>.progress``, ``.state`` and ``.avg``."""
    stage_key(stage)  # the same bounds
    return TrainingKeys(f"swarm.s{stage}.progress", f"swarm.s{stage}.state", f"swarm.s{stage}.avg")


def stage_tag(stage: int, stages: int) -> str:
    """What a state of ``stage`` of a ``stages``-stage run says it is: the ``stage`` entry of its blob's
    metadata (``"<k>/<S>"``). A stage server refuses to load a state of another stage, and a backbone to
    store one as this stage's checkpoint (:mod:`backbone.checkpointer`, "Swarm runs")."""
    if not 0 <= stage < stages <= MAX_STAGES:
        raise ValueError(f"stage {stage} of {stages} stages (at most {MAX_STAGES})")
    return f"{stage}/{stages}"


def stage_key(stage: int) -> str:
    """The DHT key under which the servers of ``stage`` announce themselves."""
    if not 0 <= stage < MAX_STAGES:
        raise ValueError(f"stage {stage} is outside [0, {MAX_STAGES})")
    return f"swarm.stage.{stage}"


def encoded_nbytes(spec: TensorSpec) -> int:
    """Bytes of ``spec``'s tensor encoded with its codec (as :mod:`shared.averaging.compression` sizes it)."""
    numel = spec.numel
    if spec.codec == "none":
        return 4 * numel
    if spec.codec == "fp16":
        return 2 * numel
    return 4 * -(-numel // INT8_BLOCK) + numel  # int8-blockwise: one float32 step per block


def request_nbytes(request: StageRequest) -> int:
    """The payload size ``request`` declares: hidden, grad, then every field."""
    tensors = [t for t in (request.hidden, request.grad) if t is not None]
    return sum(encoded_nbytes(t) for t in tensors) + sum(f.nbytes for f in request.fields)


def _check_request(request: StageRequest) -> None:
    for label, spec in (("hidden", request.hidden), ("grad", request.grad)):
        if spec is None:
            continue
        if spec.numel > MAX_NUMEL:
            raise ProtocolError(f"{label} of {spec.numel} elements exceeds {MAX_NUMEL}")
        if spec.shape[0] != request.samples:
            raise ProtocolError(f"{label} holds {spec.shape[0]} samples, the request {request.samples}")
    names = [f.name for f in request.fields]
    if len(set(names)) != len(names):
        raise ProtocolError(f"field names repeat: {names}")
    for field in request.fields:
        if math.prod(field.shape) > MAX_NUMEL:
            raise ProtocolError(
                f"field {field.name} of {math.prod(field.shape)} elements exceeds {MAX_NUMEL}"
            )
        if field.shape[0] != request.samples:
            raise ProtocolError(
                f"field {field.name} holds {field.shape[0]} samples, the request {request.samples}"
            )
    if request.op == "forward" and request.grad is not None:
        raise ProtocolError("a forward request carries no gradient")


_REQUEST = msgspec.msgpack.Decoder(StageRequest)
_ANSWER = msgspec.msgpack.Decoder(StageAnswer)
_RECORD = msgspec.msgpack.Decoder(StageRecord)
_LINKS = msgspec.msgpack.Decoder(LinkRecord)


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"invalid {what}: {exc}") from exc


def decode_stage_request(meta: bytes) -> StageRequest:
    """Decode and check a request's header (the module docstring's bounds that need no model).

    Raises:
        ProtocolError: malformed, a field out of range, or inconsistent sizes.
    """
    request = _decode(_REQUEST, meta, "stage request")
    _check_request(request)
    return request


def decode_stage_answer(meta: bytes) -> StageAnswer:
    """Decode a server's answer header.

    Raises:
        ProtocolError: malformed, or an output beyond the limits.
    """
    answer = _decode(_ANSWER, meta, "stage answer")
    if answer.output is not None and answer.output.numel > MAX_NUMEL:
        raise ProtocolError(f"an answer of {answer.output.numel} elements exceeds {MAX_NUMEL}")
    if answer.loss is not None and not math.isfinite(answer.loss):
        raise ProtocolError(f"loss {answer.loss!r} is not finite")
    return answer


def decode_stage_record(value: bytes) -> StageRecord:
    """Decode a stage server's DHT record.

    Raises:
        ProtocolError: malformed, or a field out of range.
    """
    record = _decode(_RECORD, value, "stage record")
    if record.stage >= record.stages:
        raise ProtocolError(f"stage {record.stage} of {record.stages} stages")
    if not math.isfinite(record.samples_per_second):
        raise ProtocolError("samples_per_second is not finite")
    return record


def decode_link_record(value: bytes) -> LinkRecord:
    """Decode a server's link record (the bounds of its type; NaN is refused by the range checks).

    Raises:
        ProtocolError: malformed, or a field out of range.
    """
    record = _decode(_LINKS, value, "link record")
    if not math.isfinite(record.started):
        raise ProtocolError("started is not finite")
    return record
