"""Error codes sent on the wire. Outcomes are codes, never free-form strings; the message beside a code
is for humans and logs only."""

from __future__ import annotations

import enum

__all__ = ["ErrorCode"]


class ErrorCode(enum.IntEnum):
    BAD_REQUEST = 1  # "Your message decoded but a field is invalid, or it could not be decoded at all."
    UNKNOWN_KIND = 2  # "I have no handler for that message kind."
    WRONG_VERSION = 3  # "I speak another protocol version."
    TOO_LARGE = 4  # "Your frame exceeds my size limit for that kind."
    INTERNAL = 5  # "My handler failed; not your fault."
    OVERLOADED = 6  # "Too many of your requests are in flight; retry later."
    WRONG_RUN = 7  # "I belong to another training run."
    BAD_RECORD = 8  # "The DHT record failed validation (signature, expiry, validator)."
    NOT_FOUND = 9  # "Nothing stored under that name."
    BAD_IDENTITY = 10  # "Your identity proof did not verify."
    UNAUTHENTICATED = 11  # "You must present valid credentials for this."
    FORBIDDEN = 12  # "Your credentials do not allow this."
    SHUTTING_DOWN = 13  # "I am leaving; ask someone else."
    BAD_TOKEN = 14  # "Your access token is malformed or not signed by this run's authority."
    WRONG_RUN_TOKEN = 15  # "Your access token was issued for another run."
    TOKEN_EXPIRED = 16  # "Your access token has expired; refresh it."
    TOKEN_PEER = 17  # "Your access token belongs to another peer than the one on this connection."
    CLOCK_SKEW = 18  # "Your request's timestamp is too far from my clock."
    BAD_SIGNATURE = 19  # "Your request's signature does not verify."
    REPLAYED = 20  # "I have seen this request's nonce already."
    REVOKED = 21  # "Your user has been removed from this run."
    PENDING = 22  # "Not yet: I am still receiving it; ask again shortly."
