"""One volunteer's training session: build the task, stream data, measure, train, report, leave.

Order of events (each shown on the panel, or logged without one):

1. the task's model is built (deterministic from the manifest's seed, so every peer starts equal);
2. the data stream opens (shards in this peer's own random order through the shuffle buffer; the first
   micro-batches arrive while the rest stream in); on a CUDA device the micro-batch is first fitted to its
   memory (:mod:`volunteer.fitting`) unless ``--micro-batch`` sets it;
3. **warm-up**: a few micro-batches measure samples/s on the run's real model (their gradients are dropped);
   then bandwidth and reachability are measured against a backbone and the capabilities are published to
   the DHT (the LP's inputs) and to the ledger (the plausibility checks' reference); they are measured
   again when the training throughput drifts. Our progress record is published from the warm-up's start
   (fresh, no samples: :meth:`~volunteer.collab.optimizer.CollaborativeOptimizer.progress`), so the
   others know we are in the run: a volunteer that saw nobody steps alone (:mod:`shared.alone`), and one
   that finished its warm-up first stepped alone twice beside us while we measured (seen in the demo
   under load: the two then disagreed on the run's step and formed no group for the rest of it);
4. the training loop (:func:`volunteer.training.train_until_stopped`) until Ctrl+C / SIGTERM or the run's
   step limit;
5. the contribution reports still queued are sent (bounded wait), and ``steps.jsonl`` in the data dir
   holds one line per step taken (step, parameter fingerprint, loss, samples) for monitors and tests.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import trio
from rich.console import Console

from protocols.auth import SignedToken
from protocols.training import TrainingSpec
from shared.auth.guard import RunAuthenticator
from shared.auth.keys import Identity
from shared.errors import ConfigError, ProjectError
from shared.lifecycle import Shutdown
from shared.net.addresses import parse_multiaddr
from shared.net.host import CALL_FAILURES
from shared.net.relaytraffic import relayed_since
from shared.node import Node
from shared.panel import LivePanel, PanelView

from .admission import Admission
from .api_client import ApiClient
from .capabilities import (
    DriftTracker,
    MeasuredCapabilities,
    choose_device,
    choose_precision,
    device_description,
    measure_capabilities,
    measure_samples_per_second,
    publish_capabilities,
    with_reachability,
)
from .collab.diloco_trainer import make_trainer
from .collab.optimizer import CollabConfig, CollaborativeOptimizer, StepRecord
from .collab.torch_thread import run_torch
from .collab.trainer import LocalTrainer
from .data import BackboneShards, Prefetcher, open_examples
from .evaluation import Evaluator, heldout_files, load_heldout
from .fitting import fit_micro_batch
from .panel import training_line, training_status, training_view
from .precision import Precision
from .receipts import ReceiptBook
from .run_tokenizer import obtain_tokenizer
from .tasks import make_task
from .tasks.base import Task
from .training import Reporter, batches, train_until_stopped

__all__ = ["TrainingSession"]

logger = logging.getLogger("volunteer")
WARMUP_STEPS = 2
WARMUP_SECONDS = 2.0
REPORT_FLUSH_DEADLINE = 2.5  # unsent reports stay in the journal and go out at the next start
REFRESH = 0.5
DRIFT_CHECK = 3.0


class TrainingSession:
    def __init__(
        self,
        node: Node,
        identity: Identity,
        admission: Admission,
        spec: TrainingSpec,
        options: Any,  # VolunteerOptions (not imported: the daemon imports this module)
        initial_peers: list[str],
    ) -> None:
        self.node = node
        self.identity = identity
        self.spec = spec
        self.options = options
        self.data_dir: Path = options.data_dir
        self.initial_peers = initial_peers
        credential = admission.credential
        auth = admission.authenticator

        def current_token() -> SignedToken | None:  # refreshed by volunteer.admission.keep_admitted
            if isinstance(auth, RunAuthenticator):
                return auth.token
            return credential.token if credential is not None else None

        self.client = (
            ApiClient(options.run_id, credential.manifest.api, identity=identity, token=current_token)
            if credential is not None
            else None
        )
        # relayed_through: what we received through relays (evidence of their work, issue 14); with --relay
        # (volunteer.daemon, node.relay) our relay service's claim is reporter.relayed
        self.reporter = Reporter(
            options.run_id,
            identity,
            self.client,
            self.data_dir,
            relay_traffic=node.host.relay_traffic.take,
            relayed=None if node.relay is None else relayed_since(node.relay),
        )
        self.headline = "starting"
        self._drift = DriftTracker()
        self._caps: MeasuredCapabilities | None = None
        self.device = "cpu"  # the torch device training runs on, set by run()
        self.precision: Precision = "fp32"  # what it computes in (volunteer.precision), set by run()
        self.evaluator: Evaluator | None = None  # with --evaluate (volunteer.evaluation), set by run()
        self.steps_taken = 0  # lines this session wrote to steps.jsonl (volunteer.metrics)

    async def run(self, shutdown: Shutdown, console: Console) -> None:
        """Steps 1 to 5 of the module docstring. Raises ConfigError for an unusable spec (unknown task…)."""
        task = await self._build_task()
        if self.spec.sync.mode == "diloco" and self.precision == "fp16" and self.options.precision == "auto":
            self.precision = "fp32"  # no bf16 on this GPU; fp16 inner steps need a loss scale of their own
        trainer = await run_torch(
            make_trainer, task, self.spec, self.options.run_id, self.device, self.precision
        )
        sync = self.spec.sync
        if sync.mode == "diloco":
            logger.info(
                "sync mode diloco: inner steps of %d samples at our pace; the collaboration averages "
                "pseudo-gradients (%s) every %d samples, then an outer step (Nesterov, lr %g, momentum %g)",
                self.spec.local_batch,
                self.spec.codec if self.spec.codec != "none" else "uncompressed",
                self.spec.target_batch,
                sync.outer_lr,
                sync.outer_momentum,
            )
        seed = zlib.crc32(self.node.peer_id.encode())
        shards = BackboneShards(self.client) if self.client is not None else None
        examples = open_examples(
            self.spec.dataset, seed=seed, shards=shards, cache_dir=self.data_dir / "shards"
        )
        samples = task.preprocess(examples)  # tokenizing and packing: in the prefetch thread
        samples = await self._fit_micro_batch(trainer, samples)
        prefetch = Prefetcher(batches(task.collate, samples, trainer.micro_batch), depth=16)
        try:
            collab = CollaborativeOptimizer(
                self.node,
                trainer,
                self.spec,
                data_dir=self.data_dir,
                config=CollabConfig(),
                on_step=self._on_step,
                backbones=self.initial_peers,
                on_discard=self.reporter.discard,
                previous_life=self.reporter.last_step or None,
                previous_lineage=self.reporter.lineage,  # its steps taken again differently: discarded
                **_receipts_argument(self.reporter.book),
            )
            self.collab = collab
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._show_forever, console)
                # the session opens at join (its first heartbeat), not after the warm-up
                nursery.start_soon(self.reporter.send_forever)
                shutdown.ready()
                # our progress record goes out before the warm-up: a volunteer measuring its machine is
                # in the run, and a peer that saw nobody would step alone meanwhile (module docstring, 3)
                await nursery.start(collab.run)
                with trio.CancelScope() as warmup:
                    nursery.start_soon(_cancel_when, shutdown.requested, warmup)
                    await self._measure(collab, prefetch)
                if shutdown.requested.is_set():
                    await collab.leave()
                    await self._report_and_leave()
                    nursery.cancel_scope.cancel()
                    return
                nursery.start_soon(self._remeasure_on_drift, collab)
                if getattr(self.options, "evaluate", False):
                    self._start_evaluating(nursery, task, trainer)
                self.headline = "training"
                reason = await train_until_stopped(
                    collab,
                    lambda: prefetch.get(timeout=0.5),
                    shutdown.requested,
                    ready_batch=lambda: prefetch.get(timeout=0),
                )
                self.headline = reason
                console.print(f"{reason}; at step {trainer.step}", highlight=False)
                await collab.leave()
                await self._report_and_leave()
                nursery.cancel_scope.cancel()
        finally:
            prefetch.close()

    async def _build_task(self) -> Task:
        """Step 1: the run's task (its tokenizer obtained), the device and the precision set."""
        if self.options.threads:
            import torch

            torch.set_num_threads(self.options.threads)
        if self.spec.tokenizer.kind != "none":
            self.headline = "getting the run's tokenizer"
        tokenizer = await obtain_tokenizer(self.spec.tokenizer, self.client, self.data_dir)
        self.headline = f"building the run's model ({self.spec.task})"
        task = await trio.to_thread.run_sync(make_task, self.spec, tokenizer)  # imports transformers: seconds
        device = choose_device(self.options.device)  # the CLI resolved it already; others may pass "auto"
        self.device = device
        self.precision = choose_precision(self.options.precision, device)
        fraction = getattr(self.options, "gpu_memory_fraction", None)
        if fraction is not None and device.startswith("cuda"):
            import torch

            torch.cuda.set_per_process_memory_fraction(fraction, torch.device(device))
            logger.info("using at most %.0f%% of %s's memory", 100 * fraction, device)
        return task

    async def _fit_micro_batch(self, trainer: LocalTrainer, examples: Iterator[Any]) -> Iterator[Any]:
        """Set ``trainer.micro_batch``: ``--micro-batch`` (at most the target batch), else on CUDA the
        largest that fits (:mod:`volunteer.fitting`), else the spec's. Returns the examples, the ones the
        fitting looked at first.

        Raises:
            ConfigError: not even one sample of the run's model fits the device.
        """
        wanted = self.options.micro_batch
        if wanted:
            trainer.micro_batch = min(wanted, self.spec.target_batch)
            if wanted > self.spec.target_batch:
                logger.warning(
                    "--micro-batch %d is above the run's target batch: using %d", wanted, trainer.micro_batch
                )
            return examples
        if not self.device.startswith("cuda"):
            return examples
        self.headline = "fitting the micro-batch to the GPU's memory"

        def first() -> list[Any]:
            return list(itertools.islice(examples, self.spec.local_batch))

        taken = await trio.to_thread.run_sync(first, abandon_on_cancel=True)
        if not taken:
            raise ProjectError("the example stream ended before training began")
        sample = trainer.task.collate(taken)
        fraction = getattr(self.options, "gpu_memory_fraction", None) or 1.0
        size = await run_torch(
            lambda: fit_micro_batch(
                trainer, sample, self.spec.target_batch, dpu=self.spec.dpu, memory_fraction=fraction
            )
        )
        if size == 0:
            raise ConfigError(
                f"the run's model does not fit {self.device}'s free memory even one sample at a time; "
                "use --device cpu or a larger GPU"
            )
        trainer.micro_batch = size
        return itertools.chain(taken, examples)

    def _start_evaluating(self, nursery: trio.Nursery, task: Any, trainer: LocalTrainer) -> None:
        """``--evaluate``: the held-out loss of every N-th step's parameters (volunteer.evaluation)."""
        client = self.client
        every = getattr(self.options, "evaluate_every", None) or self.spec.dataset.eval_every
        evaluator = Evaluator(
            task,
            trainer,
            self.options.run_id,
            self.identity,
            every,
            publish=client.evaluation if client is not None else None,
        )

        async def load() -> Any:
            files = await heldout_files(self.spec.dataset, client, self.data_dir / "heldout")
            return await load_heldout(task, self.spec, files)

        self.evaluator = evaluator
        nursery.start_soon(evaluator.run, load)

    async def _report_and_leave(self) -> None:
        """Report every open step and close our ledger session (best effort, bounded)."""
        self.reporter.close_all()
        with trio.move_on_after(REPORT_FLUSH_DEADLINE):
            await self.reporter.flush()
        if self.reporter.pending:
            logger.warning("%d contribution reports could not be sent", self.reporter.pending)

    async def _measure(self, collab: CollaborativeOptimizer, prefetch: Prefetcher[dict[str, Any]]) -> None:
        trainer = collab.trainer
        self.headline = "warming up: measuring samples/s on the run's model"

        def step() -> int:
            batch = prefetch.get(timeout=60.0)
            if batch is None:
                raise ProjectError("no training data arrived within 60 s")
            return trainer.accumulate(batch)[0]

        sps = await run_torch(
            lambda: measure_samples_per_second(step, warmup_steps=WARMUP_STEPS, seconds=WARMUP_SECONDS)
        )
        await run_torch(trainer.discard_gradients)
        collab.samples_per_second = sps
        self.headline = "measuring bandwidth against a backbone"
        # client mode unless a backbone dialed us back or a relay holds a slot for us (a failed check is
        # not a pass): the round tickets follow what the host advertises (volunteer.collab.step)
        reach = self.node.reachability
        backbone = parse_multiaddr(reach.checked_with) if reach is not None and reach.checked_with else None
        if backbone is None and self.initial_peers:
            backbone = parse_multiaddr(self.initial_peers[0])
        caps = None
        if backbone is not None and backbone.peer_id is not None:
            try:
                caps = await measure_capabilities(
                    self.node.host,
                    backbone,
                    sps,
                    device=self.device,
                    precision=self.precision,
                    reachable=() if reach is None else reach.reachable,
                )
            except (ProjectError, OSError, *CALL_FAILURES) as exc:
                logger.warning("bandwidth could not be measured against %s: %s", backbone, exc)
        if caps is not None and reach is not None:
            caps = dataclasses.replace(caps, observed=reach.observed, connectivity=reach.mode)
        if caps is not None:  # measure_bandwidth states at most --max-upload/--max-download
            collab.measured_bandwidth(
                max(caps.capabilities.upload_bps, 1.0), max(caps.capabilities.download_bps, 1.0)
            )
            await self._publish(caps)
        elif (throttle := self.node.host.endpoint.throttle) is not None:  # unmeasured: at most the caps
            collab.measured_bandwidth(*throttle.cap(collab.batch.upload_bps, collab.batch.download_bps))
        logger.info(
            "measured %.0f samples/s on %s in %s, micro-batch %d%s",
            sps,
            device_description(self.device),
            self.precision,
            trainer.micro_batch,
            ""
            if caps is None
            else f", ↑ {caps.capabilities.upload_bps / 1e6:.0f} MB/s ↓ "
            f"{caps.capabilities.download_bps / 1e6:.0f} MB/s",
        )
        self._drift.update(sps)
        self._caps = caps

    async def _publish(self, caps: MeasuredCapabilities) -> None:
        try:
            await publish_capabilities(self.node.dht, caps, self.client)
        except (ProjectError, *CALL_FAILURES) as exc:
            logger.warning("capabilities not published: %s", exc)

    async def _remeasure_on_drift(self, collab: CollaborativeOptimizer) -> None:
        """Training throughput drifted from what we published (thermal throttling, another job): publish
        the new numbers, so the LP and the ledger's checks use what this machine really does now. The same
        when how peers reach us changed (a relay slot gained or lost)."""
        while True:
            await trio.sleep(DRIFT_CHECK)
            reach = self.node.reachability
            moved = (
                None
                if self._caps is None or reach is None
                else with_reachability(self._caps, reach, time.time())
            )
            if moved is not None:
                logger.info("reachability changed to %s: publishing it", moved.connectivity)
                self._caps = moved
                await self._publish(moved)
            sps = collab.stats.local_sps
            if sps > 0 and self._drift.update(sps):
                logger.info("throughput drifted to %.0f samples/s: publishing it", sps)
                collab.samples_per_second = sps
                if self._caps is not None:
                    caps = dataclasses.replace(
                        self._caps,
                        capabilities=msgspec.structs.replace(self._caps.capabilities, samples_per_second=sps),
                        measured_at=time.time(),
                    )
                    self._caps = caps
                    await self._publish(caps)

    def _on_step(self, record: StepRecord) -> None:
        self.reporter.record(record, fingerprint=record.fingerprint)
        if self.evaluator is not None:
            self.evaluator.step_done(record.step)
        line = {
            "step": record.step,
            "fingerprint": record.fingerprint.hex(),
            "loss": record.loss,
            "samples": record.samples,  # ours
            "batch": record.batch,  # the step's global batch (every member's samples)
            "target": record.target,  # what it aimed at: the target batch, or the planned round (diloco)
            "peers": record.peers,
            "skipped": record.skipped,  # a collective loss-scale overflow: parameters unchanged
            "averaging_s": round(record.seconds, 4),
            "time": record.finished_at,
        }
        with (self.data_dir / "steps.jsonl").open("a") as out:
            out.write(json.dumps(line) + "\n")
        self.steps_taken += 1

    async def _show_forever(self, console: Console) -> None:
        def view() -> PanelView:
            node = self.node.status()
            reports = self.reporter
            status = training_status(
                self.collab, reports.sent, reports.pending, network=node.reachability, links=node.links
            )
            return training_view(node, status, self.headline)

        if self.options.panel:
            with LivePanel(console, view) as panel:
                while True:
                    await trio.to_thread.run_sync(self.node.write_status, self.data_dir)
                    panel.refresh()
                    await trio.sleep(REFRESH)
        last = -self.options.log_period
        while True:
            await trio.to_thread.run_sync(self.node.write_status, self.data_dir)
            if trio.current_time() - last >= self.options.log_period:
                node = self.node.status()
                status = training_status(self.collab, network=node.reachability, links=node.links)
                logger.info("%s: %s", self.headline, training_line(status))
                last = trio.current_time()
            await trio.sleep(REFRESH)


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _receipts_argument(book: ReceiptBook) -> dict[str, Any]:
    """``receipts=book`` for the optimizer, which fills the book after each round (branch fix/avg adds
    that argument; until it has it, reports carry no receipts and the ledger credits nothing)."""
    accepts = "receipts" in {f.name for f in dataclasses.fields(CollaborativeOptimizer)}
    if not accepts:
        logger.debug("this CollaborativeOptimizer takes no receipts: reports carry none")
    return {"receipts": book} if accepts else {}
