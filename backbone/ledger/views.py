"""What the ledger's queries return: plain frozen values (``dataclasses.asdict`` gives JSON-ready dicts for
all but :class:`StoredReport`, which carries the signed bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from protocols.ledger import SignedReport

__all__ = [
    "FlaggedReport",
    "LeaderboardRow",
    "PeerSeen",
    "ReportStatus",
    "SessionRow",
    "StepRow",
    "StoredReport",
    "UserSummary",
    "Verdict",
]

ReportStatus = Literal["credited", "flagged"]


class PeerSeen(NamedTuple):
    """One machine of a user and when the backbone last heard from it (unix seconds)."""

    peer_id: str
    last_seen: float


@dataclass(frozen=True)
class UserSummary:
    """One allowlisted user (``revoked_at`` is set once removed) and its machines."""

    username: str
    note: str | None
    created_at: float
    revoked_at: float | None
    #: the user's machines, most recently seen first
    peers: tuple[PeerSeen, ...]


@dataclass(frozen=True)
class SessionRow:
    """One volunteer process in the run: open while ``ended_at`` is None; ``end_reason`` is ``leave``
    (it said so), ``replaced`` (a newer process of the same peer) or ``timeout`` (silent too long)."""

    peer_id: str
    token: str | None
    address: str
    started_at: float
    last_seen_at: float
    ended_at: float | None
    end_reason: str | None


@dataclass(frozen=True)
class LeaderboardRow:
    """One user's credited contribution: what receipts, pull records and relay records backed (see
    :mod:`backbone.ledger.accounting`; ``bytes_relayed``: schema 1's claims in its old rows, and since
    schema 8 what peers of other users received through the user's relays); flagged reports only
    counted in ``flagged_reports``, and why in ``flag_reasons`` (rule code -> reports)."""

    username: str
    samples: int
    compute_hours: float
    bytes_aggregated: int
    bytes_relayed: int
    peers: int
    last_seen: float | None
    flagged_reports: int
    flag_reasons: dict[str, int] = field(default_factory=dict)
    #: receipt weights of steps its peers reported discarded (a fork that did not survive): work done,
    #: shown, not credited (not in ``samples`` nor ``compute_hours``)
    #: swarm bytes sent that peers of other users signed they received (accounting, "Swarm bytes")
    bytes_sent: int = 0
    discarded_samples: int = 0
    #: time its volunteer processes were in the run (their sessions, as the backbones saw them: from the
    #: first heartbeat to the leave, a restart or the last heartbeat). ``compute_hours`` is only the
    #: receipt-backed time spent computing gradients, far less on a small model (waiting for the batch,
    #: averaging and state downloads are not compute)
    online_hours: float = 0.0


@dataclass(frozen=True)
class FlaggedReport:
    """One flagged report: whose, which, its claims, and why (``codes``: the rule codes of
    :mod:`backbone.ledger.accounting`; ``reason``: the full text)."""

    username: str
    peer_id: str
    seq: int
    received_at: float
    interval_start: float
    interval_end: float
    samples: int
    compute_seconds: float
    codes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class StoredReport:
    """A recorded report as kept: the verdict, and the signed bytes for re-verification."""

    seq: int
    global_step: int
    samples: int
    status: ReportStatus
    flag_reason: str | None
    received_at: float
    signed: SignedReport
    credited_samples: float = 0.0
    notes: str | None = None


@dataclass(frozen=True)
class Verdict:
    """What recording a report did: within bounds (``credited``) or flagged (``reason``), what it was
    credited, and which of its receipts / pull records did not count (``notes``, ``"code: n; ..."``)."""

    credited: bool
    reason: str | None
    samples: float
    compute_seconds: float
    bytes_aggregated: float
    notes: str | None
    bytes_relayed: float = 0.0
    #: swarm bytes sent (accounting, "Swarm bytes")
    bytes_sent: float = 0.0


@dataclass(frozen=True)
class StepRow:
    """One global step the collaboration took: its batch (``samples``: what the peers at the step had
    accumulated, as a backbone saw it; for a step only receipts evidenced, the sum of their weights),
    ``peers`` and ``loss`` (None if unknown or not finite: a step only receipts evidenced has none)."""

    global_step: int
    finished_at: float
    loss: float | None
    samples: int
    peers: int
    #: how the ledger knows it was taken: ``tracker``, ``receipts`` or ``legacy`` (schema version <= 2)
    source: str = "tracker"
    #: the run's target batch when it was recorded (None: unknown; see ``backbone.ledger.schema``)
    target_batch: int | None = None
    #: the held-out loss of the step's parameters (None: not evaluated; backbone.ledger.evaluations)
    eval_loss: float | None = None
    #: users whose evaluators agree on ``eval_loss`` (below 2: single-sourced, not cross-checked)
    eval_users: int = 0
