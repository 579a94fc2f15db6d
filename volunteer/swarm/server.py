"""A stage server: serves one pipeline stage to any admitted trainer over the bulk lane (issue 17 item 2).

The wire and its bounds are :mod:`protocols.swarm`; the computation is :class:`~.stage_trainer.StageTrainer`.
:class:`StageServer` registers the ``swarm.stage`` bulk handler on a node's host and, for each request:

1. decodes and checks the header (:func:`protocols.swarm.decode_stage_request`): our stage, the op the
   stage's position allows (no ``forward`` of the last stage, a ``hidden`` exactly when we are not the
   first, a ``grad`` on a backward exactly when we are not the last), declared sizes adding up to the
   header's ``nbytes`` and within :attr:`StageServerConfig.max_bytes` -- all before one byte of the
   payload is read into memory;
2. admits it into the queue, or answers ``busy`` when :attr:`StageServerConfig.max_queue` requests are
   already admitted, or when it is a backward and the stage's collaboration says no sample may be counted
   now (``accepting``: a state download under way, our share of the step done). The payload is then read
   and dropped; ``retry_after`` is the queue's expected drain time, from the measured seconds per sample;
3. reads the payload, decodes the tensors with their codecs (a malformed encoding is the request's
   ``BAD_REQUEST``), bounds their scale and runs the stage on the one torch thread
   (:func:`~volunteer.collab.torch_thread.run_torch`);
4. answers with the output encoded with the codec the trainer asked for, and, for a backward whose
   request asked (``receipt``), a receipt signed for the trainer (the request's authenticated peer): its
   samples and request bytes toward the stage step the backward counted for, cumulative
   (:class:`shared.swarm.carried.CarriedTally`; :mod:`protocols.swarm`, "Receipts"); a forward's
   request bytes are tallied too (no samples), so the next receipt covers them. The answers' payload
   bytes are :attr:`StageServerStatistics.bytes_sent`, this server's claim of bytes sent in the ledger
   (:mod:`backbone.ledger.accounting`, "Swarm bytes").

**Bounding what a trainer sends** (DESIGN D10: a trainer is a stranger). Non-finite inputs never reach
the accumulators (the stage trainer refuses them whole). A finite but absurd input is bounded as trainers
bound servers' answers (:class:`shared.swarm.answers.AnswerCheck`, one per tensor kind: the stage's input
``hidden`` and the gradient ``grad`` of its output): an RMS beyond ``factor`` times the lower median of
the recently accepted ones (or beyond ``max_rms`` during warm-up) is the request's ``BAD_REQUEST``. So a
minority of lying trainers can add at most a bounded multiple of an honest micro-batch's gradient each;
plausible garbage within the bound is for the stage's robust averaging to weigh.

A request the stage cannot run on is refused with ``BAD_REQUEST`` and counted; nothing a trainer sends
ends the server. Fault points for tests: ``swarm.forward.<k>`` and ``swarm.backward.<k>`` (a request to
stage ``k`` was read, nothing computed yet).

**Emulating a slower device** (benchmarks only: ``scripts/bench_swarm.py``; on a shared CPU, extra threads
add no compute, so speed differences are emulated by time). With
:attr:`StageServerConfig.emulated_seconds_per_sample` ``= e > 0`` a sample costs the server at least ``e``
seconds of device time at its stage: ``e/3`` in a forward, ``2e/3`` in a backward (which recomputes the
forward), and all of ``e`` in a backward of the last stage (which serves no forwards: its backward runs its
forward). After computing, the server sleeps what its computation left of that time, one request at a
time, as one accelerator would; its measured busy time per sample is at least the emulated one, so the
rate it publishes (what rebalancing weighs) and the times trainers measure are those of the emulated
device. The computation itself is unchanged.

:func:`announce_forever` keeps the server's :class:`~protocols.swarm.StageRecord` in the DHT.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import trio

from protocols.bulk import BulkHeader
from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from protocols.swarm import (
    MAX_STAGE_BYTES,
    STAGE_RECORD_TTL,
    STAGE_TOPIC,
    FieldSpec,
    StageAnswer,
    StageRecord,
    StageRequest,
    TensorSpec,
    decode_stage_request,
    encoded_nbytes,
    request_nbytes,
    stage_key,
)
from shared import faults
from shared.averaging.compression import codec_by_name
from shared.net.bulk import BulkReader, BulkReply
from shared.net.rpc import RequestContext
from shared.node import Node
from shared.swarm.answers import AnswerCheck, AnswerLimits
from shared.swarm.carried import CarriedTally

from ..collab.torch_thread import run_torch
from .stage_trainer import StageInputError, StageTrainer

__all__ = ["StageServer", "StageServerConfig", "StageServerStatistics", "announce_forever"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageServerConfig:
    """Tunables of a :class:`StageServer`.

    Attributes:
        max_queue: requests admitted at once (running or waiting for the torch thread); more are answered
            ``busy``.
        max_bytes: the largest request payload accepted (``TOO_LARGE`` beyond).
        limits: the bounds on the scale of a request's ``hidden`` and ``grad`` (module docstring).
        emulated_seconds_per_sample: benchmarks only: the device seconds a sample costs at least
            (module docstring, "Emulating a slower device"); 0: off.
    """

    max_queue: int = 8
    max_bytes: int = 256 * 1024 * 1024
    limits: AnswerLimits = field(default_factory=AnswerLimits)
    emulated_seconds_per_sample: float = 0.0

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 1 <= self.max_bytes <= MAX_STAGE_BYTES:
            raise ValueError(f"max_bytes must be in [1, {MAX_STAGE_BYTES}], got {self.max_bytes}")
        emulated = self.emulated_seconds_per_sample
        if not (math.isfinite(emulated) and emulated >= 0.0):
            raise ValueError(f"emulated_seconds_per_sample must be finite and >= 0, got {emulated}")


@dataclass
class StageServerStatistics:
    forwards: int = 0
    backwards: int = 0
    samples: int = 0  # samples of the backward passes served (the stage's work, for the ledger)
    busy: int = 0
    refused: int = 0  # requests answered BAD_REQUEST / TOO_LARGE
    bytes_received: int = 0
    bytes_sent: int = 0
    receipts: int = 0  # trainers' receipts signed (module docstring, "Receipts")
    refusals: dict[str, int] = field(default_factory=dict)  # by reason's first words


class StageServer:
    """Serves ``trainer``'s stage on ``node`` (registered at construction; module docstring).

    ``accepting`` says whether a backward may be counted now (the stage's collaboration is not
    downloading a state, and our share of the step is not done); when it says no, a backward is answered
    ``busy``, so trainers take it to another server of the stage or retry shortly. ``on_counted(samples,
    loss)`` is called after each backward that was counted (loss: the last stage's).

    Raises:
        ValueError: the host already serves a stage.
    """

    def __init__(
        self,
        node: Node,
        trainer: StageTrainer,
        config: StageServerConfig | None = None,
        accepting: Callable[[], bool] = lambda: True,
        on_counted: Callable[[int, float | None], None] = lambda samples, loss: None,
    ) -> None:
        if STAGE_TOPIC in node.host.bulk_handlers:
            raise ValueError("this host already serves a pipeline stage")
        self.node = node
        self.trainer = trainer
        self.config = config or StageServerConfig()
        self.stats = StageServerStatistics()
        self.queued = 0
        self.accepting = accepting
        self.on_counted = on_counted
        self._inputs = {"hidden": AnswerCheck(self.config.limits), "grad": AnswerCheck(self.config.limits)}
        self.closed = False
        self._device = trio.Lock()  # an emulated device runs one request at a time (module docstring)
        #: trainers' cumulative counts, for the receipts their backwards ask for (module docstring)
        self.carried = CarriedTally(
            node.host.run_id, node.peer_id, trainer.stage.index, node.host.endpoint.identity.sign
        )
        node.host.bulk_handlers[STAGE_TOPIC] = self._on_request

    def close(self) -> None:
        """Stop serving: requests are refused from now on (the host may then serve another stage), and
        :func:`announce_forever` stops renewing our record."""
        self.closed = True
        if self.node.host.bulk_handlers.get(STAGE_TOPIC) == self._on_request:
            del self.node.host.bulk_handlers[STAGE_TOPIC]

    @property
    def stage(self) -> int:
        return self.trainer.stage.index

    @property
    def seconds_per_sample(self) -> float:
        """The busy time per sample we publish (0 until measured): the trainer's, and with an emulated
        device never below its time (module docstring). The trainer's averages are raised to the emulated
        time only after each request's emulated wait, so while a request waits they hold the bare
        computation's faster time, and a record read then claimed a faster device."""
        seconds = self.trainer.seconds_per_sample
        return max(seconds, self.config.emulated_seconds_per_sample) if seconds > 0 else 0.0

    def record(self) -> StageRecord:
        """Our DHT announcement now."""
        seconds = self.seconds_per_sample
        return StageRecord(
            stage=self.stage,
            stages=self.trainer.stage.count,
            addrs=list(self.node.host.advertised_addrs[:8]),
            step=self.trainer.step,
            queued=self.queued,
            samples_per_second=1.0 / seconds if seconds > 0 else 0.0,
        )

    def retry_after(self) -> float:
        """When a queue slot is expected to free up: the queue's work at the measured speed."""
        per_request = max(self.seconds_per_sample, 1e-4) * 8  # a typical micro-batch's samples
        return min(10.0, max(0.05, per_request * self.queued))

    # ------------------------------------------------------------------------------------- the handler

    async def _on_request(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> BulkReply:
        try:
            request = decode_stage_request(header.meta)
            self._check(request, header.nbytes)
        except ProtocolError as exc:
            self._refuse(str(exc))
            raise
        if self.queued >= self.config.max_queue or (request.op == "backward" and not self.accepting()):
            self.stats.busy += 1
            await reader.discard()
            answer = StageAnswer(status="busy", step=self.trainer.step, retry_after=self.retry_after())
            return BulkReply(msgspec.msgpack.encode(answer), memoryview(b""))
        self.queued += 1
        try:
            payload = bytearray(header.nbytes)
            await reader.read_into(memoryview(payload))
            self.stats.bytes_received += header.nbytes
            await faults.point(f"swarm.{request.op}.{self.stage}")
            try:
                hidden, grad, batch = _decode_payload(request, memoryview(payload))
            except ProtocolError as exc:
                self._refuse(str(exc))
                raise
            self._bound("hidden", hidden)
            self._bound("grad", grad)
            out: torch.Tensor | None
            emulated = self._emulated_seconds(request.op)
            try:
                async with self._device if emulated else contextlib.nullcontext():
                    started = trio.current_time()
                    if request.op == "forward":
                        out = await run_torch(self.trainer.forward, hidden, batch)
                        loss = None
                    else:
                        out, loss = await run_torch(
                            self.trainer.backward, hidden, batch, grad, request.samples
                        )
                    if emulated:
                        await trio.sleep_until(started + emulated * request.samples)
                        self._count_emulated(request.op, emulated)
                receipt = None
                if request.op == "forward":
                    self.stats.forwards += 1
                    # its bytes go into the trainer's next receipt of the step (module docstring, 4)
                    self.carried.count(str(ctx.peer_id), self.trainer.step + 1, 0, header.nbytes)
                else:
                    self.stats.backwards += 1
                    self.stats.samples += request.samples
                    toward = self.trainer.step + 1  # the stage step these samples count toward
                    self.on_counted(request.samples, loss)
                    if request.receipt:
                        receipt = self.carried.receipt(
                            str(ctx.peer_id), toward, request.samples, header.nbytes
                        )
                        self.stats.receipts += 1
            except StageInputError as exc:
                self._refuse(str(exc))
                raise ProtocolError(str(exc), ErrorCode.BAD_REQUEST) from exc
        finally:
            self.queued -= 1
        spec, data = _encode_output(out, request.answer_codec)
        answer = StageAnswer(status="ok", step=self.trainer.step, output=spec, loss=loss, receipt=receipt)
        self.stats.bytes_sent += len(data)
        return BulkReply(msgspec.msgpack.encode(answer), memoryview(data))

    def _emulated_seconds(self, op: str) -> float:
        """The emulated device seconds per sample of an ``op`` request (module docstring); 0: off."""
        seconds = self.config.emulated_seconds_per_sample
        if op == "forward":
            return seconds / 3
        return seconds if self.trainer.last else 2 * seconds / 3

    def _count_emulated(self, op: str, seconds: float) -> None:
        """The busy time the trainer measures (its EMA of the computation alone, below the emulated time
        while the computation is faster than the emulated device) counts the emulated time."""
        trainer = self.trainer
        if op == "forward":
            trainer.forward_seconds = max(trainer.forward_seconds, seconds)
        else:
            trainer.backward_seconds = max(trainer.backward_seconds, seconds)

    def _check(self, request: StageRequest, nbytes: int) -> None:
        trainer = self.trainer
        if request.stage != self.stage:
            raise ProtocolError(
                f"this server serves stage {self.stage}, not {request.stage}", ErrorCode.WRONG_RUN
            )
        if request.op == "forward" and trainer.last:
            raise ProtocolError("the last stage runs forward only as part of a backward request")
        if (request.hidden is None) != trainer.first:
            raise ProtocolError(
                f"stage {self.stage} {'takes no' if trainer.first else 'needs a'} hidden state"
            )
        if request.op == "backward" and (request.grad is None) != trainer.last:
            raise ProtocolError(
                f"a backward of stage {self.stage} {'takes no' if trainer.last else 'needs a'} gradient"
            )
        declared = request_nbytes(request)
        if declared != nbytes:
            raise ProtocolError(f"the request declares {declared} bytes but sends {nbytes}")
        if nbytes > self.config.max_bytes:
            raise ProtocolError(
                f"{nbytes} bytes exceed this server's {self.config.max_bytes}", ErrorCode.TOO_LARGE
            )

    def _bound(self, kind: str, tensor: torch.Tensor | None) -> None:
        """Refuse an input of absurd scale (module docstring)."""
        if tensor is None:
            return
        flat = tensor.reshape(-1).double()
        finite = bool(torch.isfinite(flat).all())
        rms = float(flat.square().mean().sqrt()) if finite and flat.numel() else 0.0
        problem = self._inputs[kind].problem(tuple(tensor.shape), tuple(tensor.shape), finite=finite, rms=rms)
        if problem is not None:
            reason = f"{kind} refused: {problem}"
            self._refuse(reason)
            raise ProtocolError(reason, ErrorCode.BAD_REQUEST)

    def _refuse(self, reason: str) -> None:
        self.stats.refused += 1
        key = " ".join(reason.split()[:3])
        self.stats.refusals[key] = self.stats.refusals.get(key, 0) + 1


def _decode_payload(
    request: StageRequest, payload: memoryview
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The request's tensors and fields from its payload (sizes were checked against the header).

    Raises:
        ProtocolError: an encoding does not decode (e.g. a non-finite int8 scale).
    """
    offset = 0

    def tensor(spec: TensorSpec | None) -> torch.Tensor | None:
        nonlocal offset
        if spec is None:
            return None
        size = encoded_nbytes(spec)
        flat = codec_by_name(spec.codec).decode(payload[offset : offset + size], spec.numel)
        offset += size
        return torch.from_numpy(flat).reshape(spec.shape)

    hidden = tensor(request.hidden)
    grad = tensor(request.grad)
    batch: dict[str, torch.Tensor] = {}
    for item in request.fields:
        size = item.nbytes
        array = np.frombuffer(payload[offset : offset + size], dtype=_numpy_dtype(item)).reshape(item.shape)
        offset += size
        batch[item.name] = torch.from_numpy(array.copy())
    return hidden, grad, batch


def _numpy_dtype(item: FieldSpec) -> np.dtype:
    return np.dtype("?" if item.dtype == "bool" else f"<{np.dtype(item.dtype).str[1:]}")


def _encode_output(out: torch.Tensor | None, codec: str) -> tuple[TensorSpec | None, bytes]:
    if out is None:
        return None, b""
    spec = TensorSpec(shape=list(out.shape), codec=codec)  # type: ignore[arg-type]
    flat = np.ascontiguousarray(out.detach().numpy(), dtype=np.float32).reshape(-1)
    return spec, codec_by_name(codec).encode(flat)


async def announce_forever(node: Node, server: StageServer, period: float = STAGE_RECORD_TTL / 3) -> None:
    """Keep ``server``'s record under its stage's key (every ``period`` seconds, at once when it changes
    in what trainers route by: addresses or step) until the server is closed."""
    published: tuple[object, ...] | None = None
    next_publish = trio.current_time()
    while not server.closed:
        record = server.record()
        shown = (tuple(record.addrs), record.step)
        if record.addrs and (trio.current_time() >= next_publish or shown != published):
            with node.tolerated.around("stage record publish"):
                await node.dht.store(
                    stage_key(server.stage),
                    msgspec.msgpack.encode(record),
                    time.time() + STAGE_RECORD_TTL,
                    subkey=node.peer_id.encode(),
                )
                published = shown
                next_publish = trio.current_time() + period
        await trio.sleep(min(1.0, period))
