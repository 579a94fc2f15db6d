"""Errors of the ledger's storage side (the pure side's :class:`~backbone.ledger.accounting.ReportRejected`
lives with the checks that raise it).

::

    ProjectError
    ├── LedgerError              the database could not be opened or a statement failed
    │   ├── UnknownUser          the named user does not exist (or is revoked, where it must be active)
    │   └── UnknownPeer          the peer id never redeemed an invite
    └── InviteRejected(reason)   an invite code cannot admit anyone: unknown, expired, revoked, used up
"""

from __future__ import annotations

from typing import Literal

from shared.errors import ProjectError

__all__ = ["InviteRejected", "InviteRejectedReason", "LedgerError", "UnknownPeer", "UnknownUser"]

InviteRejectedReason = Literal["unknown", "expired", "revoked user", "revoked invite", "used up"]


class LedgerError(ProjectError):
    """The ledger database could not be opened (bad URL, server down, newer schema) or a statement
    failed. The message names the database without its password."""


class UnknownUser(LedgerError):
    """An allowlist operation named a user that does not exist, or that is revoked where the operation
    needs an active one (creating an invite)."""


class UnknownPeer(LedgerError):
    """A peer operation named a peer id that never redeemed an invite, so it belongs to no user."""


_MESSAGES: dict[InviteRejectedReason, str] = {
    "unknown": "the invite is not one of this run's",
    "expired": "the invite has expired",
    "revoked user": "the invite's user has been removed from the run",
    "revoked invite": "the invite has been revoked",
    "used up": "the invite has been used by as many machines as it allows",
}


class InviteRejected(ProjectError):
    """An invite code was refused. ``reason`` is one of :data:`InviteRejectedReason`; answer the joining
    volunteer with it (there is nothing secret in it). The message says what happened to the invite
    (``"the invite has expired"``), without a prefix: callers add their own context once."""

    def __init__(self, reason: InviteRejectedReason) -> None:
        super().__init__(_MESSAGES[reason])
        self.reason: InviteRejectedReason = reason
