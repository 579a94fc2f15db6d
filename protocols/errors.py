"""The root of the project's exception tree and the one error the wire layer raises.

The full hierarchy (drawn in :mod:`shared.errors`) starts here because ``protocols`` imports nothing of
the project, yet its decoders must raise something the rest of the project can catch by type.
"""

from __future__ import annotations

from .codes import ErrorCode

__all__ = ["ProjectError", "ProtocolError"]


class ProjectError(Exception):
    """Base class of every error this project raises on purpose."""


class ProtocolError(ProjectError):
    """A frame or message violates the wire protocol: malformed, truncated, oversized, of an unknown
    kind or version, or with a field that fails validation.

    ``code`` is what the receiver answers on the wire, so the sender learns *why* it was rejected.
    """

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code
