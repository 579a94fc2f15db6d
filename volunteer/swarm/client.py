"""A SWARM trainer's side of the pipeline: carry a micro-batch through one server per stage, routed by
stochastic wiring, rerouted on any failure (issue 17 item 3; seed 004 §3.2, App. C).

:meth:`SwarmClient.process` takes one collated micro-batch of the task and:

1. *forward*: for stage ``k = 0 .. S-2``, sends the previous stage's output (``hidden``; none for stage
   0) and the batch's fields to a server of stage ``k`` and keeps what it sent (the stage's input);
2. *backward*: sends the last stage's input to a server of stage ``S-1``, which recomputes, back-
   propagates its loss times the samples and answers with the gradient of its input and the loss; then
   for ``k = S-2 .. 0`` sends stage ``k``'s input and the gradient of its output, and gets the gradient
   of its input back (none from stage 0).

The trainer keeps each stage's input until the micro-batch is done: that is its memory cost, and what
lets a backward go to *any* server of the stage (servers keep nothing between the two passes).

**Choosing a server** (:class:`~shared.swarm.wiring.StageRouter`, one per stage and direction: a forward
and a backward take different times, and a router shared by both would alternate them over two servers
of a stage, one doing every forward and the other every backward): interleaved weighted round-robin on
the response times this trainer measured (seconds per sample of the request); a failure bans the server
in both directions, a busy answer defers both. The
first answer of each server is not a measurement (its time includes the dial and the authenticated
handshake, often more than the request itself: counting it would starve a newly joined server); the
routers learn the stage's servers from the DHT (:func:`~shared.swarm.directory.find_stage_servers`),
re-read at most every :attr:`SwarmClientConfig.refresh_period` seconds, and at once when no server is
left to try.

**Failures** (nothing is lost: the request is sent again to another server of the stage):

* no answer within :attr:`SwarmClientConfig.timeout`, a broken connection, a refusal, an answer that
  does not decode -> the server is banned until it re-announces itself;
* an answer whose tensor is mis-shaped, non-finite or of absurd scale (:class:`~shared.swarm.answers
  .AnswerCheck`, one per stage and direction) -> banned likewise;
* ``busy`` -> skipped until its ``retry_after`` passes, not banned;
* no usable server of a stage, or only busy ones, for :attr:`SwarmClientConfig.patience` seconds without
  an answer -> :class:`NoStageServer`
  (the micro-batch was not counted anywhere but possibly at the stages whose backward completed; the
  caller decides whether to retry it).

A backward that a server ran but whose answer was lost (the connection broke, or the answer came too late,
after it accumulated) is sent again elsewhere: its samples are then counted twice at that stage. SWARM
accepts the same; here it can only follow a broken connection or a timeout (a refusal accumulated
nothing), and it is counted (:attr:`SwarmStatistics.uncertain_backwards`).

**Receipts** (issue 17 item 6; :mod:`backbone.ledger.accounting`, "Swarm trainers"). A client built with
``on_carried`` (and :attr:`SwarmClientConfig.receipts` on) asks every server it sends a backward to for a
receipt (``StageRequest.receipt``). Each answer's receipt is checked
(:func:`shared.swarm.carried.check_carried`: signed by the server called, about this peer, of the
request's stage, at least the backward's samples) and handed to ``on_carried(stage, step, server,
receipt)`` at once, so the evidence of a micro-batch that later fails at a lower stage is kept too (its
stages did the work). A refused receipt is dropped and counted (``bad_receipts``), a missing one too
(``missing_receipts``): the answer itself is good, so the server is not banned for either.

**Bytes** (:mod:`backbone.ledger.accounting`, "Swarm bytes"). The client counts the payload bytes of its
requests a server answered (:attr:`SwarmStatistics.bytes_sent`: the trainer's claim, which the servers'
receipts evidence) and, per server, the payload bytes of the answers it accepted
(:attr:`SwarmStatistics.received`: the evidence of that server's sending, which our reports carry). A
busy answer, a failure or a refused answer counts in neither.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import trio

from protocols.averaging import CodecName
from protocols.errors import ProjectError, ProtocolError
from protocols.peer_id import PeerId
from protocols.receipts import SignedReceipt
from protocols.swarm import (
    FIELD_DTYPES,
    STAGE_TOPIC,
    FieldSpec,
    StageAnswer,
    StageRequest,
    TensorSpec,
    decode_stage_answer,
    encoded_nbytes,
)
from shared.averaging.compression import codec_by_name
from shared.errors import PeerUnavailable
from shared.net.host import CALL_FAILURES
from shared.node import Node
from shared.swarm.answers import AnswerCheck, AnswerLimits
from shared.swarm.carried import check_carried
from shared.swarm.directory import StageServerEntry, find_stage_servers
from shared.swarm.wiring import NoServer, Pick, StageRouter, Wait, WiringConfig

__all__ = [
    "NoStageServer",
    "SwarmClient",
    "SwarmClientConfig",
    "SwarmStatistics",
    "field_specs",
    "micro_batch_samples",
]

logger = logging.getLogger(__name__)


class NoStageServer(ProjectError):
    """A stage had no usable server for the client's whole patience."""


@dataclass(frozen=True)
class SwarmClientConfig:
    """Tunables of a :class:`SwarmClient` (module docstring)."""

    codec: CodecName = "none"
    timeout: float = 60.0
    refresh_period: float = 2.0
    patience: float = 60.0
    wiring: WiringConfig = field(default_factory=WiringConfig)
    limits: AnswerLimits = field(default_factory=AnswerLimits)
    #: ask servers for receipts of our backwards (when the client has somewhere to put them)
    receipts: bool = True

    def __post_init__(self) -> None:
        for name in ("timeout", "refresh_period", "patience"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")


@dataclass
class SwarmStatistics:
    micro_batches: int = 0
    samples: int = 0
    requests: int = 0
    failures: int = 0  # requests that failed (the server was banned)
    refused_answers: int = 0  # answers that failed the checks (the server was banned too)
    busy: int = 0
    uncertain_backwards: int = 0  # backwards sent again after a broken connection or timeout (docstring)
    #: per stage, micro-batch requests each server answered
    routed: dict[int, dict[str, int]] = field(default_factory=dict)
    #: the last failure's reason
    last_failure: str | None = None
    #: servers' receipts of our backwards: checked and handed on, refused, missing (module docstring)
    receipts: int = 0
    bad_receipts: int = 0
    missing_receipts: int = 0
    #: payload bytes of our requests that a server answered "ok" (our claim of bytes sent), and per
    #: server the payload bytes of its answers we accepted (module docstring, "Bytes")
    bytes_sent: int = 0
    received: dict[str, int] = field(default_factory=dict)


@dataclass
class _Stage:
    #: one router per direction: forwards and backwards alternate through a stage, so a shared router
    #: would send every forward to one server and every backward to the other
    routers: dict[str, StageRouter]
    forward: AnswerCheck
    backward: AnswerCheck
    servers: dict[PeerId, StageServerEntry] = field(default_factory=dict)
    refreshed: float = -math.inf
    #: the output width the stage's answers gave first (every later answer must match it)
    width: int | None = None
    #: servers that answered once: their next answers' times are measurements
    warm: set[str] = field(default_factory=set)


class SwarmClient:
    """Routes micro-batches through a run's stage servers (module docstring)."""

    def __init__(
        self,
        node: Node,
        stages: int,
        config: SwarmClientConfig | None = None,
        on_carried: Callable[[int, int, str, SignedReceipt], None] | None = None,
    ) -> None:
        if stages < 1:
            raise ValueError(f"need at least one stage, got {stages}")
        self.node = node
        self.stages = stages
        self.config = config or SwarmClientConfig()
        #: ``(stage, step, server, receipt)`` of each checked receipt (module docstring, "Receipts")
        self.on_carried = on_carried
        self._asks = on_carried is not None and self.config.receipts
        self.stats = SwarmStatistics()
        self._stage = [
            _Stage(
                {op: StageRouter(self.config.wiring) for op in ("forward", "backward")},
                AnswerCheck(self.config.limits),
                AnswerCheck(self.config.limits),
            )
            for _ in range(stages)
        ]

    async def process(self, batch: Mapping[str, torch.Tensor]) -> float:
        """Carry one micro-batch through the pipeline, forward and backward; returns its mean loss.

        Raises:
            NoStageServer: a stage had no usable server for ``config.patience`` seconds.
            ValueError: a batch field has a dtype the wire does not carry.
        """
        fields = field_specs(batch)
        raw = b"".join(_field_bytes(batch[f.name], f) for f in fields)
        samples = micro_batch_samples(batch)
        if samples < 1:
            raise ValueError("a micro-batch needs at least one field with one sample")
        inputs: list[torch.Tensor | None] = [None]
        for k in range(self.stages - 1):
            _, out = await self._call(k, "forward", samples, inputs[k], None, fields, raw)
            assert out is not None
            inputs.append(out)
        answer, grad = await self._call(self.stages - 1, "backward", samples, inputs[-1], None, fields, raw)
        loss = answer.loss
        if loss is None:  # checked in _call; kept for the type checker
            raise ProtocolError("the last stage answered without a loss")
        for k in range(self.stages - 2, -1, -1):
            _, grad = await self._call(k, "backward", samples, inputs[k], grad, fields, raw)
        self.stats.micro_batches += 1
        self.stats.samples += samples
        return loss

    # ------------------------------------------------------------------------------------ one request

    async def _call(
        self,
        k: int,
        op: str,
        samples: int,
        hidden: torch.Tensor | None,
        grad: torch.Tensor | None,
        fields: list[FieldSpec],
        raw: bytes,
    ) -> tuple[StageAnswer, torch.Tensor | None]:
        codec = self.config.codec
        hidden_spec = None if hidden is None else TensorSpec(shape=list(hidden.shape), codec=codec)
        grad_spec = None if grad is None else TensorSpec(shape=list(grad.shape), codec=codec)
        request = StageRequest(
            stage=k, op=op, samples=samples, hidden=hidden_spec, grad=grad_spec,  # type: ignore[arg-type]
            fields=fields, answer_codec=codec, receipt=op == "backward" and self._asks,
        )  # fmt: skip
        payload = b"".join([_encode(hidden, codec), _encode(grad, codec), raw])
        meta = msgspec.msgpack.encode(request)
        state = self._stage[k]
        lonely_since: float | None = None
        while True:
            now = trio.current_time()
            if now - state.refreshed >= self.config.refresh_period:
                await self._refresh(k)
            choice = state.routers[op].choose(trio.current_time())
            if isinstance(choice, NoServer):
                lonely_since = now if lonely_since is None else lonely_since
                if now - lonely_since >= self.config.patience:
                    raise NoStageServer(f"no usable server of stage {k} for {self.config.patience:.0f} s")
                await trio.sleep(min(0.2, self.config.refresh_period))
                state.refreshed = -math.inf
                continue
            if isinstance(choice, Wait):  # every usable server is busy: waiting counts against patience too
                lonely_since = now if lonely_since is None else lonely_since
                if now - lonely_since >= self.config.patience:
                    raise NoStageServer(
                        f"every server of stage {k} answered busy for {self.config.patience:.0f} s"
                    )
                await trio.sleep_until(choice.until)
                continue
            assert isinstance(choice, Pick)
            server = choice.server
            entry = state.servers[PeerId(server)]
            self.stats.requests += 1
            started = time.perf_counter()
            reply: dict[str, object] = {}

            def sink(ack_meta: bytes, nbytes: int, reply: dict[str, object] = reply) -> memoryview:
                buffer = bytearray(nbytes)
                reply["data"] = buffer
                return memoryview(buffer)

            try:
                with trio.fail_after(self.config.timeout):
                    ack = await self.node.host.send_bulk(entry.address, STAGE_TOPIC, payload, meta, sink)
                answer = decode_stage_answer(ack)
            except CALL_FAILURES as exc:
                self._failed(k, server, f"{op} at {server[:12]}: {exc}")
                if op == "backward" and isinstance(exc, (PeerUnavailable, trio.TooSlowError)):
                    self.stats.uncertain_backwards += 1
                continue
            if answer.status == "busy":
                self.stats.busy += 1
                for router in state.routers.values():  # its queue is full for either direction
                    router.busy(server, now=trio.current_time(), retry_after=answer.retry_after)
                continue
            problem, output = self._check(k, op, answer, hidden, reply.get("data"))
            if problem is not None:
                self.stats.refused_answers += 1
                self._failed(k, server, f"{op} answer of {server[:12]} refused: {problem}")
                continue
            if server in state.warm:
                state.routers[op].observe(server, (time.perf_counter() - started) / samples)
            else:  # a cold request: its time includes the dial and the handshake (module docstring)
                state.warm.add(server)
            routed = self.stats.routed.setdefault(k, {})
            routed[server] = routed.get(server, 0) + 1
            self.stats.bytes_sent += len(payload)
            data = reply.get("data")
            if isinstance(data, bytearray) and data:
                self.stats.received[server] = self.stats.received.get(server, 0) + len(data)
            if request.receipt:
                self._take_receipt(k, server, samples, answer)
            return answer, output

    def _take_receipt(self, k: int, server: str, samples: int, answer: StageAnswer) -> None:
        """Check the receipt a backward's answer carries and hand it on (module docstring, "Receipts")."""
        if answer.receipt is None:
            self.stats.missing_receipts += 1
            return
        try:
            receipt = check_carried(
                answer.receipt,
                run_id=self.node.host.run_id,
                server=server,
                trainer=self.node.peer_id,
                stage=k,
                samples=samples,
            )
        except ProtocolError as exc:
            self.stats.bad_receipts += 1
            logger.debug("receipt of %s for stage %d refused: %s", server[:12], k, exc)
            return
        self.stats.receipts += 1
        assert self.on_carried is not None  # we asked
        self.on_carried(k, receipt.step, server, answer.receipt)

    def _check(
        self,
        k: int,
        op: str,
        answer: StageAnswer,
        hidden: torch.Tensor | None,
        data: object,
    ) -> tuple[str | None, torch.Tensor | None]:
        """Why the answer is refused (or ``None``), and its decoded tensor."""
        state = self._stage[k]
        last = k == self.stages - 1
        if op == "backward" and last and answer.loss is None:
            return "no loss from the last stage", None
        expects_output = op == "forward" or hidden is not None
        if answer.output is None:
            return (None, None) if not expects_output else ("no output tensor", None)
        if not expects_output:
            return "an output where none belongs", None
        assert isinstance(data, bytearray)
        if len(data) != encoded_nbytes(answer.output):
            return f"{len(data)} bytes for an output of {encoded_nbytes(answer.output)}", None
        try:
            flat = codec_by_name(answer.output.codec).decode(memoryview(data), answer.output.numel)
        except (ProtocolError, ValueError) as exc:
            return f"undecodable output: {exc}", None
        shape = tuple(answer.output.shape)
        if op == "forward":
            assert hidden is None or hidden.dim() == 3
            width = state.width if state.width is not None else (shape[2] if len(shape) == 3 else -1)
            samples, length = self._leading(hidden, shape)
            expected: tuple[int, ...] = (samples, length, width)
            check = state.forward
        else:
            assert hidden is not None
            expected = tuple(hidden.shape)
            check = state.backward
        finite = bool(np.isfinite(flat).all())
        rms = float(np.sqrt(np.mean(np.square(flat, dtype=np.float64)))) if finite and flat.size else 0.0
        problem = check.problem(shape, expected, finite=finite, rms=rms)
        if problem is None and op == "forward" and state.width is None:
            state.width = shape[2]
        return problem, (None if problem else torch.from_numpy(flat).reshape(shape))

    def _leading(self, hidden: torch.Tensor | None, shape: tuple[int, ...]) -> tuple[int, int]:
        """The samples and length a forward output must have: the input's (the first stage: the answer's
        own, which ``process`` checks against the batch through the next stage's request)."""
        if hidden is not None:
            return int(hidden.shape[0]), int(hidden.shape[1])
        return (shape[0], shape[1]) if len(shape) >= 2 else (-1, -1)

    def _failed(self, k: int, server: str, reason: str) -> None:
        self.stats.failures += 1
        self.stats.last_failure = reason
        for router in self._stage[k].routers.values():
            router.fail(server)

    async def _refresh(self, k: int) -> None:
        state = self._stage[k]
        state.refreshed = trio.current_time()
        with self.node.tolerated.around("stage directory read"):
            state.servers = await find_stage_servers(self.node.dht, k, self.stages)
            announced = {str(peer): entry.announced for peer, entry in state.servers.items()}
            for router in state.routers.values():
                router.announce(announced)


def micro_batch_samples(batch: Mapping[str, torch.Tensor]) -> int:
    """The samples of a collated micro-batch: its first field's first dimension (0 without fields)."""
    for value in batch.values():
        return int(value.shape[0]) if value.dim() else 0
    return 0


def field_specs(batch: Mapping[str, torch.Tensor]) -> list[FieldSpec]:
    """The wire description of a batch's fields.

    Raises:
        ValueError: a field's dtype is not one the wire carries (:data:`protocols.swarm.FIELD_DTYPES`).
    """
    specs = []
    for name, value in batch.items():
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in FIELD_DTYPES:
            raise ValueError(f"batch field {name} has dtype {dtype}, which the swarm wire does not carry")
        specs.append(FieldSpec(name=name, dtype=dtype, shape=list(value.shape)))  # type: ignore[arg-type]
    return specs


def _field_bytes(value: torch.Tensor, spec: FieldSpec) -> bytes:
    array = value.detach().cpu().contiguous().numpy()
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _encode(tensor: torch.Tensor | None, codec: str) -> bytes:
    if tensor is None:
        return b""
    flat = np.ascontiguousarray(tensor.detach().cpu().numpy(), dtype=np.float32).reshape(-1)
    return codec_by_name(codec).encode(flat)
