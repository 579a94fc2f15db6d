"""The volunteer's Prometheus metrics: ``volunteer join --metrics-listen HOST:PORT`` serves them at
``http://HOST:PORT/metrics`` (text format 0.0.4, :mod:`shared.prometheus`; the server is
:mod:`shared.metrics_server`, run in the daemon's nursery). Off unless asked for.

**What.** The numbers the panel and ``status.json`` show, under the ``dedloc_volunteer_`` prefix, in base
units, ``_total`` on counters:

=============================================  =======  ===============================================
family                                         type     from
=============================================  =======  ===============================================
``dedloc_volunteer_info{run_id,peer_id,role,   gauge 1  who this daemon is; role: trainer, aggregator
version}``                                              (``--aux``) or member (a run without a spec)
``dedloc_volunteer_state{state}``              gauge 1  the daemon's activity (training, paused, ...)
``dedloc_volunteer_paused``                    gauge    1 while paused (by hand or by a rule), else 0
``dedloc_volunteer_step``                      gauge    the global step of our parameters (can jump:
                                                        a re-sync loads the run's newer state)
``dedloc_volunteer_steps_total``               counter  steps this process took part in (one line each
                                                        in ``steps.jsonl``)
``dedloc_volunteer_samples_total``             counter  samples this machine computed gradients on
``dedloc_volunteer_samples_per_second``        gauge    this machine's measured throughput
``dedloc_volunteer_averaging_rounds_total``    counter  averaging rounds that finished
``dedloc_volunteer_averaging_failures_total``  counter  averaging attempts that failed
``dedloc_volunteer_last_averaging_seconds``    gauge    how long the last finished round took
``dedloc_volunteer_reports_sent_total``        counter  contribution reports the backbone took
``dedloc_volunteer_reports_pending``           gauge    reports queued, not yet taken
``dedloc_volunteer_network_sent_bytes_total``  counter  bytes this node sent (all connections)
``dedloc_volunteer_network_received_bytes_``   counter  bytes it received
``total``
``dedloc_volunteer_peers_connected``           gauge    peers with an open connection
``dedloc_volunteer_connections{kind}``         gauge    those connections by kind (direct, relayed,
                                                        punched)
``dedloc_volunteer_run_members_online``        gauge    the run's members whose presence is fresh
``dedloc_volunteer_reachability{mode}``        gauge    1 for the mode the reachability check found
                                                        (direct, relayed, client, unchecked), 0 else
``dedloc_volunteer_relay_slots``               gauge    relay reservations offered (``--relay``)
``dedloc_volunteer_relay_reservations``        gauge    of which held now
``dedloc_volunteer_rpc_latency_seconds``       gauge    median round trip of recent DHT pings
``dedloc_volunteer_dht_routing_table_size``    gauge    contacts in our DHT routing table
``dedloc_volunteer_tolerated_failures_total    counter  failures survived, by where they happened
{site}``
``dedloc_volunteer_uptime_seconds``            gauge    seconds since the node started
=============================================  =======  ===============================================

The training families appear once a training session measured something (not for ``--aux`` or a plain
member). **Counters survive pauses**: a pause ends the training session (its optimizer and statistics go
with it), so the daemon adds each finished session's counts into :class:`TrainingNumbers` it keeps
(:meth:`TrainingNumbers.then`), and the page shows those plus the running session's.

**Who may read it.** The page names this peer, its run and its traffic: nothing secret (the run's DHT
knows as much), but nothing for strangers either. So a bare port, or no host, means ``127.0.0.1``, and a
non-loopback host is served only when given explicitly, with a warning in the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.node import NodeStatus
from shared.prometheus import Family, Sample

__all__ = ["REACHABILITY_MODES", "TrainingNumbers", "session_numbers", "volunteer_families"]

P = "dedloc_volunteer_"
REACHABILITY_MODES = ("direct", "relayed", "client", "unchecked")


@dataclass(frozen=True)
class TrainingNumbers:
    """What training sessions measured: counters (summed over sessions) and the newest gauges."""

    step: int | None = None
    steps: int = 0
    samples: int = 0
    samples_per_second: float | None = None
    rounds: int = 0
    failed_rounds: int = 0
    last_round_seconds: float | None = None
    reports_sent: int = 0
    reports_pending: int = 0
    measured: bool = False  # a session ran (else the training families are left out)

    def then(self, later: TrainingNumbers | None) -> TrainingNumbers:
        """These numbers followed by a later session's: counters add up, gauges are the later ones
        (where it has them)."""
        if later is None:
            return self
        return TrainingNumbers(
            step=later.step if later.step is not None else self.step,
            steps=self.steps + later.steps,
            samples=self.samples + later.samples,
            samples_per_second=later.samples_per_second
            if later.samples_per_second is not None
            else self.samples_per_second,
            rounds=self.rounds + later.rounds,
            failed_rounds=self.failed_rounds + later.failed_rounds,
            last_round_seconds=later.last_round_seconds
            if later.last_round_seconds is not None
            else self.last_round_seconds,
            reports_sent=self.reports_sent + later.reports_sent,
            reports_pending=later.reports_pending,
            measured=self.measured or later.measured,
        )


def session_numbers(session: Any) -> TrainingNumbers | None:
    """A :class:`volunteer.session.TrainingSession`'s numbers so far (None before its optimizer exists)."""
    collab = getattr(session, "collab", None)
    if collab is None:
        return None
    step_stats = collab.mode.stats
    reporter = getattr(session, "reporter", None)
    return TrainingNumbers(
        step=collab.trainer.step,
        steps=getattr(session, "steps_taken", 0),
        samples=collab.stats.samples_total,
        samples_per_second=collab.stats.local_sps or collab.samples_per_second or None,
        rounds=step_stats.rounds,
        failed_rounds=step_stats.failed_rounds,
        last_round_seconds=step_stats.last_round_seconds,
        reports_sent=0 if reporter is None else reporter.sent,
        reports_pending=0 if reporter is None else reporter.pending,
        measured=True,
    )


def _one(
    name: str, kind: str, help_text: str, value: float | None, labels: Mapping[str, str] | None = None
) -> Family:
    samples = [] if value is None else [Sample(float(value), dict(labels or {}))]
    return Family(P + name, kind, help_text, samples)  # type: ignore[arg-type]


def volunteer_families(
    node: NodeStatus,
    training: TrainingNumbers,
    *,
    role: str,
    state: str,
    paused: bool,
    version: str,
) -> list[Family]:
    """The volunteer's metric families (module docstring) from its node's status and training numbers."""
    families = [
        _one(
            "info",
            "gauge",
            "This volunteer: its run, peer id, role (trainer, aggregator, member) and dedloc version.",
            1,
            {"run_id": node.run_id, "peer_id": node.peer_id, "role": role, "version": version},
        ),
        _one("state", "gauge", "What the daemon does now (1 for its current state).", 1, {"state": state}),
        _one("paused", "gauge", "1 while training is paused (by hand or by a rule), else 0.", int(paused)),
    ]
    if training.measured:
        families += [
            _one("step", "gauge", "The global step of this volunteer's parameters.", training.step),
            _one("steps_total", "counter", "Steps this process took part in.", training.steps),
            _one("samples_total", "counter", "Samples this machine computed gradients on.", training.samples),
            _one(
                "samples_per_second",
                "gauge",
                "This machine's measured training throughput.",
                training.samples_per_second,
            ),
            _one("averaging_rounds_total", "counter", "Averaging rounds that finished.", training.rounds),
            _one(
                "averaging_failures_total",
                "counter",
                "Averaging attempts that failed.",
                training.failed_rounds,
            ),
            _one(
                "last_averaging_seconds",
                "gauge",
                "How long the last finished averaging round took.",
                training.last_round_seconds,
            ),
            _one(
                "reports_sent_total",
                "counter",
                "Contribution reports the backbone took.",
                training.reports_sent,
            ),
            _one("reports_pending", "gauge", "Contribution reports not yet taken.", training.reports_pending),
        ]
    families += [
        _one("network_sent_bytes_total", "counter", "Bytes this node sent to its peers.", node.bytes_sent),
        _one(
            "network_received_bytes_total",
            "counter",
            "Bytes this node received from its peers.",
            node.bytes_received,
        ),
        Family(
            P + "rpc_sent_bytes_total",
            "counter",
            "Bytes of the RPC messages this node sent, by message kind (the rest of the bytes sent is bulk).",
            [Sample(float(n), {"kind": kind}) for kind, n in sorted(node.rpc_sent_by_kind.items())],
        ),
        _one("peers_connected", "gauge", "Peers with an open connection to this node.", node.connected_peers),
        Family(
            P + "connections",
            "gauge",
            "Open RPC connections by kind (direct, relayed, punched).",
            [Sample(float(n), {"kind": kind}) for kind, n in sorted(node.links.items())],
        ),
        _one(
            "run_members_online", "gauge", "The run's members whose presence is fresh.", node.members_online
        ),
        Family(
            P + "reachability",
            "gauge",
            "1 for the reachability mode the check found (direct, relayed, client, unchecked), else 0.",
            []
            if not node.reachability
            else [
                Sample(float(node.reachability == mode), {"mode": mode})
                for mode in sorted({*REACHABILITY_MODES, node.reachability})
            ],
        ),
        _one("relay_slots", "gauge", "Relay reservations this node offers (--relay).", node.relay_slots),
        _one(
            "relay_reservations",
            "gauge",
            "Relay reservations held at this node now.",
            node.relay_reservations,
        ),
        _one(
            "rpc_latency_seconds",
            "gauge",
            "Median round trip of recent DHT pings.",
            None if node.rpc_latency_ms is None else node.rpc_latency_ms / 1e3,
        ),
        _one(
            "dht_routing_table_size",
            "gauge",
            "Contacts in this node's DHT routing table.",
            node.routing_table_size,
        ),
        Family(
            P + "tolerated_failures_total",
            "counter",
            "Failures this node survived, by where they happened.",
            [Sample(float(n), {"site": site}) for site, n in sorted(node.tolerated.items())],
        ),
        _one("uptime_seconds", "gauge", "Seconds since this node started.", node.uptime_s),
    ]
    return families
