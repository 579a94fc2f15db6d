"""SWARM pipeline mode (DESIGN D9 ``swarm``; seed 004 §3.2, App. C-D; issue 17): pure cores.

Modules:
    wiring     stochastic wiring: interleaved weighted round-robin over a stage's servers from the response
               times one trainer observes, bans until re-announcement, "busy" deferrals
    answers    which answers of a stage server a trainer refuses (shape, non-finite, absurd scale)
    rebalance  adaptive rebalancing: which peers move between stages, where newcomers go

Everything here is pure: no trio, no sockets, no torch.
"""

from __future__ import annotations

__all__: list[str] = []
