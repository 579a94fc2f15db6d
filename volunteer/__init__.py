"""The volunteer daemon: ``volunteer join <run-id>`` donates this machine to a training run.

Modules:
    cli       ``volunteer join`` (typer)
    daemon    the volunteer's root nursery: discovery, node, presence, live panel
    capabilities  measured device, samples/s, bandwidth, reachability; publishing them; drift
    evaluation    ``--evaluate``: the held-out loss of every N-th step's parameters, signed, to the ledger
    reporting signed contribution reports, this process's ledger session (heartbeats, leave)
    journal   the reporter's append-only journal in the data dir (what a SIGKILL must not lose)
"""

from __future__ import annotations

__all__: list[str] = []
