"""SWARM pipeline parallelism (issue 17; seed 004; DESIGN D9): stage servers and the trainers' client.

Modules:
    stage_trainer  what a stage server computes (plain torch): forward without a graph, backward by
                   recomputing, gradient sums accumulated toward the stage's next step, non-finite
                   results refused whole; the batch mode's trainer for one stage
    server         the ``swarm.stage`` bulk handler: bounds checked before reading, a bounded queue answering
                   "busy", hostile requests refused; the server's DHT announcement
    client         a trainer's side: each micro-batch through one server per stage, routed by stochastic
                   wiring, rerouted on failures and refused answers

The wire is :mod:`protocols.swarm`.
"""

from __future__ import annotations

__all__: list[str] = []
