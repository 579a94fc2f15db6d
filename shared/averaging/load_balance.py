"""Adaptive averaging: who computes and who aggregates how much (DeDLOC, seed 000 §3.2 eq. (1); DESIGN §2).

A pure function of measured capabilities: no I/O, no trio, no torch. Callers run it through the compute
limiter (``trio.to_thread.run_sync``).

**Inputs.** Peers ``i = 1..n`` with ``s_i`` samples/s (0 without an accelerator), download ``d_i`` and upload
``u_i`` in **bytes/s**, and a client-mode flag (no inbound connections); optional pairwise caps ``t_ij``
(bytes/s from ``i`` to ``j``); target batch ``B`` (samples); gradient size ``P`` in **bytes as sent** (after
compression). ``A`` is the set of peers that may aggregate (not in client mode).

**The paper's program.** With ``c_i ∈ {0,1}`` (``i`` computes), ``a_ij`` (``i`` sends gradient parts to
aggregator ``j``) and ``g_ij`` (aggregator ``i`` returns averaged parts to ``j``)::

    maximize  min( Σ_i s_i c_i / B ,  min_{j: c_j=1} Σ_i g_ij / P )
    s.t.      g_ij <= min_{k: c_k=1} a_ki ;  Σ_{j≠i} (a_ji + g_ji) <= d_i ;  Σ_{j≠i} (a_ij + g_ij) <= u_i
              a_ij + g_ij <= t_ij ;  client-mode i aggregates nothing ;  transfers inside a node are free

**Who receives the average: the computing peers.** The senders get their averaged gradient back (the
paper: "the senders can then get the aggregated results"; hivemind's ``AllReduceRunner``, which DeDLOC ran,
returns averaged parts only to senders, and its auxiliary peers receive nothing). A peer that does not compute
this round needs no gradient; it refreshes its state by state download (DESIGN §1) when it starts computing.

**Slices make the rates symmetric.** Aggregator ``j`` owns a slice of fraction ``f_j``. Per optimizer step
every sender must deliver its whole part of slice ``j`` to ``j``, and every receiver must get the whole
averaged slice ``j`` back, so in the pipelined steady state all of these transfers run at one rate ``x_j``
(bytes/s of slice ``j``, the rate at which ``j`` aggregates): ``a_kj = g_jk = x_j`` (DESIGN's ``m_j``).
Sending faster than ``j`` aggregates is wasted, and a receiver fed slower would not hold the full average.
With ``X = Σ_j x_j`` the averaging rate is ``X / P`` gradients/s and ``f_j = x_j / X``. Traffic of peer
``i`` for a compute set ``C`` (``k = |C|``)::

    i ∈ C ∩ A :  down = up = (k-1) x_i + (X - x_i) = X + (k-2) x_i
    i ∈ A \\ C :  down = up = k x_i                  (auxiliary summation, BytePS-style)
    i ∈ C \\ A :  down = up = X                      (client: sends every part, receives every average)
    pair {i,j}:  i→j = j→i = c_i x_j + c_j x_i     (x = 0 for clients)

Download equals upload, so ``d_i`` and ``u_i`` act only through ``w_i = min(d_i, u_i)``, and ``t_ij`` and
``t_ji`` only through ``min(t_ij, t_ji)``. For fixed ``C`` the program becomes the LP (epigraph: ``ξ`` is
``min(S/B, X/P)`` with ``S = Σ_C s_i``, so it suffices to maximize ``X``)::

    maximize X = Σ_{j∈A} x_j   s.t.  the traffic rows above <= w_i and <= min(t_ij, t_ji);  x >= 0

It has ``|A| + 1`` variables with or without pairwise caps: the caps add ``O(n²)`` *rows*, not variables.
The paper's per-pair variables ``a_ij, g_ij`` add no freedom a slice plan can use. Its program only asks
each receiver for ``Σ_j g_jr >= ξ P``, so a receiver may take less of one slice and more of another; that
never holds a full average. With ``d_i = u_i`` and no caps its optimum equals the slice model's (tested);
with asymmetric links or pairwise caps it is a relaxation that promises rates no slice plan delivers
(tested), which is why the per-pair form is not used here.

**Closed form (no pairwise caps).** For ``k >= 2`` every computing peer needs ``X <= w_i``, and summing
the aggregators' ceilings ``x_j <= (w_j - X)/(k-2)`` (``C ∩ A``) and ``x_j <= w_j / k`` (``A \\ C``) gives::

    X*(C) = min( min_{i∈C} w_i ,  (2 W_{C∩A} + (k-2) W_A) / (k (k-2+q)) ),     q = |C ∩ A|, W_S = Σ_S w

(``k = 2, q = 0``: ``W_A / 2``; ``k = 1``: ``inf`` for a lone aggregator, which needs no traffic, and
``min(w_c, W_A)`` for a client). The search uses it; the plan's rates come from HiGHS
(``linprog(method="highs")``), and among optimal splits the plan takes ``x_j`` proportional to each
aggregator's own ceiling at ``X*``, so equal peers get equal slices and spare capacity is spread evenly.

**Relays** (DESIGN §2 "Relay"; not in the paper). A peer behind NAT that holds a slot on a relay ``r = r(i)``
(``PeerSpec.relay``: another member, reachable directly, not itself relayed) accepts connections through
``r``, so it may aggregate: ``i ∈ A``. Which bytes pass ``r`` follows from who dials whom: a sender opens the
connection to an aggregator, pushes its part of the slice and pulls the average back over connections it
opens itself (``allreduce``; that is how client mode works), and a peer behind NAT dials out directly. So a
relayed peer's own sending and receiving as a *sender* is direct, and only the connections *to* a relayed
aggregator ``j`` go through its relay, except the relay's own (``r`` dials ``j`` on the circuit it holds).
Each such byte enters ``r`` once and leaves it once, so with ``R(r)`` the peers ``r`` relays the bytes/s
``r`` forwards, which load its download and its upload alike, are::

    F_r = Σ_{j ∈ R(r)} 2 (k - c_r - c_j) x_j          (x_j: the (k - c_r - c_j) dialers' parts and averages)

and ``r``'s row becomes ``traffic_r + F_r <= w_r``, that is ``c_r X + (k - 2 c_r) x_r + F_r <= w_r``; a
relay with a slot limit ``h_r`` (``PeerSpec.relay_capacity_bps``: bytes/s forwarded, each way) adds
``F_r <= h_r``. The relayed peer's own row is unchanged (its bytes cross its link once, relayed or not), and a
pairwise cap ``t_ij`` stays end to end (measured through the relay when there is one). This is not the
model in which *all* of ``i``'s traffic crosses ``r`` (``traffic_r + Σ_{i ∈ R(r)} 2 (T_i - e_ir)``, twice
because ``i``'s sent and received bytes both pass ``r``): that holds for a peer that cannot dial out, which
NAT does not prevent, and it would make a relayed peer worse off than the same peer in client mode. Here,
with ``x_i = 0`` a relayed peer's rows are exactly its client-mode rows, so a relayed peer is never planned
worse than client mode, and a relay whose spare bandwidth covers ``F_r`` changes nothing (tested). The
relay rows have non-negative coefficients that do not decrease when a peer joins ``C`` (``k - c_r - c_j``
counts the *other* computing peers), so everything the search uses below still holds, and they only
remove options, so the closed form ``X*(C)`` is an upper bound with relays. Not modelled: the relay's added
latency and CPU, and relays of relays (rejected).

**Choosing ``C``** exactly: closed-form incumbents, cell bounds that certify them, and a fixed-size MILP
(HiGHS, ``scipy.optimize.milp``) where they do not (:mod:`.load_balance_search`). Tested against
enumerating all ``2^n`` compute sets. The search has a time budget (``time_limit``, default
``DEFAULT_TIME_LIMIT`` = 0.8 s, for the whole search): if it runs out first, the plan is the best set found
(never worse than the closed-form incumbent) and ``Plan.gap = 1 - ξ / U`` with ``U`` the largest upper bound
on ``ξ`` still open, so the optimum lies in ``[ξ, ξ / (1 - gap)]``. Without caps the certificate almost always
holds and the budget is not reached; with binding pairwise caps it is what bounds the worst case. Slices:
``x_j / X`` rounded to integers by largest remainder.

Special cases it recovers (tested): homogeneous peers → equal all-reduce; one high-bandwidth low-compute
peer → parameter server; CPU-only peers with good links → pure aggregators (BytePS); client-mode peers →
senders only; a relayed peer behind a relay with spare bandwidth → as if it were direct.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .load_balance_model import Bools, Floats, Ints, Problem, forced_rate, max_rates
from .load_balance_search import choose_compute_set

DEFAULT_TIME_LIMIT = 0.8  # seconds for the compute-set search of one plan_averaging call

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "PeerSpec",
    "Plan",
    "largest_remainder",
    "plan_all_reduce",
    "plan_averaging",
    "plan_parameter_server",
]


def _check_rate(name: str, value: float, *, positive: bool) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {need} finite number, got {value!r}")


@dataclass(frozen=True)
class PeerSpec:
    """One peer's measured capabilities. Rates are per second; bandwidths in **bytes/s** (not bits).

    Attributes:
        samples_per_second: gradient throughput on the run's model; 0 for a peer without an accelerator.
        download_bps: download bandwidth, bytes/s.
        upload_bps: upload bandwidth, bytes/s.
        client_mode: the peer accepts no inbound connections, not even through a relay, so it cannot
            aggregate.
        relay: index (in the group passed to the planner) of the member that relays inbound connections to
            this peer, or ``None`` for a directly reachable or client-mode peer. A relayed peer may aggregate;
            its slice's traffic loads the relay (module docstring, "Relays").
        relay_capacity_bps: as a relay, the most bytes/s this peer forwards for the peers it relays (its slot
            limit, each way), or ``None`` for no limit beyond its links.

    Raises:
        ValueError: a rate is NaN, infinite or negative, or a bandwidth is 0; ``relay`` is not a non-negative
            integer, or is given for a peer in client mode. (Whether ``relay`` names a member that can relay
            is checked by the planners, which see the whole group.)
    """

    samples_per_second: float
    download_bps: float
    upload_bps: float
    client_mode: bool = False
    relay: int | None = None
    relay_capacity_bps: float | None = None

    def __post_init__(self) -> None:
        _check_rate("samples_per_second", self.samples_per_second, positive=False)
        _check_rate("download_bps", self.download_bps, positive=True)
        _check_rate("upload_bps", self.upload_bps, positive=True)
        if self.relay_capacity_bps is not None:
            _check_rate("relay_capacity_bps", self.relay_capacity_bps, positive=False)
        if self.relay is not None:
            if isinstance(self.relay, bool) or not isinstance(self.relay, int | np.integer) or self.relay < 0:
                raise ValueError(f"relay must be a member index (a non-negative integer), got {self.relay!r}")
            if self.client_mode:
                raise ValueError(
                    f"a peer relayed by member {self.relay} is reachable through it, so it is not in client "
                    "mode: pass client_mode=False, or relay=None for a peer with no relay slot"
                )


@dataclass(frozen=True)
class Plan:
    """An averaging plan and what the model predicts for it.

    Attributes:
        compute: ``c_i``: peer ``i`` computes gradients (and so sends parts and receives the average).
        fractions: share of the gradient each peer aggregates; 0 for non-aggregators; sums to 1.
        slices: integer slice sizes of a ``numel``-element vector (largest remainder): they sum to
            ``numel`` and are 0 for peers with fraction 0 (client-mode peers included).
        steps_per_second: predicted optimizer steps/s, ``min(compute_rate, comm_rate)``: with delayed
            parameter updates compute and averaging overlap (the paper's assumption); without them a step
            takes ``1 / compute_rate + averaging_seconds``.
        averaging_seconds: predicted time to average one gradient, ``P / X`` (0 when nothing moves; ``inf``
            for a forced plan that zero pairwise caps stop).
        compute_rate: ``Σ_i s_i c_i / B``: steps/s the computing peers can fill.
        comm_rate: ``X / P``: gradients/s the network can average under this plan (``inf``: no traffic).
        method: how it was produced: ``"lp (compute set certified)"``, ``"lp (compute set milp over N
            sizes)"``, ``"lp (compute set certified, caps slack)"`` (also ``relays slack``, ``caps and
            relays slack``; see :mod:`.load_balance_search`),
            ``"lone aggregator"`` (one peer computes and aggregates everything locally, no traffic;
            ``"lone aggregator (compute set …, time limit, gap G%)"`` when the budget cut the search),
            ``"all-reduce"`` or ``"parameter server"`` (forced fractions). A search that ran out of its
            time budget before proving its compute set optimal appends ``", time limit, gap G%"`` inside
            the parentheses (``"lp (compute set milp over N sizes, time limit, gap 1.25%)"``, or
            ``"lp (compute set incumbent, time limit, gap G%)"`` if no MILP ran).
        gap: relative optimality gap of the compute set: the best possible ``steps_per_second`` is at
            most ``steps_per_second / (1 - gap)``. 0 when the plan is proven optimal (up to a relative
            1e-9), which is always the case unless the search's time budget ran out. Forced plans
            (all-reduce, parameter server) have no search and report 0.
    """

    compute: tuple[bool, ...]
    fractions: tuple[float, ...]
    slices: tuple[int, ...]
    steps_per_second: float
    averaging_seconds: float
    compute_rate: float
    comm_rate: float
    method: str
    gap: float = 0.0


def plan_averaging(
    peers: Sequence[PeerSpec],
    target_batch: float,
    gradient_bytes: float,
    *,
    numel: int | None = None,
    pairwise: Mapping[tuple[int, int], float] | None = None,
    time_limit: float | None = DEFAULT_TIME_LIMIT,
) -> Plan:
    """Solve the adaptive-averaging program: the optimal compute set, aggregator fractions and slices.

    Args:
        peers: the group's peers; plan indices follow this order.
        target_batch: ``B``, samples per optimizer step.
        gradient_bytes: ``P``, bytes of one gradient as sent (after compression).
        numel: elements of the vector to slice; defaults to ``gradient_bytes // 4`` (float32).
        pairwise: optional caps ``{(i, j): bytes/s from i to j}``; absent pairs are uncapped.
        time_limit: budget in seconds for choosing the compute set (the whole search, not one MILP), or
            ``None`` for no limit. When it runs out the plan is the best compute set found so far (never
            worse than the closed-form incumbent) and ``Plan.gap`` says how far from optimal it may be.
            Plans are deterministic unless the budget runs out.

    Returns:
        The optimal :class:`Plan` (objective exact up to a relative 1e-9), or with ``gap > 0`` the best
        found within ``time_limit``.

    Raises:
        ValueError: no peers; ``target_batch`` or ``gradient_bytes`` not positive and finite; every peer
            in client mode (nobody can aggregate); a ``relay`` that is out of range, the peer itself, a
            client-mode member or a relayed member; no peer with ``samples_per_second > 0`` (nobody can
            compute); a bad ``pairwise`` entry, ``numel`` or ``time_limit``; or pairwise caps of 0 leave no
            way to average.
    """
    p = _problem(peers, target_batch, gradient_bytes, pairwise)
    size = _numel(numel, gradient_bytes)
    if time_limit is not None:
        _check_rate("time_limit", time_limit, positive=False)
    choice = choose_compute_set(p, time_limit)
    total, x = max_rates(p, choice.compute)
    if total <= 0.0:
        raise ValueError("the pairwise caps leave no compute set a positive averaging rate (caps of 0?)")
    gap = choice.gap
    how = f"{choice.how}, gap {gap:.2%}" if gap > 0 else choice.how
    if math.isinf(total):  # a budget cut short still says so (hypothesis: a lone aggregator with a gap)
        method = f"lone aggregator (compute set {how})" if gap > 0 else "lone aggregator"
    else:
        method = f"lp (compute set {how})"
    return _plan(p, choice.compute, x / x.sum(), total, size, method, gap)


def plan_all_reduce(
    peers: Sequence[PeerSpec],
    target_batch: float,
    gradient_bytes: float,
    *,
    numel: int | None = None,
    pairwise: Mapping[tuple[int, int], float] | None = None,
    compute: Sequence[bool] | None = None,
) -> Plan:
    """All-reduce under the same model: equal fractions for every peer not in client mode.

    ``compute`` defaults to every peer with ``samples_per_second > 0``. Arguments and errors as in
    :func:`plan_averaging`; also ``ValueError`` for a ``compute`` of the wrong length or with nobody in it.
    """
    p = _problem(peers, target_batch, gradient_bytes, pairwise)
    fractions = p.agg / p.agg.sum()
    return _forced(p, compute, fractions, _numel(numel, gradient_bytes), "all-reduce")


def plan_parameter_server(
    peers: Sequence[PeerSpec],
    server: int,
    target_batch: float,
    gradient_bytes: float,
    *,
    numel: int | None = None,
    pairwise: Mapping[tuple[int, int], float] | None = None,
    compute: Sequence[bool] | None = None,
) -> Plan:
    """A parameter server under the same model: peer ``server`` aggregates the whole gradient.

    Arguments and errors as in :func:`plan_all_reduce`; also ``ValueError`` if ``server`` is out of range
    or in client mode.
    """
    p = _problem(peers, target_batch, gradient_bytes, pairwise)
    if isinstance(server, bool) or not isinstance(server, int) or not 0 <= server < p.n:
        raise ValueError(f"server must be a peer index in [0, {p.n}), got {server!r}")
    if not p.agg[server]:
        raise ValueError(f"peer {server} is in client mode and cannot be a parameter server")
    fractions = np.zeros(p.n)
    fractions[server] = 1.0
    return _forced(p, compute, fractions, _numel(numel, gradient_bytes), "parameter server")


def largest_remainder(fractions: Sequence[float], total: int) -> list[int]:
    """Apportion ``total`` units by largest remainder (Hamilton's method).

    Each entry gets ``floor(f_i / Σf · total)``, and the units left go one each to the largest remainders
    (ties to the lower index). The result sums to ``total``, and an entry with fraction 0 gets 0.

    Raises:
        ValueError: ``total`` is negative or not an integer; ``fractions`` is empty, has a negative or
            non-finite entry, or sums to 0.
    """
    if isinstance(total, bool) or not isinstance(total, int | np.integer) or total < 0:
        raise ValueError(f"total must be a non-negative integer, got {total!r}")
    f = np.asarray(fractions, dtype=float)
    if f.ndim != 1 or len(f) == 0:
        raise ValueError(f"fractions must be a non-empty sequence, got {fractions!r}")
    if not np.isfinite(f).all() or (f < 0).any() or f.sum() <= 0:
        raise ValueError(f"fractions must be finite, non-negative and not all 0, got {list(f)!r}")
    quotas = f / f.sum() * int(total)
    counts = np.floor(quotas).astype(np.int64)
    remainder = quotas - counts
    order = [int(i) for i in np.lexsort((np.arange(len(f)), -remainder)) if f[i] > 0]
    left = int(total) - int(counts.sum())
    step = 0
    while left > 0:  # floating error may leave more units than entries with a remainder: cycle
        counts[order[step % len(order)]] += 1
        left -= 1
        step += 1
    for i in reversed(order):  # floating error may also overshoot: take back from the smallest remainders
        if left == 0:
            break
        take = min(int(counts[i]), -left)
        counts[i] -= take
        left += take
    return [int(c) for c in counts]


def _problem(
    peers: Sequence[PeerSpec],
    target_batch: float,
    gradient_bytes: float,
    pairwise: Mapping[tuple[int, int], float] | None,
) -> Problem:
    if len(peers) == 0:
        raise ValueError("no peers to plan for")
    for i, peer in enumerate(peers):
        if not isinstance(peer, PeerSpec):
            raise TypeError(f"peers[{i}] must be a PeerSpec, got {peer!r}")
    _check_rate("target_batch", target_batch, positive=True)
    _check_rate("gradient_bytes", gradient_bytes, positive=True)
    n = len(peers)
    s = np.array([peer.samples_per_second for peer in peers], dtype=float)
    w = np.array([min(peer.download_bps, peer.upload_bps) for peer in peers], dtype=float)
    agg = np.array([not peer.client_mode for peer in peers], dtype=bool)
    if not agg.any():
        raise ValueError(f"all {n} peers are in client mode: nobody can aggregate")
    if not (s > 0).any():
        raise ValueError(f"no peer can compute: samples_per_second is 0 for all {n} peers")
    scale = float(w.max())
    caps = None
    if pairwise is not None:
        caps = np.full((n, n), math.inf)
        for key, cap in pairwise.items():
            if not (isinstance(key, tuple) and len(key) == 2 and all(_is_index(v, n) for v in key)):
                raise ValueError(f"pairwise keys must be (i, j) peer indices in [0, {n}), got {key!r}")
            if key[0] == key[1]:
                raise ValueError(f"pairwise key {key!r}: traffic within one node is not capped")
            _check_rate(f"pairwise[{key!r}]", cap, positive=False)
            caps[key] = min(caps[key], cap / scale)
        caps = np.minimum(caps, caps.T)
    relay, relay_cap = _relays(peers, scale)
    return Problem(
        s, w / scale, agg, float(target_batch), float(gradient_bytes) / scale, caps, scale, relay, relay_cap
    )


def _relays(peers: Sequence[PeerSpec], scale: float) -> tuple[Ints | None, Floats | None]:
    """``r(i)`` (-1: not relayed) and ``h_r / scale`` (``inf``: no slot limit), or ``(None, None)``."""
    n = len(peers)
    if all(peer.relay is None for peer in peers):
        return None, None
    relay = np.full(n, -1, dtype=np.intp)
    for i, peer in enumerate(peers):
        r = peer.relay
        if r is None:
            continue
        if not 0 <= r < n:
            raise ValueError(f"peers[{i}].relay = {r}: not a member index in [0, {n})")
        if r == i:
            raise ValueError(f"peers[{i}].relay = {r}: a peer cannot relay itself")
        if peers[r].client_mode:
            raise ValueError(f"peers[{i}].relay = {r}: member {r} is in client mode and cannot relay")
        if peers[r].relay is not None:
            raise ValueError(
                f"peers[{i}].relay = {r}: member {r} is itself relayed (by {peers[r].relay}); relays of "
                "relays are not supported"
            )
        relay[i] = int(r)
    cap = np.array(
        [math.inf if peer.relay_capacity_bps is None else peer.relay_capacity_bps / scale for peer in peers]
    )
    return relay, cap


def _is_index(value: object, n: int) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and 0 <= int(value) < n


def _numel(numel: int | None, gradient_bytes: float) -> int:
    if numel is None:
        return int(gradient_bytes) // 4
    if isinstance(numel, bool) or not isinstance(numel, int | np.integer) or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}")
    return int(numel)


def _forced(p: Problem, compute: Sequence[bool] | None, fractions: Floats, numel: int, method: str) -> Plan:
    if compute is None:
        c = p.s > 0
    else:
        c = np.array([bool(v) for v in compute], dtype=bool)
        if len(c) != p.n or not c.any():
            raise ValueError(f"compute must name at least one of the {p.n} peers, got {list(compute)!r}")
    return _plan(p, c, fractions, forced_rate(p, c, fractions), numel, method)


def _plan(
    p: Problem, compute: Bools, fractions: Floats, total: float, numel: int, method: str, gap: float = 0.0
) -> Plan:
    compute_rate = float(p.s[compute].sum()) / p.batch
    comm_rate = total / p.size
    return Plan(
        compute=tuple(bool(v) for v in compute),
        fractions=tuple(float(v) for v in fractions),
        slices=tuple(largest_remainder(fractions.tolist(), numel)),
        steps_per_second=min(compute_rate, comm_rate),
        averaging_seconds=0.0 if math.isinf(total) else math.inf if total == 0.0 else p.size / total,
        compute_rate=compute_rate,
        comm_rate=comm_rate,
        method=method,
        gap=gap,
    )
