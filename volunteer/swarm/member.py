"""A volunteer's place in a swarm run: which stage it serves, and moving when another stage needs it more
(issue 17 item 4; seed 004 §3.2 and App. D; the rule is :mod:`shared.swarm.rebalance`).

:func:`serve_swarm` runs one server for as long as the node lives:

1. **Placement.** It reads every stage's records (:func:`~shared.swarm.directory.find_stage_servers`)
   and serves the stage :func:`~shared.swarm.rebalance.place_newcomer` names: an empty stage first, then
   the one with the least capacity (§3.2: newcomers join "the optimal pipeline stage").
2. **Serving** that stage with :func:`~.stage_service.serve_stage` (which downloads the stage's state when
   the stage is ahead of us, as any newcomer of a collaboration does).
3. **Rebalancing.** Every ``period`` seconds (App. D's ``T``) it reads the records again, turns each into
   a :class:`~shared.swarm.rebalance.ServerReport` (rate: the samples per second of busy time the server
   publishes; queue: its admitted requests) and runs :func:`~shared.swarm.rebalance.plan_rebalance`.
   Every server reads the same records and runs the same pure rule, so they agree on who moves without a
   coordinator (records read at slightly different moments can disagree; the hysteresis margin and one
   move per period keep that from moving two peers for one gap, and the next period corrects a surplus).
   If the plan moves *us*, we leave our stage (its collaboration learns at once that we left) and serve
   the target stage from step 2.

**What a move costs.** The samples we had accumulated toward our old stage's next step go with us (the
stage's other servers count on without them: the step waits for more samples from trainers instead);
the new stage's state is downloaded and verified like any state. A stage whose last server died has no
state to download: its records show no step, so the peer that refills it starts the stage from the run's
initial parameters at step 0 -- a backbone's stored checkpoints of the stage are what prevents that loss
(not built yet: backbones store the data-parallel state only).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import trio

from protocols.training import TrainingSpec
from shared.node import Node
from shared.swarm.directory import StageServerEntry, find_stage_servers
from shared.swarm.rebalance import DEFAULT_HYSTERESIS, ServerReport, place_newcomer, plan_rebalance

from ..collab.optimizer import CollabConfig
from ..tasks.base import Task
from .server import StageServerConfig
from .stage_service import StageService, serve_stage

__all__ = ["SwarmMember", "read_reports", "serve_swarm"]

logger = logging.getLogger(__name__)


class SwarmMember:
    """Where a :func:`serve_swarm` server stands, for the panel and tests."""

    def __init__(self) -> None:
        self.stage: int | None = None
        self.service: StageService | None = None
        self.moves: list[tuple[int, int]] = []  # (from, to) of each move made


async def read_reports(
    node: Node, stages: int
) -> tuple[list[ServerReport], dict[int, dict[str, StageServerEntry]]]:
    """Every stage's servers as rebalancing reports (module docstring, 3), and the entries they came from.
    A server listed under two stages (one it moved from, whose record has not expired yet) reports at the
    stage of its newer record.

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
    return reports, entries


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
) -> None:
    """Serve a stage of the run, moving as rebalancing decides (module docstring), until cancelled.
    ``hysteresis``: the relative throughput gain a move must promise (refilling an empty stage always
    does)."""
    member = member or SwarmMember()
    me = str(node.peer_id)
    reports: list[ServerReport] = []
    with node.tolerated.around("swarm placement read"):
        reports, _ = await read_reports(node, stages)
    target = place_newcomer([r for r in reports if r.peer != me], stages)
    while True:
        member.stage = target
        logger.info("serving stage %d of %d", target, stages)
        async with trio.open_nursery() as nursery:
            member.service = await nursery.start(
                functools.partial(
                    serve_stage,
                    node,
                    task,
                    spec,
                    run_id,
                    target,
                    stages,
                    data_dir=data_dir,
                    backbones=backbones,
                    collab_config=collab_config,
                    server_config=server_config,
                )
            )
            moved_to = await _watch(node, stages, target, period, hysteresis)
            await member.service.collab.leave()  # the stage's round stops waiting for us
            nursery.cancel_scope.cancel()
        member.moves.append((target, moved_to))
        logger.info("rebalancing: moving from stage %d to stage %d", target, moved_to)
        target = moved_to


async def _watch(node: Node, stages: int, stage: int, period: float, hysteresis: float) -> int:
    """Every ``period`` seconds, the rebalancing plan; returns the stage the plan moves us to."""
    me = str(node.peer_id)
    while True:
        await trio.sleep(period)
        with node.tolerated.around("swarm rebalancing read"):
            reports, _ = await read_reports(node, stages)
            if not any(r.peer == me for r in reports):  # our own record is not readable yet
                continue
            plan = plan_rebalance(reports, stages, hysteresis=hysteresis)
            if plan.moves:
                logger.debug("rebalancing plan from %d reports: %s", len(reports), plan)
            for move in plan.moves:
                if move.peer == me and move.source == stage:
                    return move.target
