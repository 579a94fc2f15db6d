"""The SQL contribution ledger and allowlist store of a backbone (DESIGN D5; issue 3 items 2 and 6).

Modules:
    accounting  **pure**: verify a signed contribution report (verify_report) and judge its plausibility
                against the peer's measured capabilities (assess -> Assessment); ReportRejected
    store       LedgerStore, the only module with SQL I/O: allowlist (users, invites, peers), sessions,
                reports (exactly once per (peer_id, seq)), steps, leaderboard; SQLite (WAL) or PostgreSQL
    views       the frozen values queries return: UserSummary, PeerSeen, LeaderboardRow, StoredReport, StepRow
    schema      the tables (SQLAlchemy 2 typed declarative), schema_version and how to migrate
    errors      LedgerError, UnknownUser, UnknownPeer, InviteRejected

Wire types (ContributionReport, SignedReport, Capabilities) live in :mod:`protocols.ledger`.
"""

from __future__ import annotations

from .accounting import Assessment as Assessment
from .accounting import ReportRejected as ReportRejected
from .accounting import assess as assess
from .accounting import verify_report as verify_report
from .errors import InviteRejected as InviteRejected
from .errors import LedgerError as LedgerError
from .errors import UnknownPeer as UnknownPeer
from .errors import UnknownUser as UnknownUser
from .store import LedgerStore as LedgerStore
from .views import LeaderboardRow as LeaderboardRow
from .views import PeerSeen as PeerSeen
from .views import StepRow as StepRow
from .views import StoredReport as StoredReport
from .views import UserSummary as UserSummary

__all__ = [
    "Assessment",
    "InviteRejected",
    "LeaderboardRow",
    "LedgerError",
    "LedgerStore",
    "PeerSeen",
    "ReportRejected",
    "StepRow",
    "StoredReport",
    "UnknownPeer",
    "UnknownUser",
    "UserSummary",
    "assess",
    "verify_report",
]
