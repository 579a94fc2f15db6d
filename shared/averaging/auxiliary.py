"""Auxiliary aggregators: peers that take aggregation slices without computing (seed 000 §3.2; issue 14).

A run whose computing peers are all behind NAT (client mode: they accept no connections) has nobody the
adaptive-averaging LP can give a slice: matchmaking fails ("all N peers are in client mode: nobody can
aggregate"). A reachable peer that computes nothing fixes that: a backbone (by default; ``backbone start
--no-aggregate`` opts out) or ``volunteer join --aux`` on a reachable CPU server. It needs no torch: the
averaging core is numpy.

**What it does, per step** (:class:`AuxiliaryAggregator`). It follows the collaboration's step from the
peers' progress records (:func:`shared.progress.summarize`, not anchored: as a newcomer would), and while
at least two peers train at step ``s`` it joins the round of ``s`` the way the computing peers do
(``<prefix>.<s>.a<attempt>``, :mod:`.matchmaking`), with an auxiliary ticket: its address, weight, norm
and samples/s 0, ``aux`` set, and its bandwidth. The LP sees it as a peer that only aggregates and gives
it a slice in proportion to its bandwidth (its traffic is ``k x_j`` each way for ``k`` senders,
:mod:`.load_balance`). It stores its ticket as soon as it sees the step, before the computing peers
enter (they read the tickets one matchmaking window after storing theirs), waits for a computing peer's
ticket, then forms the group with them (:meth:`.matchmaking.Matchmaker.assemble_auxiliary`).

*Attempts.* Computing peers retry a failed round under their next key of the step, which only moves
forward (:mod:`.attempts`; :class:`volunteer.collab.step.BatchStep`). The aggregator follows the same
rule, whatever its own round's outcome (its slice may have been averaged while another member's failed):
after a round under ``a<k>`` it moves on to ``a<k+1>`` of the same step, unless it read at most one
computing ticket there (it stays for a second one), and stops waiting as soon as the collaboration's step
moves past ``s``. A key it joined before only counts tickets stored after its own (the earlier attempt's
tickets are still there).

**Bandwidth: configured, not measured.** Its ticket states ``upload_bps`` and ``download_bps`` from its
configuration: a volunteer measures its link against a backbone's probe service
(:mod:`shared.net.probe`), but a backbone has nobody to measure against, and the organizer knows the
server's link better than a probe through one peer would. ``volunteer join --aux`` would state the link
it measured like any volunteer.

**The vector's length: from the computing members' tickets.** The aggregator does not load the model
(no torch; a backbone's spec names a task, not its parameter count). Computing peers state the length of
the vector they average in their tickets (``JoinTicket.numel``); the aggregator adopts the length at
least two of them state (:func:`.matchmaking.agreed_numel`: never one stranger's claim) and joins only if
it is at most ``max_numel`` -- checked before anything is sized by it. The codec and averaging rule are
its own manifest's (:class:`~protocols.training.TrainingSpec`), as for every member: a plan with
another codec is refused.

**Memory.** It averages into ``np.zeros(numel)``, which the kernel maps lazily: it pulls no other
aggregator's slice (``Member.aux``, :mod:`.allreduce`), so only its own slice's pages are ever written.

**Faults.** A round that fails (no group, a refused plan, a member that departs, a bad peer) is counted
and logged, and the next attempt follows; no peer can end the service: every failure of a round's
network calls, plan or LP is caught per round (:meth:`AuxiliaryAggregator.serve_forever`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import trio

from protocols.averaging import JoinTicket
from protocols.errors import ProtocolError
from protocols.training import Progress, TrainingSpec

from ..dht.node import DHTNode
from ..errors import ProjectError
from ..net.host import CALL_FAILURES
from ..progress import summarize
from ..progress_records import read_progress_with_users
from .allreduce import Averager
from .attempts import AttemptKeys, attempt_key
from .matchmaking import Matchmaker, MatchmakingConfig

__all__ = ["DEFAULT_BPS", "AuxiliaryAggregator", "AuxiliaryConfig", "AuxiliaryStatistics"]

logger = logging.getLogger(__name__)
#: Bytes/s an aggregator states when not configured: the computing peers' own default before they measure.
DEFAULT_BPS = 1e8
#: Prefix of the computing peers' round keys (:class:`volunteer.collab.step.BatchStep`).
TRAINING_PREFIX = "train.avg"


@dataclass(frozen=True)
class AuxiliaryConfig:
    """How an auxiliary aggregator takes part (module docstring).

    Attributes:
        upload_bps, download_bps: the link it states in its tickets, bytes/s (configured, not measured).
        max_numel: the longest vector it aggregates a slice of (elements).
        window: seconds between the first computing peer's ticket and reading the group (the computing
            peers' matchmaking window).
        poll_period: seconds between reads of the progress records.
    """

    upload_bps: float = DEFAULT_BPS
    download_bps: float = DEFAULT_BPS
    max_numel: int = 2**31
    window: float = 1.0
    plan_wait: float = 10.0
    poll_period: float = 0.5
    prefix: str = TRAINING_PREFIX

    def __post_init__(self) -> None:
        for name in ("upload_bps", "download_bps"):
            value = getattr(self, name)
            if not 0 < value <= 1e13:
                raise ValueError(f"{name} must be in (0, 1e13] bytes/s, got {value!r}")
        if self.max_numel < 1:
            raise ValueError("max_numel must be at least 1")


@dataclass
class AuxiliaryStatistics:
    rounds_joined: int = 0  # rounds whose group and plan we were in
    rounds_aggregated: int = 0  # rounds whose slice we averaged and served
    rounds_failed: int = 0  # rounds in a plan whose slice of ours was not averaged
    #: attempts that formed no group with us: nobody came before the step moved on, no agreed length,
    #: the group formed without us, or no acceptable plan came
    no_group: int = 0
    errors: int = 0  # attempts ended by a peer's failure, a bad plan or the LP (logged)
    elements_aggregated: int = 0  # elements of the slices we averaged
    last_step: int | None = None  # the step of the last round we aggregated for (its round)
    last_error: str = ""
    errors_by_kind: dict[str, int] = field(default_factory=dict)


class AuxiliaryAggregator:
    """Takes aggregation slices of the run's rounds without computing (module docstring)."""

    def __init__(
        self,
        dht: DHTNode,
        spec: TrainingSpec,
        config: AuxiliaryConfig | None = None,
        averager: Averager | None = None,
    ) -> None:
        self.dht = dht
        self.spec = spec
        self.config = config or AuxiliaryConfig()
        self.averager = averager or Averager(dht.host)
        self.matchmaker = Matchmaker(
            dht,
            prefix=self.config.prefix,
            config=MatchmakingConfig(
                window=self.config.window,
                plan_wait=self.config.plan_wait,
                codec=spec.codec,
                max_weight=float(spec.target_batch + spec.local_batch),
                averaging=spec.averaging,
            ),
        )
        self.stats = AuxiliaryStatistics()

    def statistics(self) -> AuxiliaryStatistics:
        return AuxiliaryStatistics(**{**vars(self.stats), "errors_by_kind": dict(self.stats.errors_by_kind)})

    def ticket(self) -> JoinTicket | None:
        """Our auxiliary ticket, or None while we advertise no address others can dial."""
        addrs = self.dht.host.advertised_addrs  # what a reachability check proved, if one ran
        if not addrs:
            return None
        return JoinTicket(
            addr=addrs[0],
            weight=0.0,
            norm=0.0,
            samples_per_second=0.0,
            upload_bps=self.config.upload_bps,
            download_bps=self.config.download_bps,
            aux=True,
        )

    async def collaboration_step(self) -> int | None:
        """The collaboration's step while at least two peers train at it; None otherwise."""
        records, users = await read_progress_with_users(self.dht)
        if not records:
            return None
        nobody = Progress(step=0, samples=0, samples_per_second=0.0, time=time.time())
        view = summarize(
            records,
            self.dht.host.peer_id,
            nobody,
            now=time.time(),
            target_batch=self.spec.target_batch,
            anchored=False,
            users=users,
        )
        training = view.peers_at_step - (view.step == 0)  # not ourselves (a "peer" at step 0)
        return view.step if training >= 2 else None

    async def serve_forever(self) -> None:
        """Follow the collaboration and aggregate every step's rounds (module docstring), until cancelled."""
        joined: set[tuple[int, int]] = set()  # (step, attempt) keys we stored a ticket under
        attempts = AttemptKeys()
        while True:
            try:
                step = await self.collaboration_step()
            except (*CALL_FAILURES, ProjectError) as exc:
                self._note("progress", exc)
                step = None
            ticket = self.ticket()
            if step is None or ticket is None:
                await trio.sleep(self.config.poll_period)
                continue
            attempt = attempts.next(step)
            joined = {key for key in joined if key[0] >= step}
            rejoin = (step, attempt) in joined
            joined.add((step, attempt))
            await self.serve_round(step, attempt, ticket, rejoin)
            attempts.done(step, attempt, alone=self.matchmaker.alone, now=trio.current_time())

    async def serve_round(self, step: int, attempt: int, ticket: JoinTicket, rejoin: bool = False) -> bool:
        """One attempt of ``step``'s round as an auxiliary aggregator; True if we averaged our slice.
        Every failure a peer can cause is caught, counted and logged here."""
        try:
            plan = await self.matchmaker.assemble_auxiliary(
                step,
                ticket,
                attempt_key(attempt),
                self.config.max_numel,
                stop_waiting=lambda: self._moved_past(step),
                rejoin=rejoin,
            )
            if plan is None:
                self.stats.no_group += 1
                return False
            self.stats.rounds_joined += 1
            me = next(i for i, m in enumerate(plan.members) if m.peer_id == self.dht.host.peer_id)
            if not plan.slice_sizes[me]:
                logger.info("step %d: the plan gives us no slice (attempt %d)", step + 1, attempt + 1)
                return False
            vector = np.zeros(plan.numel, dtype=np.float32)  # lazily mapped: only our slice is written
            result = await self.averager.all_reduce(plan, vector, me, step=step + 1)
        except (*CALL_FAILURES, ProtocolError, ProjectError, ValueError, MemoryError) as exc:
            # MemoryError: a vector of up to max_numel elements that the machine cannot map after all
            self._note(type(exc).__name__, exc)
            return False
        own = result.outcome.slices[me]
        if not own.averaged:
            self.stats.rounds_failed += 1
            logger.warning("step %d: our slice was not averaged: %s", step + 1, own.reason or "unknown")
            return False
        self.matchmaker.record_round(plan.predicted_seconds, result.seconds)  # deadlines adapt, as members'
        self.stats.rounds_aggregated += 1
        self.stats.elements_aggregated += own.slice.numel
        self.stats.last_step = step
        completeness = result.completeness.get(me)
        logger.info(
            "step %d: aggregated %d of %d elements for %d sender(s) in %.2f s",
            step + 1,
            own.slice.numel,
            plan.numel,
            len(completeness.contributors) if completeness is not None else 0,
            result.seconds,
        )
        return True

    async def _moved_past(self, step: int) -> None:
        """Return once the collaboration's step is past ``step``."""
        while True:
            await trio.sleep(self.config.poll_period)
            try:
                now = await self.collaboration_step()
            except (*CALL_FAILURES, ProjectError):
                continue
            if now is not None and now > step:
                return

    def _note(self, kind: str, exc: BaseException) -> None:
        self.stats.errors += 1
        self.stats.errors_by_kind[kind] = self.stats.errors_by_kind.get(kind, 0) + 1
        self.stats.last_error = f"{kind}: {exc}"
        logger.warning("auxiliary aggregation: %s: %s", kind, exc)

    def status(self) -> str:
        """One line for logs and status: what the aggregator has done."""
        s = self.stats
        last = "—" if s.last_step is None else str(s.last_step + 1)
        return (
            f"aggregating (auxiliary): {s.rounds_aggregated} round(s) aggregated, {s.rounds_failed} failed, "
            f"{s.elements_aggregated} elements, last step {last}"
        )
