"""A volunteer's place in a swarm run: which stage it serves, and moving when another stage needs it more
(issue 17 item 4; seed 004 §3.2 and App. D; the rule is :mod:`shared.swarm.rebalance`).

:func:`serve_swarm` runs one server for as long as the node lives:

1. **Placement.** It reads every stage's records (:func:`~shared.swarm.directory.find_stage_servers`)
   and serves the stage :func:`~shared.swarm.rebalance.place_newcomer` names: an empty stage first, then
   the one with the least capacity, a server yet to measure counted as a typical one (§3.2: newcomers
   join "the optimal pipeline stage"). With a ``formation`` configured and no stage record of another
   server yet, the run is forming: it measures links with the other forming servers and serves the
   stage the scheduler gives it (:mod:`.formation`; seed 002 §3).
2. **Serving** that stage with :func:`~.stage_service.serve_stage` (which downloads the stage's state when
   the stage is ahead of us, or a backbone announces a stored state of it beyond ours, as any newcomer
   of a collaboration does).
3. **Rebalancing.** Every ``period`` seconds (App. D's ``T``) it reads the records again, turns each into
   a :class:`~shared.swarm.rebalance.ServerReport` (rate: the samples per second of busy time the server
   publishes, bounded by :func:`~shared.swarm.rebalance.bound_rates` against a stranger's inflated claim;
   queue: its admitted requests) and runs :func:`~shared.swarm.rebalance.plan_rebalance`.
   Every server reads the same records and runs the same pure rule, so they agree on who moves without a
   coordinator (records read at slightly different moments can disagree; the hysteresis margin and one
   move per period keep that from moving two peers for one gap, and the next period corrects a surplus).
   If the plan moves *us*, we leave our stage (its collaboration learns at once that we left) and serve
   the target stage from step 2. Only the peer a plan names acts on it, so a move depends on that peer's
   own reads: each period's outcome (:data:`PERIOD_OUTCOMES`: a failed read, our record not listed yet,
   the plan's verdict) is counted in :attr:`SwarmMember.periods` and the last plan kept in
   :attr:`SwarmMember.plan`, so that a run whose servers never move shows why (``scripts/bench_swarm.py``
   reports them).
4. **Re-placement** (``replacement`` set; the session sets it when the run is placed by the scheduler at
   formation). When the rebalancer's plan would move *many* servers at once, the scheduler re-places the
   run's servers instead (:mod:`shared.swarm.replacement`: when, which placement, and why every server
   computes the same one): each period's verdict comes from :func:`~shared.swarm.replacement.gate`; on
   ``replace`` we read the link records (:func:`~.formation.read_link_records`: every server of such a run,
   newcomers included, keeps its record re-measured and alive while it serves, :func:`~.formation.keep_links`;
   pairs without one are filled as at formation) and the capability
   records, compute :func:`~shared.swarm.replacement.replacement` in a worker thread, and move if it names
   another stage for us, exactly as a rebalancing move (the new stage's state is downloaded from the
   server that kept it, verified). With re-placement on, periods are aligned to the wall clock (every
   server reads right after each multiple of ``period``), so that servers read nearly the same records,
   and a leaving last server (below) waits ``settle + period`` longer for a server to take its stage:
   after a departure the rebalancer's refill waits for the basis to stand.

**What a move costs.** The samples we had accumulated toward our old stage's next step go with us (the
stage's other servers count on without them: the step waits for more samples from trainers instead);
the new stage's state is downloaded and verified like any state. A stage whose last server died has no
server left to download from: its backbones do. A backbone keeps each stage's recent checkpoints and
announces the newest under the stage's state key (:mod:`backbone.checkpointer`, "Swarm runs"), so the
peer that refills the stage finds it as any newcomer finds a run's state when nobody trains
(:meth:`~volunteer.collab.sync.StateSync.resume_if_behind`, then
:meth:`~volunteer.collab.sync.StateSync.sync_state`: verified, and refused if it is not this stage's),
and the stage continues from the checkpoint's step. What is lost is what the backbone had not stored yet:
the steps since the stage's last announced state (servers announce every ``checkpoint_every`` steps) and
the samples accumulated toward the next step. When the dead server's progress record still shows a later
step than the checkpoint's, the refill first waits for that step's state (the high-water mark,
:mod:`shared.alone`) and takes the newest there is once the mark expires: seconds to minutes, not steps.
Only a run without a backbone (or whose backbone stored nothing of the stage) refills a dead stage from
the run's initial parameters at step 0.

**Leaving** (``leave`` set: Ctrl+C or SIGTERM) must not lose a stage's state the way a death does.
:func:`hand_over` closes our server (trainers' requests fail over to the stage's other servers at once) and
stops renewing our stage record, while the stage's collaboration keeps running: our progress record and state
stay available. If another server of the stage is at our step and we saw it take our state (it was a member of
the round that produced our step, or our state server sent it every byte of our state of that step,
:meth:`~shared.state.transfer.StateServer.copies`), we leave at once. A record's step alone is a claim, not
evidence: a stranger's record at our step or beyond, without our state, would otherwise send the stage's only
copy away with us. If we were its last server, our record expires within
:data:`~protocols.swarm.STAGE_RECORD_TTL`, the stage shows no server, and at the next rebalancing period a
server of another stage moves in (refilling an empty stage is the rule's first move), finds the stage's step
ahead of its own and downloads our state, verified like any; once its record shows our step, we leave. A
leaver waits at most ``max(HAND_OVER_MIN, TTL + 3 periods)`` (plus ``settle + period`` with re-placement on,
4), and not at all once no other stage has two servers to spare (nobody could take it: every server of the run
is leaving, say); after that its state leaves with it, as a dead server's does. A stage still at step 0 is
left at once (its state is the run's initial one). The samples it had accumulated toward the stage's next step
are lost in either case.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from protocols.swarm import STAGE_RECORD_TTL
from protocols.training import TrainingSpec
from shared.node import Node
from shared.swarm.directory import StageServerEntry, find_stage_servers
from shared.swarm.links import bandwidths, round_trips
from shared.swarm.placement_cost import Workload
from shared.swarm.rebalance import (
    DEFAULT_HYSTERESIS,
    RebalancePlan,
    ServerReport,
    bound_rates,
    place_newcomer,
    plan_rebalance,
)
from shared.swarm.replacement import GateState, Replacement, ReplacementConfig, Verdict, gate, replacement

from ..collab.optimizer import CollabConfig, CollaborativeOptimizer, StepRecord
from ..receipts import ReceiptBook
from ..tasks.base import Task
from .formation import (
    FormationConfig,
    FormationOutcome,
    estimate_workload,
    form,
    keep_links,
    read_capacities,
    read_link_records,
)
from .server import StageServerConfig
from .stage_service import StageService, serve_stage

__all__ = ["PERIOD_OUTCOMES", "SwarmMember", "hand_over", "read_reports", "serve_swarm"]

logger = logging.getLogger(__name__)
HAND_OVER_MIN = 30.0  # seconds a leaving server waits at least for another to take its stage
HAND_OVER_POLL = 0.5
#: what a rebalancing period of :func:`serve_swarm` can end in (:attr:`SwarmMember.periods` counts them):
#: the records could not be read, or did not list us yet; with re-placement on, its gate said wait, or the
#: scheduler re-placed the run; else the plan moved us, moved another server, or nobody
PERIOD_OUTCOMES = (
    "read failed",
    "not listed",
    "re-placement wait",
    "re-placed",
    "moved",
    "another moves",
    "no move",
)


class SwarmMember:
    """Where a :func:`serve_swarm` server stands, for the panel and tests."""

    def __init__(self) -> None:
        self.stage: int | None = None
        self.service: StageService | None = None
        self.moves: list[tuple[int, int]] = []  # (from, to) of each move made
        self.formation: FormationOutcome | None = None  # the run's formation, if we took part in it
        self.gate = GateState()  # the re-placement rule's memory (module docstring, 4)
        self.replacements: list[Replacement] = []  # each re-placement we computed (moving or not)
        #: each rebalancing period's outcome (:data:`PERIOD_OUTCOMES`), for the panel and benchmarks
        self.periods: Counter[str] = Counter()
        self.plan: RebalancePlan | None = None  # the last rebalancing plan we computed


async def read_reports(
    node: Node, stages: int
) -> tuple[list[ServerReport], dict[int, dict[str, StageServerEntry]]]:
    """Every stage's servers as rebalancing reports (module docstring, 3), and the entries they came from.
    A server listed under two stages (one it moved from, whose record has not expired yet) reports at the
    stage of its newer record. Rates are bounded (:func:`~shared.swarm.rebalance.bound_rates`): a stranger's
    inflated claim counts as at most a few honest servers.

    Raises:
        whatever the DHT lookups raise (CALL_FAILURES).
    """
    entries: dict[int, dict[str, StageServerEntry]] = {}
    newest: dict[str, tuple[int, StageServerEntry]] = {}
    for k in range(stages):
        found = await find_stage_servers(node.dht, k, stages)
        entries[k] = {str(peer): entry for peer, entry in found.items()}
        for entry in found.values():
            # a server that moved still has its old stage's record until it expires: the newer one counts
            name = str(entry.peer_id)
            if name not in newest or entry.announced > newest[name][1].announced:
                newest[name] = (k, entry)
    reports = []
    for name, (k, entry) in newest.items():
        rate = entry.record.samples_per_second
        reports.append(ServerReport(name, k, rate if math.isfinite(rate) else 0.0, entry.record.queued))
    return bound_rates(reports), entries


async def serve_swarm(
    node: Node,
    task: Task,
    spec: TrainingSpec,
    run_id: str,
    stages: int,
    *,
    period: float = 30.0,
    hysteresis: float = DEFAULT_HYSTERESIS,
    member: SwarmMember | None = None,
    data_dir: Path | None = None,
    backbones: Sequence[str] = (),
    collab_config: CollabConfig | None = None,
    server_config: StageServerConfig | None = None,
    device: str = "cpu",
    on_step: Callable[[StepRecord], None] | None = None,
    leave: trio.Event | None = None,
    formation: FormationConfig | None = None,
    receipts: ReceiptBook | None = None,
    replacement: ReplacementConfig | None = None,
    on_discard: Callable[[int, int, int], None] | None = None,
    previous_life: Callable[[int], int | None] | None = None,
) -> None:
    """Serve a stage of the run, moving as rebalancing decides (module docstring), until cancelled or the
    stage we serve reached the run's step limit. ``hysteresis``: the relative throughput gain a move must
    promise (refilling an empty stage always does); ``on_step``: called after each step of the stage we
    serve (:func:`~.stage_service.serve_stage`); ``leave``: once set, we hand the stage over (module
    docstring, "Leaving") and return; ``formation``: place us by the scheduler when the run is forming
    (module docstring, 1); ``receipts``: where the receipts of every stage we serve go (the reporter's
    book, for the ledger's credit); ``replacement``: let the scheduler re-place the run's servers when
    rebalancing would move many at once (module docstring, 4); ``on_discard``: called with ``(stage, first,
    last)`` when a state of the stage we serve replaced stage steps of ours, and ``previous_life(stage)``:
    the highest step of ``stage`` our data dir took part in, read each time we start serving a stage
    (:mod:`.stage_service`, "Discards")."""
    member = member or SwarmMember()
    me = str(node.peer_id)
    reports: list[ServerReport] = []
    with node.tolerated.around("swarm placement read"):
        reports, _ = await read_reports(node, stages)
    others = [r for r in reports if r.peer != me]
    if formation is not None and not others:
        work = formation.workload
        if work is None:
            work = await trio.to_thread.run_sync(estimate_workload, task, spec, stages)
        member.formation = await form(node, run_id, stages, formation, work)
        target = member.formation.stage
    else:
        target = place_newcomer(others, stages, tiebreak=me)
    replacer = None
    if replacement is not None:
        replacer = _Replacer(node, task, spec, run_id, stages, replacement, member, hysteresis)
    started = member.formation.started if member.formation is not None else time.time()
    async with trio.open_nursery() as keeping:
        if replacer is not None:  # a re-placement reads measured links, ours included (module docstring, 4)
            keeping.start_soon(
                functools.partial(
                    keep_links, node, stages, started, formation or FormationConfig(),
                    wait_first=member.formation is not None,
                )
            )  # fmt: skip
        try:
            while True:
                member.stage = target
                logger.info("serving stage %d of %d", target, stages)
                ended = trio.Event()  # the stage reached the step limit, or rebalancing moves us
                moved_to: int | None = None

                async def serve(
                    task_status: trio.TaskStatus[StageService], stage: int = target, ended: trio.Event = ended
                ) -> None:
                    discard = None if on_discard is None else functools.partial(on_discard, stage)
                    await serve_stage(
                        node, task, spec, run_id, stage, stages,
                        data_dir=data_dir, backbones=backbones, collab_config=collab_config,
                        server_config=server_config, device=device, on_step=on_step, receipts=receipts,
                        on_discard=discard, previous_life=previous_life(stage) if previous_life else None,
                        task_status=task_status,
                    )  # fmt: skip
                    ended.set()  # the run's step limit: serve_stage returns only then

                async with trio.open_nursery() as nursery:
                    member.service = await nursery.start(serve)

                    async def watch(stage: int = target, ended: trio.Event = ended) -> None:
                        nonlocal moved_to
                        moved_to = await _watch(node, stages, stage, period, hysteresis, replacer, member)
                        ended.set()

                    nursery.start_soon(watch)
                    if leave is not None:

                        async def leaving(ended: trio.Event = ended) -> None:
                            await leave.wait()
                            ended.set()

                        nursery.start_soon(leaving)
                    await ended.wait()
                    service = member.service
                    if leave is not None and leave.is_set() and not service.collab.finished():
                        # with re-placement on, a departure makes the rebalancer wait for the basis to stand
                        settle = 0.0 if replacement is None else replacement.settle + period
                        within = max(HAND_OVER_MIN, STAGE_RECORD_TTL + 3 * period + settle)
                        await hand_over(node, service, stages, within)
                    if not service.collab.finished():
                        await service.collab.leave()  # the stage's round stops waiting for us
                    nursery.cancel_scope.cancel()
                if leave is not None and leave.is_set():
                    return
                if moved_to is None:
                    logger.info("stage %d reached the run's step limit", target)
                    return
                member.moves.append((target, moved_to))
                logger.info("rebalancing: moving from stage %d to stage %d", target, moved_to)
                target = moved_to
        finally:
            keeping.cancel_scope.cancel()


async def hand_over(node: Node, service: StageService, stages: int, within: float) -> bool:
    """Leave ``service``'s stage without losing its state (module docstring, "Leaving"); returns whether
    another server of the stage holds the state (False: ``within`` seconds passed without one)."""
    server, collab = service.server, service.collab
    stage = server.stage
    server.close()  # trainers' requests fail over at once; our record is not renewed
    me = str(node.peer_id)
    step = collab.trainer.step
    with trio.move_on_after(within):
        # a step in flight when we closed completes: its state is the one to hand over (no event marks it)
        while collab.averaging:  # noqa: ASYNC110
            await trio.sleep(HAND_OVER_POLL / 5)
        step = collab.trainer.step
        if step == 0:  # the run's initial parameters: whoever serves the stage next builds them itself
            return True
        while True:
            with node.tolerated.around("swarm hand-over read"):
                reports, entries = await read_reports(node, stages)
                holders = _holders(collab, step)
                served = [p for p, e in entries[stage].items() if p != me and e.record.step >= step]
                taker = next((p for p in served if p in holders), None)
                if taker is not None:
                    logger.info("stage %d (step %d) is served by %s now: leaving it", stage, step, taker)
                    return True
                if not _can_refill(reports, stage, me):
                    logger.warning(
                        "no other stage can spare a server to take stage %d: its state since step %d leaves "
                        "with us",
                        stage,
                        step,
                    )
                    return False
            collab.stats.waiting = f"handing stage {stage} over: waiting for a server to take it"
            await trio.sleep(HAND_OVER_POLL)
    logger.warning(
        "no other server took stage %d within %.0f s: its state since step %d leaves with us",
        stage,
        within,
        step,
    )
    return False


def _holders(collab: CollaborativeOptimizer, step: int) -> set[str]:
    """The peers we saw take our state of ``step`` (module docstring, "Leaving"): the other members of
    the round that produced it, and the peers that downloaded all of it from us."""
    with_us, others = collab.peer.stepped_with
    holders = set(others) if with_us == step else set()
    for offer in collab.sync.server.offered():
        if offer.step == step:
            holders |= collab.sync.server.copies(offer.digest)
    return holders


def _can_refill(reports: Sequence[ServerReport], stage: int, me: str) -> bool:
    """Another server serves ``stage`` already, or a stage has two to spare one (the refill rule's
    candidates: :mod:`shared.swarm.rebalance`, rule 0)."""
    counts: dict[int, int] = {}
    for report in reports:
        if report.peer != me:
            counts[report.stage] = counts.get(report.stage, 0) + 1
    return counts.get(stage, 0) > 0 or any(n >= 2 for k, n in counts.items() if k != stage)


class _Replacer:
    """Re-placement by the scheduler for one server (module docstring, 4); its memory is the member's."""

    def __init__(
        self,
        node: Node,
        task: Task,
        spec: TrainingSpec,
        run_id: str,
        stages: int,
        config: ReplacementConfig,
        member: SwarmMember,
        hysteresis: float,
    ) -> None:
        self.node, self.task, self.spec, self.run_id, self.stages = node, task, spec, run_id, stages
        self.config, self.member, self.hysteresis = config, member, hysteresis
        self.workload: Workload | None = config.workload

    def verdict(self, slot: int, period: float, reports: Sequence[ServerReport]) -> Verdict:
        verdict, self.member.gate = gate(
            self.member.gate, slot, period, reports, self.stages, self.config, hysteresis=self.hysteresis
        )
        return verdict

    async def place(self, reports: Sequence[ServerReport]) -> Replacement:
        """The scheduler's re-placement from the records. A failed read of the link or capability records
        counts as no record (the fill rule's defaults): the others move now, and so do we."""
        work = self.workload
        if work is None:
            work = await trio.to_thread.run_sync(estimate_workload, self.task, self.spec, self.stages)
            self.workload = work
        peers = sorted(r.peer for r in reports)
        measured: dict[str, dict[str, float]] = {}
        with self.node.tolerated.around("swarm re-placement link records read"):
            for peer, found in (await read_link_records(self.node, self.stages)).items():
                if peer in peers:
                    claims: dict[str, float] = {}
                    for sample in found.record.links:  # the first claim per peer counts (bounded_links)
                        claims.setdefault(sample.peer, sample.rtt)
                    measured[peer] = claims
        capacities: dict[str, tuple[float, float]] = {}
        with self.node.tolerated.around("swarm re-placement capability records read"):
            capacities = await read_capacities(self.node, set(peers))
        rtt = round_trips(peers, measured)
        bandwidth = bandwidths(peers, capacities)
        placed = await trio.to_thread.run_sync(
            lambda: replacement(
                reports, rtt, bandwidth, work, self.run_id, hysteresis=self.hysteresis,
                generations=self.config.generations,
            )
        )  # fmt: skip
        self.member.replacements.append(placed)
        logger.info(
            "re-placement by the scheduler: %d servers, %d moves (%d measured by link records)",
            len(peers), len(placed.moves), len(measured),
        )  # fmt: skip
        return placed


async def _watch(
    node: Node,
    stages: int,
    stage: int,
    period: float,
    hysteresis: float,
    replacer: _Replacer | None = None,
    member: SwarmMember | None = None,
) -> int:
    """Every ``period`` seconds (aligned to the wall clock with ``replacer``), the rebalancing plan, or the
    re-placement when it is due; returns the stage either moves us to. Each period's outcome is counted in
    ``member.periods`` (:data:`PERIOD_OUTCOMES`), its plan kept in ``member.plan``."""
    member = member or SwarmMember()
    me = str(node.peer_id)
    read: int | None = None
    while True:
        if replacer is None:
            await trio.sleep(period)
        else:  # aligned: servers that read the same records decide in the same slot
            await trio.sleep(period - time.time() % period)
        slot = round(time.time() / period)
        if slot == read:  # woken a hair before the boundary: this slot is read already
            continue
        read = slot
        outcome, target = "read failed", None  # unless the reads below complete
        with node.tolerated.around("swarm rebalancing read"):
            reports, _ = await read_reports(node, stages)
            outcome = "not listed"  # our own record is not readable yet
            if any(r.peer == me for r in reports):
                outcome, target = await _decide(
                    member, reports, me, stages, stage, slot, period, hysteresis, replacer
                )
        member.periods[outcome] += 1
        if target is not None:
            return target


async def _decide(
    member: SwarmMember,
    reports: Sequence[ServerReport],
    me: str,
    stages: int,
    stage: int,
    slot: int,
    period: float,
    hysteresis: float,
    replacer: _Replacer | None,
) -> tuple[str, int | None]:
    """One period's outcome (:data:`PERIOD_OUTCOMES`) from the reports read, and the stage it moves us to."""
    if replacer is not None:
        verdict = replacer.verdict(slot, period, reports)
        if verdict == "wait":
            return "re-placement wait", None
        if verdict == "replace":
            placed = await replacer.place(reports)
            target = placed.stages.get(me, stage)
            return "re-placed", (None if target == stage else target)
    plan = plan_rebalance(reports, stages, hysteresis=hysteresis)
    member.plan = plan
    if plan.moves:
        logger.debug("rebalancing plan from %d reports: %s", len(reports), plan)
    for move in plan.moves:
        if move.peer == me and move.source == stage:
            return "moved", move.target
    return ("another moves" if plan.moves else "no move"), None
