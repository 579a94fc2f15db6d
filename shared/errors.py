"""The project's exception hierarchy, in one place.

::

    ProjectError                    (protocols.errors; root of everything raised on purpose)
    ├── ConfigError                 bad user input: flags, files, addresses, data dirs
    ├── ProtocolError               (protocols.errors) a frame or message violates the wire protocol
    │   └── WrongVersion            (protocols.errors) the peer speaks another protocol version
    ├── RemoteError                 the peer answered with an error code
    │   ├── Overloaded              ... code OVERLOADED: retry later
    │   └── AccessDenied            ... an authentication code: the peer does not accept our credentials
    ├── PeerUnavailable             could not reach the peer, or the connection broke / timed out
    ├── HandshakeError              TLS or identity handshake failed
    │   ├── PeerIdMismatch          the certificate's key is not the peer id we dialed
    │   ├── BadIdentityProof        the dialer's in-band proof did not verify
    │   └── WrongRun                the peer belongs to another training run
    ├── AuthError                   we refuse a request or answer: bad/expired/foreign token, replay, …
    ├── RecordRejected              a DHT record failed validation (signature, expiry, validator)
    ├── DiscoveryError              no backbone for the run could be found
    ├── AdmissionError              the run's backbones do not admit us (no/bad invite, removed user)
    ├── StateError                  a training-state blob is malformed or does not match its digest
    └── StateUnavailable            no peer could provide the announced training state

Rules: translate foreign exceptions at one boundary with ``raise … from exc``; never swallow
``trio.Cancelled``; "peer did not answer" is :class:`PeerUnavailable`, which callers must handle.
"""

from __future__ import annotations

from protocols.codes import ErrorCode
from protocols.errors import ProjectError, ProtocolError

__all__ = [
    "AUTH_CODES",
    "AccessDenied",
    "AdmissionError",
    "AuthError",
    "BadIdentityProof",
    "ConfigError",
    "DiscoveryError",
    "HandshakeError",
    "Overloaded",
    "PeerIdMismatch",
    "PeerUnavailable",
    "ProjectError",
    "ProtocolError",
    "RecordRejected",
    "RemoteError",
    "StateError",
    "StateUnavailable",
    "WrongRun",
    "remote_error",
]


class ConfigError(ProjectError):
    """The user gave something unusable: a bad flag value, address, or data file. The message says which."""


class RemoteError(ProjectError):
    """The peer understood the request and answered with an error ``code`` (see ``protocols.codes``)."""

    def __init__(self, code: ErrorCode | int, message: str) -> None:
        try:
            self.code: ErrorCode | int = ErrorCode(code)
        except ValueError:
            self.code = code
        name = self.code.name if isinstance(self.code, ErrorCode) else str(code)
        super().__init__(f"{name}: {message}" if message else name)
        self.remote_message = message


class Overloaded(RemoteError):
    """The peer has too many of our requests in flight (``OVERLOADED``); back off and retry."""


class AccessDenied(RemoteError):
    """The peer refused our credentials (``BAD_TOKEN`` … ``REVOKED``, ``UNAUTHENTICATED``)."""


class AuthError(ProjectError):
    """We refuse a request (or an answer) on authentication grounds; ``code`` says which check failed."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerUnavailable(ProjectError):
    """The peer could not be dialed, the connection broke, or it did not answer before the deadline."""


class HandshakeError(ProjectError):
    """The TLS or identity handshake with a peer failed; no connection was established."""


class PeerIdMismatch(HandshakeError):
    """The listener's certificate carries a key whose peer id differs from the one we dialed."""


class BadIdentityProof(HandshakeError):
    """The dialer's in-band identity proof did not verify against the key it presented."""


class WrongRun(HandshakeError):
    """The peer serves another training run than ours."""


class RecordRejected(ProjectError):
    """A DHT record failed validation: bad signature, expiry in the past or too far ahead, or a validator
    refused it."""


class DiscoveryError(ProjectError):
    """No backbone serving the requested run could be found (mDNS or initial peers)."""


AUTH_CODES = frozenset(
    {
        ErrorCode.UNAUTHENTICATED,
        ErrorCode.BAD_TOKEN,
        ErrorCode.WRONG_RUN_TOKEN,
        ErrorCode.TOKEN_EXPIRED,
        ErrorCode.TOKEN_PEER,
        ErrorCode.CLOCK_SKEW,
        ErrorCode.BAD_SIGNATURE,
        ErrorCode.REPLAYED,
        ErrorCode.REVOKED,
    }
)


class AdmissionError(ProjectError):
    """The run's backbones do not admit this peer: no invite, a rejected invite, or a removed user."""


class StateError(ProjectError):
    """A training-state blob (a safetensors file, see :mod:`shared.state.blob`) is malformed, is not of the
    project's state format, or its bytes do not hash to the digest they were announced with."""


class StateUnavailable(ProjectError):
    """No source could provide the requested training state: each one was unreachable, refused, or served
    bytes that did not match the announced digest. ``reasons`` lists what happened with each."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()) -> None:
        super().__init__(f"{message}: {'; '.join(reasons)}" if reasons else message)
        self.reasons = reasons


def remote_error(code: int, message: str) -> RemoteError:
    """Map a wire error code to the most specific exception class."""
    if code == ErrorCode.OVERLOADED:
        return Overloaded(code, message)
    if code in AUTH_CODES:
        return AccessDenied(code, message)
    return RemoteError(code, message)
