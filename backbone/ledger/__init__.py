"""The SQL contribution ledger and allowlist store of a backbone (DESIGN D5; issue 3 items 2 and 6).

Modules:
    accounting  **pure**: verify a signed contribution report (verify_report), its bounds (assess ->
                Assessment), its receipts (verify_receipt), what it is credited (credit_due), which
                capabilities are believed; the design of receipt-backed credit is its docstring
    evaluations **pure**: verify a signed held-out evaluation (open_evaluation, check_evaluation), a step's
                cross-checked held-out loss from its claims (summarize -> StepEvaluation)
    store       LedgerStore, the only module with SQL I/O: allowlist (users, invites, peers), sessions,
                reports (exactly once per (peer_id, seq)), steps, leaderboard; SQLite (WAL) or PostgreSQL
    views       the frozen values queries return: UserSummary, PeerSeen, LeaderboardRow, StoredReport,
                StepRow, SessionRow, Verdict
    schema      the tables (SQLAlchemy 2 typed declarative), schema_version and how to migrate
    errors      LedgerError, UnknownUser, UnknownPeer, InviteRejected

Wire types (ContributionReport, SignedReport, Capabilities) live in :mod:`protocols.ledger`.
"""

from __future__ import annotations

from .accounting import Assessment as Assessment
from .accounting import CapabilitiesRejected as CapabilitiesRejected
from .accounting import ReportRejected as ReportRejected
from .accounting import assess as assess
from .accounting import verify_report as verify_report
from .errors import InviteRejected as InviteRejected
from .errors import LedgerError as LedgerError
from .errors import UnknownPeer as UnknownPeer
from .errors import UnknownUser as UnknownUser
from .evaluations import EvaluationRejected as EvaluationRejected
from .evaluations import StepEvaluation as StepEvaluation
from .evaluations import check_evaluation as check_evaluation
from .evaluations import open_evaluation as open_evaluation
from .store import BACKBONE_USERNAME as BACKBONE_USERNAME
from .store import RESERVED_USERNAMES as RESERVED_USERNAMES
from .store import LedgerStore as LedgerStore
from .views import FlaggedReport as FlaggedReport
from .views import LeaderboardRow as LeaderboardRow
from .views import PeerSeen as PeerSeen
from .views import SessionRow as SessionRow
from .views import StepRow as StepRow
from .views import StoredReport as StoredReport
from .views import UserSummary as UserSummary
from .views import Verdict as Verdict

__all__ = [
    "BACKBONE_USERNAME",
    "RESERVED_USERNAMES",
    "Assessment",
    "CapabilitiesRejected",
    "EvaluationRejected",
    "FlaggedReport",
    "InviteRejected",
    "LeaderboardRow",
    "LedgerError",
    "LedgerStore",
    "PeerSeen",
    "ReportRejected",
    "SessionRow",
    "StepEvaluation",
    "StepRow",
    "StoredReport",
    "UnknownPeer",
    "UnknownUser",
    "UserSummary",
    "Verdict",
    "assess",
    "check_evaluation",
    "open_evaluation",
    "verify_report",
]
