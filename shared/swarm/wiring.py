"""Stochastic wiring: which server of a pipeline stage gets a trainer's next micro-batch (seed 004 §3.2 and
App. C, Algorithm 1; issue 17 item 3; pure: no trio, no torch, no clock reads).

A SWARM trainer routes every micro-batch through one server per stage. Each trainer keeps, per stage, one
:class:`StageRouter` and asks it :meth:`~StageRouter.choose` before each request; the router answers from
what *this trainer* observed, so trainers in different places weigh the same server differently and route
more to servers that are near them (§3.2, "different trainers can have different throughput estimates").

**The rule (Algorithm 1, interleaved weighted round-robin, Katevenis et al. 1991).** Server ``j`` has a
smoothed response time ``e_j`` and a priority ``p_j`` (its total charged time). A pick takes the server
with the smallest ``p_j`` among those that may be picked and charges it ``p_j += e_j``; a completed request
that took ``Δt`` seconds updates ``e_j := g Δt + (1 - g) e_j`` (``g`` = :attr:`WiringConfig.smoothing`,
0.1 as in §4.3). Ties in ``p`` go to the smaller server id, so the router is a deterministic function of
its calls. With fixed times, after ``n`` picks server ``j`` has been chosen ``c_j`` times with::

    |c_j - n w_j| <= e_max / e_j,      w_j = (1 / e_j) / Σ_k (1 / e_k)

(all ``p`` stay within ``e_max`` of the smallest one, because only the smallest grows, by at most
``e_max``; so ``c_j e_j`` lies in ``[m, m + e_max]`` for a common ``m``). Shares converge to the weights
``w_j ∝ 1/e_j`` (throughput) at rate ``1/n``: a server twice as fast gets twice the micro-batches.

**Three deviations from Algorithm 1, all at the edges of its life cycle.**

* *Unmeasured servers.* Algorithm 1 starts every server at ``e = p = ε``. With ``ε`` small a newcomer looks
  infinitely fast and takes every micro-batch a trainer sends before the first answer comes back; with
  ``ε`` large it is starved. Here an unmeasured server is charged the median ``e`` of the stage's
  measured servers (``ε`` = :attr:`WiringConfig.initial_seconds` while none is measured), and its first
  measured time replaces that prior instead of being averaged with it (as a bias-corrected EMA would).
* *Joining late.* Algorithm 1 gives a newcomer ``p = ε`` while the others have accumulated ``n``
  picks' worth: it then takes *every* micro-batch until it catches up (hundreds, into a bounded queue).
  Here a server that (re)enters starts at ``p = max(p_old, v)``, ``v`` the smallest priority among the
  servers that may be picked (the "virtual time" of fair queueing), which changes nothing at the start of
  a run, when every ``p`` is ``ε``.
* *Busy servers.* Algorithm 1's queues are unbounded; ours are bounded and a full queue answers "busy"
  with a retry hint (issue 17, item 2). A busy server is alive, so it is not banned: :meth:`~StageRouter
  .busy` skips it until ``now + retry_after`` (the hint, clamped to ``[0, max_retry_seconds]``) and the
  charge of the refused pick stands, so this trainer also sends it proportionally less afterwards,
  which is what a full queue asks for. The micro-batch is retried at the next :meth:`~StageRouter.choose`.

**Bans (§3.2).** A server that fails (no answer, an error, a timeout, or an answer that is non-finite,
mis-shaped or of absurd norm: issue 17 item 3) is banned by :meth:`~StageRouter.fail` until it
re-announces itself: the router remembers the announcement time it held at the ban and lifts the ban only
when :meth:`~StageRouter.announce` brings a strictly newer one. Servers missing from an announcement are
forgotten (their record expired).

**Times.** A time is what one request of the trainer's micro-batch took, from sending to the answer (so
the network is part of it, as in §3.2); a trainer whose micro-batches vary in size passes seconds per
sample instead, consistently. A response time must be finite and ``>= 0``: ``NaN``, ``inf`` and negative
values raise ``ValueError`` (a timeout is a failure, reported with :meth:`~StageRouter.fail`, not a time);
a time below :attr:`WiringConfig.min_seconds` (including 0) is raised to it, so every weight ``1/e`` is
finite.

**Races.** An answer may come back after its server was forgotten (its record expired while the request
was in flight): :meth:`~StageRouter.observe`, :meth:`~StageRouter.fail` and :meth:`~StageRouter.busy`
then do nothing and return ``False``.

**Outcomes.** :meth:`~StageRouter.choose` returns :class:`Pick` (send to ``server``), :class:`Wait` (every
server that may be picked is busy; the earliest is free at ``until``) or :class:`NoServer` (none is
announced or all are banned: the trainer waits for announcements).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["NoServer", "Pick", "StageRouter", "Wait", "WiringConfig", "WiringStatistics"]


@dataclass(frozen=True)
class WiringConfig:
    """Tunables of stochastic wiring (module docstring).

    Attributes:
        smoothing: ``g`` of the response-time EMA, in (0, 1]; seed 004 §4.3 uses 0.1.
        initial_seconds: ``ε``, the time charged for a server while no server of the stage is measured.
        min_seconds: the floor of a response time (a 0 s answer would make a weight infinite).
        max_retry_seconds: the longest "busy" retry hint obeyed (a server cannot park itself forever).
    """

    smoothing: float = 0.1
    initial_seconds: float = 1.0
    min_seconds: float = 1e-6
    max_retry_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not (0.0 < self.smoothing <= 1.0):
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        for name in ("initial_seconds", "min_seconds", "max_retry_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")


@dataclass(frozen=True)
class Pick:
    """Send the micro-batch to ``server``."""

    server: str


@dataclass(frozen=True)
class Wait:
    """Every server that may be picked is busy; ask again at ``until`` (the earliest end of a deferral)."""

    until: float


@dataclass(frozen=True)
class NoServer:
    """No server may be picked: none is announced, or every announced one is banned."""


@dataclass(frozen=True)
class WiringStatistics:
    """What a router holds, for the panel.

    Attributes:
        seconds: each announced server's smoothed response time ``e`` (``None``: not measured yet).
        weights: each pickable server's share ``(1/e) / Σ(1/e)`` (unmeasured servers at the prior).
        picks: micro-batches each server was given since it was first announced.
        banned: servers banned until they re-announce.
    """

    seconds: dict[str, float | None]
    weights: dict[str, float]
    picks: dict[str, int]
    banned: frozenset[str]


@dataclass
class _Server:
    announced_at: float
    priority: float
    seconds: float | None = None  # the EMA; None until the first measured answer
    picks: int = 0
    banned_at: float | None = None  # the announcement time held when banned
    busy_until: float = -math.inf


@dataclass
class StageRouter:
    """Interleaved weighted round-robin over one stage's servers, as one trainer sees them (module
    docstring). Deterministic: the same calls give the same picks."""

    config: WiringConfig = field(default_factory=WiringConfig)
    _servers: dict[str, _Server] = field(default_factory=dict)

    # ----------------------------------------------------------------- membership

    def announce(self, servers: Mapping[str, float]) -> None:
        """The stage's servers as the DHT lists them now, each with the time of its latest announcement.

        Servers not in ``servers`` are forgotten; a banned server whose announcement is newer than the one
        it was banned at is let back in; new and returning servers start at the virtual time.

        Raises:
            ValueError: an announcement time is not finite.
        """
        for server, at in servers.items():
            if not math.isfinite(at):
                raise ValueError(f"announcement time of {server!r} must be finite, got {at}")
        for gone in set(self._servers) - set(servers):
            del self._servers[gone]
        virtual = self._virtual_time()
        for server in sorted(servers):
            at = float(servers[server])
            state = self._servers.get(server)
            if state is None:
                self._servers[server] = _Server(announced_at=at, priority=virtual)
                continue
            if at > state.announced_at:
                state.announced_at = at
                if state.banned_at is not None and at > state.banned_at:
                    state.banned_at = None
                    state.priority = max(state.priority, virtual)

    def fail(self, server: str) -> bool:
        """Ban ``server`` until it re-announces (a failure, a timeout or an answer that fails the checks).

        Returns:
            ``False`` if ``server`` is not announced (nothing to ban).
        """
        state = self._servers.get(server)
        if state is None:
            return False
        state.banned_at = state.announced_at
        return True

    def busy(self, server: str, *, now: float, retry_after: float) -> bool:
        """``server`` answered "busy": skip it until ``now + retry_after`` (clamped), without a ban.

        Returns:
            ``False`` if ``server`` is not announced.

        Raises:
            ValueError: ``now`` is not finite or ``retry_after`` is NaN.
        """
        if not math.isfinite(now) or math.isnan(retry_after):
            raise ValueError(f"need a finite now and a retry hint, got now={now}, retry_after={retry_after}")
        state = self._servers.get(server)
        if state is None:
            return False
        hint = min(max(retry_after, 0.0), self.config.max_retry_seconds)
        state.busy_until = max(state.busy_until, now + hint)
        return True

    # -------------------------------------------------------------------- routing

    def choose(self, now: float) -> Pick | Wait | NoServer:
        """The server for the next micro-batch, charged ``e`` of that server (module docstring).

        Raises:
            ValueError: ``now`` is not finite.
        """
        if not math.isfinite(now):
            raise ValueError(f"now must be finite, got {now}")
        alive = [(s, st) for s, st in self._servers.items() if st.banned_at is None]
        if not alive:
            return NoServer()
        free = [(s, st) for s, st in alive if st.busy_until <= now]
        if not free:
            return Wait(until=min(st.busy_until for _, st in alive))
        server, state = min(free, key=lambda item: (item[1].priority, item[0]))
        state.priority += self._charge(state)
        state.picks += 1
        return Pick(server)

    def observe(self, server: str, seconds: float) -> bool:
        """``server`` answered a request in ``seconds``: update its EMA (the first answer sets it).

        Returns:
            ``False`` if ``server`` is not announced (the answer is not counted).

        Raises:
            ValueError: ``seconds`` is NaN, infinite or negative.
        """
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"a response time must be finite and >= 0, got {seconds}")
        state = self._servers.get(server)
        if state is None:
            return False
        seconds = max(seconds, self.config.min_seconds)
        if state.seconds is None:
            state.seconds = seconds
        else:
            gamma = self.config.smoothing
            state.seconds = gamma * seconds + (1.0 - gamma) * state.seconds
        return True

    # ----------------------------------------------------------------- inspection

    def statistics(self) -> WiringStatistics:
        alive = {s: st for s, st in self._servers.items() if st.banned_at is None}
        inverse = {s: 1.0 / self._charge(st) for s, st in alive.items()}
        total = math.fsum(inverse.values())
        return WiringStatistics(
            seconds={s: st.seconds for s, st in self._servers.items()},
            weights={s: w / total for s, w in inverse.items()},
            picks={s: st.picks for s, st in self._servers.items()},
            banned=frozenset(s for s, st in self._servers.items() if st.banned_at is not None),
        )

    def _prior(self) -> float:
        measured = [st.seconds for st in self._servers.values() if st.seconds is not None]
        return statistics.median(measured) if measured else self.config.initial_seconds

    def _charge(self, state: _Server) -> float:
        return state.seconds if state.seconds is not None else self._prior()

    def _virtual_time(self) -> float:
        alive = [st.priority for st in self._servers.values() if st.banned_at is None]
        return min(alive) if alive else self.config.initial_seconds
