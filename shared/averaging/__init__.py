"""Gradient averaging (DESIGN §2; seed 000 §3.2): pure planning and arithmetic cores plus trio services.

Modules:
    load_balance         the adaptive-averaging program (DeDLOC eq. (1)): who computes, what each peer
                         aggregates, integer slices, predicted steps/s; all-reduce and parameter-server
                         baselines under the same model
    load_balance_model   its traffic model for a fixed compute set: closed form and the HiGHS rate LP
    load_balance_search  its exact compute-set search: certified bounds, fixed-size MILP
    partition            (planned) split a flat gradient into aggregator slices and wire-sized parts
    reducer              (planned) weighted accumulation of parts, completeness and banned senders
    compression          (planned) codecs: none, fp16, 8-bit blockwise
    matchmaking          (planned) trio: form a group through DHT keys and deadlines
    allreduce            (planned) trio: run the LP-weighted butterfly all-reduce for one group
    deadlines            the stall timeout that ends a round's wait for a member that makes no progress

Everything but ``matchmaking`` and ``allreduce`` is pure: no trio, no sockets, no torch.
"""

from __future__ import annotations

from .load_balance import PeerSpec as PeerSpec
from .load_balance import Plan as Plan
from .load_balance import largest_remainder as largest_remainder
from .load_balance import plan_all_reduce as plan_all_reduce
from .load_balance import plan_averaging as plan_averaging
from .load_balance import plan_parameter_server as plan_parameter_server

__all__ = [
    "PeerSpec",
    "Plan",
    "largest_remainder",
    "plan_all_reduce",
    "plan_averaging",
    "plan_parameter_server",
]
