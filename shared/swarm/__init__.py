"""SWARM pipeline mode (DESIGN D9 ``swarm``; seed 004 §3.2, App. C-D; seed 002 §3).

Modules:
    scheduler    initial placement: which peers serve each stage and the pipeline order, from measured
                 pairwise delay and bandwidth (seed 002 §3.2-3.4); pure
"""

from __future__ import annotations

__all__: list[str] = []
