"""SWARM pipeline mode (DESIGN D9 ``swarm``; seed 004 §3.2, App. C-D; seed 002 §3).

Modules:
    placement_cost  the communication cost of a placement (seed 002 §2-3.3: data-parallel groups,
                    bottleneck matchings between adjacent stages, open-loop TSP order); pure
    scheduler       initial placement: which peers serve each stage and the pipeline order, from measured
                    pairwise delay and bandwidth, by the hybrid genetic search (seed 002 §3.4); pure
"""

from __future__ import annotations

__all__: list[str] = []
