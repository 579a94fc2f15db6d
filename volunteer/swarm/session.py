"""One volunteer's session in a swarm run (``[sync] mode = "swarm"``): serve a stage, run trainers, leave.

A :class:`SwarmSession` is what ``volunteer join`` runs when the manifest selects the swarm mode (the
batch and diloco modes run :class:`~volunteer.session.TrainingSession`, whose set-up it shares: the
run's tokenizer and model, the device, the data stream, the contribution reporter). By ``--swarm-role``:

* ``server``: :func:`~.member.serve_swarm` -- placed in the stage that needs a server most, moved when
  rebalancing says so, stepping with the stage's other servers;
* ``trainer``: ``--trainers`` trainer loops (:class:`~.client.SwarmClient`), each carrying micro-batches
  of the run's data (``local_batch`` samples, or ``--micro-batch``) through one server per stage;
* ``auto`` (the default): both. On a loopback demo every volunteer is a CPU peer and serves; on a real
  run a peer without an accelerator should pass ``--swarm-role trainer`` (issue 17: accelerators serve
  stages, any peer may run trainers).

**No sample is lost, none counted twice by the trainer.** A micro-batch that found no usable server of
some stage for the client's patience (:class:`~.client.NoStageServer`: a stage lost its last server and
rebalancing has not refilled it yet) is carried again from the first stage once a server is back; the
stages whose backward had already completed count its samples again (:mod:`.client`, "Failures": SWARM
accepts the same; :attr:`~.client.SwarmStatistics.uncertain_backwards` counts the other case).

**When it ends.** Ctrl+C / SIGTERM (the server leaves its stage's collaboration, so the stage's round
stops waiting for it; trainers finish the micro-batch in flight within the stop grace), or the run's
step limit: our stage reached it (a server), or the stages' records show it (:func:`limit_reached`: one
stage at the limit, every other at most a step short); the micro-batches in flight and the stages still
a step short then get :data:`FINISH_GRACE` seconds.

**What is written.** ``steps.jsonl`` gets one line per step the stage we serve took here, with the
stage's index (``"stage"``); ``status.json`` as in every mode, and ``swarm.json`` (:meth:`SwarmSession
.status`: our stage, moves and trainers' samples).

**Credit** (:mod:`backbone.ledger.accounting`, "Swarm runs"). The session opens in the ledger and is kept
alive like any volunteer's. Each step the stage we serve takes here goes into our contribution reports
(:meth:`~volunteer.reporting.Reporter.record`): its samples are the samples our stage step accumulated
(*stage-samples*: a sample through one stage), its step the stage's step (a report's ``global_step`` is
then the stage's, not a global one). The stage's rounds leave the receipts its aggregators signed for
our parts, stating the stage, in the reporter's book, and the reports carry them; the backbone records
each stage's steps, so they count. Our trainers ask the servers they use for receipts
(:mod:`.client`, "Receipts"), which go into the same book as they arrive, and each micro-batch they
carry to the end is claimed as ``samples * stages`` stage-samples (compute 0) in our reports
(:meth:`SwarmSession._carried`; :mod:`backbone.ledger.accounting`, "Swarm trainers"). The pipeline bytes
our server's answers and our trainers' requests sent are claimed in our reports' ``bytes_sent``, and the
answer bytes our trainers received from each server are the evidence of that server's sending
(:class:`~.traffic.TrafficReader`; accounting, "Swarm bytes"). The stage steps of ours a stage state we
load replaced (a fork's after a partition, or what a restart lost) are reported discarded
(:mod:`.stage_service`, "Discards"; :meth:`~volunteer.reporting.Reporter.discard_stage`), so the ledger
takes their credit back.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from rich.console import Console

from protocols.receipts import SignedReceipt
from shared.lifecycle import Shutdown
from shared.panel import LivePanel, PanelView, Row
from shared.swarm.directory import find_stage_servers
from shared.swarm.replacement import ReplacementConfig

from ..collab.optimizer import StepRecord
from ..collab.phase import Phase
from ..data import BackboneShards, Prefetcher, open_examples
from ..session import TrainingSession
from ..tasks.base import Task
from ..training import STOP_GRACE, batches
from .client import NoStageServer, SwarmClient, micro_batch_samples
from .formation import FormationConfig
from .member import SwarmMember, serve_swarm
from .traffic import TrafficReader

__all__ = ["SWARM_ROLES", "SwarmSession", "limit_reached"]

logger = logging.getLogger("volunteer")

#: ``--swarm-role`` values (module docstring)
SWARM_ROLES = ("auto", "server", "trainer")
REFRESH = 0.5
RETRY = 2.0  # seconds between attempts of a micro-batch that found a stage without a server
STARVED_WARNING = 30.0  # seconds without a micro-batch before a trainer says so
LIMIT_CHECK = 2.0  # seconds between reads of the stages' steps (a run with a step limit)
#: once a stage reached the step limit, how long the micro-batches in flight and the stages still one
#: step short may take to finish (module docstring, "When it ends")
FINISH_GRACE = 30.0


@dataclass(frozen=True)
class CarriedBatch:
    """What the reporter notes of one micro-batch our trainer carried (its claim: module docstring)."""

    step: int
    samples: int  # stage-samples: the micro-batch's samples times the stages
    finished_at: float
    compute_seconds: float = 0.0
    bytes_aggregated: int = 0


class SwarmSession(TrainingSession):
    """The swarm mode's session (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        role = getattr(self.options, "swarm_role", "auto")
        if role not in SWARM_ROLES:
            raise ValueError(f"swarm role {role!r} is not one of {', '.join(SWARM_ROLES)}")
        self.serves = role in ("auto", "server")
        self.trainers = max(0, getattr(self.options, "trainers", 1)) if role in ("auto", "trainer") else 0
        self.member = SwarmMember()
        self.clients: list[SwarmClient] = []
        self.stages = self.spec.sync.stages
        #: per stage, the step we know it reached (our own steps; the lowest its servers announce)
        self.stage_steps: dict[int, int] = {}
        #: the collaboration of the stage we serve now (None while placing us, or as a trainer only); kept
        #: current by the panel's loop, for the daemon's status and metrics
        self.collab: Any = None
        self._enough = trio.Event()  # stopping, or the step limit: trainers take no new micro-batch
        # our pipeline bytes into our reports (module docstring, "Credit")
        self.reporter.swarm_traffic = TrafficReader(self._server_stats, self.clients)

    async def run(self, shutdown: Shutdown, console: Console) -> None:
        """Serve and train until stopped or the run's step limit (module docstring).

        Raises:
            ConfigError: the run's model cannot be split into its stages on this volunteer.
        """
        task = await self._build_task()
        if self.precision != "fp32":
            logger.info("pipeline stages train in fp32, not %s", self.precision)
            self.precision = "fp32"
        logger.info(
            "sync mode swarm: the model in %d stages; %s%s",
            self.stages,
            "serving a stage" if self.serves else "serving no stage",
            f", {self.trainers} trainer(s) of {self._micro_batch()}-sample micro-batches"
            if self.trainers
            else "",
        )
        seed = zlib.crc32(self.node.peer_id.encode())
        shards = BackboneShards(self.client) if self.client is not None else None
        examples = open_examples(
            self.spec.dataset, seed=seed, shards=shards, cache_dir=self.data_dir / "shards"
        )
        prefetch = Prefetcher(batches(task.collate, task.preprocess(examples), self._micro_batch()), depth=16)
        limit = trio.Event()  # some stage reached the run's step limit: no new micro-batches
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._show_forever, console)
                nursery.start_soon(self.reporter.send_forever)
                shutdown.ready()
                nursery.start_soon(self._watch_limit, limit)
                self.headline = "training" if self.trainers else "serving"
                async with trio.open_nursery() as serving:
                    if self.serves:
                        serving.start_soon(self._serve, task, limit, shutdown.requested)
                    async with trio.open_nursery() as trainers:
                        for index in range(self.trainers):
                            client = SwarmClient(self.node, self.stages, on_carried=self._book_carried)
                            self.clients.append(client)
                            trainers.start_soon(self._train, index, client, prefetch)
                        await _first(shutdown.requested, limit)
                        self._enough.set()
                        stopping = shutdown.requested.is_set()
                        self.headline = "stopping" if stopping else "run finished: the last steps"
                        # the micro-batches in flight finish (the stages still short take their last step)
                        trainers.cancel_scope.deadline = trio.current_time() + (
                            STOP_GRACE if stopping else FINISH_GRACE
                        )
                    if self.serves and not stopping:
                        serving.cancel_scope.deadline = trio.current_time() + FINISH_GRACE
                    # stopping: serve_swarm hands our stage over (member.hand_over) and returns
                self._current()
                if self.collab is not None and self.collab.peer.phase is not Phase.LEFT:
                    await self.collab.leave()  # the stage's round stops waiting for us
                reason = "stopped" if shutdown.requested.is_set() else "run finished: the step limit"
                self.headline = reason
                console.print(f"{reason}; stage steps {self._steps_text()}", highlight=False)
                await self._report_and_leave()
                nursery.cancel_scope.cancel()
        finally:
            prefetch.close()

    def _micro_batch(self) -> int:
        return min(self.options.micro_batch or self.spec.local_batch, self.spec.target_batch)

    # ------------------------------------------------------------------------------------------ roles

    async def _serve(self, task: Task, limit: trio.Event, leave: trio.Event) -> None:
        """The server's part: returns when the stage we serve reached the step limit (setting ``limit``),
        or once we handed it over after ``leave``."""
        await serve_swarm(
            self.node,
            task,
            self.spec,
            self.options.run_id,
            self.stages,
            period=self.spec.sync.rebalance_period,
            member=self.member,
            data_dir=self.data_dir,
            backbones=self.initial_peers,
            device=self.device,
            on_step=self._on_stage_step,
            leave=leave,
            formation=FormationConfig(window=window) if (window := self.spec.sync.formation_window) else None,
            replacement=ReplacementConfig() if self.spec.sync.formation_window else None,
            receipts=self.reporter.book,
            on_discard=self.reporter.discard_stage,
            previous_life=self.reporter.stage_last_step,
        )
        if not leave.is_set():
            limit.set()

    async def _train(self, index: int, client: SwarmClient, prefetch: Prefetcher[Any]) -> None:
        """One trainer loop: micro-batches through the pipeline until we stop or the run's step limit
        (module docstring: a micro-batch that found a stage without a server is carried again, not
        dropped; the one in flight when we stop is finished, within the grace)."""
        starved_since: float | None = None
        while not self._enough.is_set():
            batch = await trio.to_thread.run_sync(lambda: prefetch.get(timeout=0.5))
            if batch is None:  # the data stream is late (a shard downloading): said, not silent
                now = trio.current_time()
                starved_since = now if starved_since is None else starved_since
                if now - starved_since >= STARVED_WARNING:
                    logger.warning("trainer %d: no training data for %.0f s", index, now - starved_since)
                    self.headline = "waiting for training data"
                    starved_since = now
                continue
            starved_since = None
            while True:
                try:
                    await client.process(batch)
                    self._carried(batch)
                    break
                except NoStageServer as exc:
                    if self._enough.is_set():
                        return
                    self.headline = f"waiting: {exc}"
                    logger.info("trainer %d: %s; trying the micro-batch again", index, exc)
                    await trio.sleep(RETRY)
            if not self._enough.is_set():
                self.headline = "training"

    async def _watch_limit(self, limit: trio.Event) -> None:
        """Set ``limit`` once the stages' records show the run's step limit (:func:`limit_reached`;
        without a limit: never)."""
        if not self.spec.max_steps:
            return
        announced: dict[int, list[int]] = {}  # per stage, its servers' steps at the last read
        while not limit.is_set():
            with self.node.tolerated.around("swarm stage records read"):
                for k in range(self.stages):
                    found = await find_stage_servers(self.node.dht, k, self.stages)
                    if found:  # a stage whose servers finished and left keeps its last reading
                        announced[k] = [entry.record.step for entry in found.values()]
                        self.stage_steps[k] = max(self.stage_steps.get(k, 0), min(announced[k]))
            if limit_reached(announced, self.stages, self.spec.max_steps):
                limit.set()
            await trio.sleep(LIMIT_CHECK)

    # ------------------------------------------------------------------------------------- reporting

    def _server_stats(self) -> Any:
        """The statistics of the stage server we serve now (None: none)."""
        service = self.member.service
        return None if service is None else service.server.stats

    def _book_carried(self, stage: int, step: int, server: str, receipt: SignedReceipt) -> None:
        """A server's receipt for one of our trainers' backwards: into the reporter's book."""
        self.reporter.book.add(step, [(server, receipt)], stage=stage)

    def _carried(self, batch: Mapping[str, Any]) -> None:
        """Claim a micro-batch our trainer carried through every stage (module docstring, "Credit")."""
        samples = micro_batch_samples(batch)
        if samples > 0:
            step = max(self.stage_steps.values(), default=0)
            self.reporter.record(CarriedBatch(step, samples * self.stages, time.time()))

    def _on_stage_step(self, record: StepRecord) -> None:
        stage = self.member.stage
        # our stage-samples of this stage step (module docstring, "Credit"), as that stage's
        self.reporter.record(record, stage=stage)
        if stage is not None:
            self.stage_steps[stage] = max(self.stage_steps.get(stage, 0), record.step)
        line = {
            "step": record.step,
            "stage": stage,
            "fingerprint": record.fingerprint.hex(),
            "loss": record.loss,
            "samples": record.samples,
            "batch": record.batch,
            "target": record.target,
            "peers": record.peers,
            "averaging_s": round(record.seconds, 4),
            "moves": len(self.member.moves),
            "time": record.finished_at,
        }
        with (self.data_dir / "steps.jsonl").open("a") as out:
            out.write(json.dumps(line) + "\n")
        self.steps_taken += 1

    def _steps_text(self) -> str:
        return ", ".join(f"{k}: {self.stage_steps.get(k, 0)}" for k in range(self.stages))

    def view(self) -> PanelView:
        """The swarm panel: the stage we serve and its queue, and where our trainers' micro-batches go."""
        node = self.node.status()
        rows = [Row("run", node.run_id, 2), Row("peer id", node.peer_id, 3)]
        service = self.member.service
        if service is not None and self.member.stage is not None:
            stats = service.server.stats
            collab = service.collab
            record = service.server.record()
            rows += [
                Row("stage", f"{self.member.stage} of {self.stages} · step {collab.trainer.step}"),
                Row(
                    "serving",
                    f"{stats.forwards} forwards · {stats.backwards} backwards · {stats.samples} samples · "
                    f"queue {record.queued} · {stats.busy} busy",
                    1,
                ),
                Row("moves", " ".join(f"{a}→{b}" for a, b in self.member.moves) or "none", 2),
            ]
        elif self.serves:
            rows.append(Row("stage", "choosing a stage"))
        if self.clients:
            samples = sum(c.stats.samples for c in self.clients)
            failures = sum(c.stats.failures + c.stats.refused_answers for c in self.clients)
            receipts = sum(c.stats.receipts for c in self.clients)
            rows.append(
                Row(
                    "trainers",
                    f"{len(self.clients)} · {samples} samples · {failures} failed requests · "
                    f"{receipts} receipts",
                )
            )
            for k in range(self.stages):
                routed: dict[str, int] = {}
                for client in self.clients:
                    for server, count in client.stats.routed.get(k, {}).items():
                        routed[server] = routed.get(server, 0) + count
                text = " · ".join(f"{s[-6:]} {n}" for s, n in sorted(routed.items())) or "—"
                rows.append(Row(f"stage {k} via", text, 1))
        rows.append(Row("stage steps", self._steps_text(), 1))
        rows.append(Row("traffic", f"↑ {node.bytes_sent} B  ↓ {node.bytes_received} B", 3))
        summary = self.summary()
        return PanelView(f"[bold]volunteer[/] · swarm · {self.headline}", rows, summary)

    def summary(self) -> str:
        """The panel's facts as one log line (the stage we serve and why it waits, what trainers see)."""
        parts = []
        service = self.member.service
        if service is not None and self.member.stage is not None:
            stats, collab = service.server.stats, service.collab
            parts.append(
                f"serving stage {self.member.stage} at step {collab.trainer.step} "
                f"({collab.trainer.samples}/{collab.target} samples, {stats.backwards} backwards, "
                f"{stats.busy} busy answers"
                + (f"; {collab.stats.waiting}" if collab.stats.waiting else "")
                + ")"
            )
        elif self.serves:
            parts.append("choosing a stage")
        if self.clients:
            samples = sum(c.stats.samples for c in self.clients)
            busy = sum(c.stats.busy for c in self.clients)
            failures = sum(c.stats.failures + c.stats.refused_answers for c in self.clients)
            last = next((c.stats.last_failure for c in self.clients if c.stats.last_failure), None)
            parts.append(
                f"trainers sent {samples} samples ({busy} busy answers, {failures} failed requests"
                + (f"; last: {last}" if last else "")
                + ")"
            )
        parts.append(f"stage steps {self._steps_text()}")
        return ", ".join(parts)

    def _current(self) -> None:
        service = self.member.service
        self.collab = None if service is None else service.collab

    def status(self) -> dict[str, Any]:
        """What ``swarm.json`` in the data dir holds (rewritten every refresh): the stage we serve, its
        step, the formation we placed ourselves in (if any), our moves, what our trainers sent, the
        stages' steps as we know them."""
        service = self.member.service
        formation = self.member.formation
        return {
            "stage": self.member.stage,
            # the run's formation, if we took part (module .formation): how many servers, how placed
            "formation": None
            if formation is None
            else {
                "servers": len(formation.joined),
                "scheduled": len(formation.placement.scheduled),
                "by_scheduler": str(self.node.peer_id) in formation.placement.scheduled,
            },
            "stages": self.stages,
            "step": None if service is None else service.collab.trainer.step,
            "served_samples": None if service is None else service.server.stats.samples,
            "moves": [list(move) for move in self.member.moves],
            "trainer_samples": sum(c.stats.samples for c in self.clients),
            # servers' receipts of our trainers' backwards: checked and booked, refused (module docstring)
            "trainer_receipts": sum(c.stats.receipts for c in self.clients),
            "trainer_bad_receipts": sum(
                c.stats.bad_receipts + c.stats.missing_receipts for c in self.clients
            ),
            "stage_steps": {str(k): v for k, v in sorted(self.stage_steps.items())},
            "doing": self.headline,
            "time": time.time(),
        }

    async def _write_status(self) -> None:
        facts = json.dumps(self.status())  # here: the trio thread owns what it reads

        def write() -> None:
            self.node.write_status(self.data_dir)
            path = self.data_dir / "swarm.json"
            temporary = path.with_suffix(".tmp")
            temporary.write_text(facts)
            temporary.replace(path)  # readers never see half a file

        await trio.to_thread.run_sync(write)

    async def _show_forever(self, console: Console) -> None:
        if self.options.panel:
            with LivePanel(console, self.view) as panel:
                while True:
                    self._current()
                    await self._write_status()
                    panel.refresh()
                    await trio.sleep(REFRESH)
        last = -math.inf
        while True:
            self._current()
            await self._write_status()
            if trio.current_time() - last >= self.options.log_period:
                logger.info("%s: %s", self.headline, self.summary())
                last = trio.current_time()
            await trio.sleep(REFRESH)


def limit_reached(announced: Mapping[int, Sequence[int]], stages: int, max_steps: int) -> bool:
    """Whether the stages' records show the run's step limit: some stage is at ``max_steps`` and every
    stage at most one step short. ``announced`` holds, per stage, the steps its servers announce; a
    stage's step is the *lowest* of them: a record is its server's own claim (DESIGN D10c), so a stranger
    announcing a huge step can neither raise its stage's step nor end the run while stages train on."""
    if max_steps <= 0 or any(not announced.get(k) for k in range(stages)):
        return False
    steps = [min(announced[k]) for k in range(stages)]
    return max(steps) >= max_steps and min(steps) >= max_steps - 1


async def _first(*events: trio.Event) -> None:
    """Return when any of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:

            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wait)
