"""SWARM pipeline mode (DESIGN D9 ``swarm``; seed 004 §3.2, App. C-D; seed 002 §3; issue 17): pure cores.

Modules:
    wiring          stochastic wiring: interleaved weighted round-robin over a stage's servers from the
                    response times one trainer observes, bans until re-announcement, "busy" deferrals
    answers         which answers of a stage server a trainer refuses (shape, non-finite, absurd scale)
    rebalance       adaptive rebalancing: which peers move between stages, where newcomers go
    placement_cost  the communication cost of a placement (seed 002 §2-3.3: data-parallel groups,
                    bottleneck matchings between adjacent stages, open-loop TSP order)
    scheduler       initial placement: which peers serve each stage and the pipeline order, from measured
                    pairwise delay and bandwidth, by the hybrid genetic search (seed 002 §3.4)

    directory       who serves each stage: the servers' signed DHT records (:mod:`protocols.swarm`)

Everything here but ``directory`` (a DHT read) is pure: no trio, no sockets, no torch.
"""

from __future__ import annotations

__all__: list[str] = []
