"""The root of the project's exception tree and the one error the wire layer raises.

The full hierarchy (drawn in :mod:`shared.errors`) starts here because ``protocols`` imports nothing of
the project, yet its decoders must raise something the rest of the project can catch by type.

**Every decoder of wire input raises only ProtocolError.** msgspec's typed decoders raise more than
``msgspec.DecodeError`` on hostile bytes: ``UnicodeDecodeError`` for a string that is not UTF-8 (a map
key included), ``RecursionError`` for deep nesting, and ``__post_init__`` checks may surface as
``ValueError``/``TypeError``/``OverflowError``. :func:`decode_typed` (and the :func:`wire_decoding`
context manager for code that decodes several things at once) maps every one of
:data:`DECODE_FAILURES` to :class:`ProtocolError`, so no caller has to remember the list.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import msgspec

from .codes import ErrorCode

__all__ = [
    "DECODE_FAILURES",
    "ProjectError",
    "ProtocolError",
    "WrongVersion",
    "decode_typed",
    "wire_decoding",
]

T = TypeVar("T")

#: What decoding untrusted bytes may raise (UnicodeDecodeError is a ValueError; ValidationError a
#: DecodeError). MemoryError is not here: inputs are bounded before they are decoded.
DECODE_FAILURES: tuple[type[Exception], ...] = (
    msgspec.DecodeError,
    ValueError,
    TypeError,
    OverflowError,
    RecursionError,
)


class ProjectError(Exception):
    """Base class of every error this project raises on purpose."""


class ProtocolError(ProjectError):
    """A frame or message violates the wire protocol: malformed, truncated, oversized, of an unknown
    kind or version, or with a field that fails validation.

    ``code`` is what the receiver answers on the wire, so the sender learns *why* it was rejected;
    ``request_id`` is the id of the request the bad frame belonged to, when the envelope was readable
    enough to tell (0 otherwise).
    """

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST, *, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class WrongVersion(ProtocolError):
    """The peer speaks another wire protocol version (code ``WRONG_VERSION``). The message is one line
    a person can act on: a newer peer tells us to upgrade (``upgrade dedloc: this run speaks protocol
    N, you speak M``); an older one is the one that must upgrade. ``theirs`` and ``ours`` are the two
    versions."""

    def __init__(self, theirs: int, ours: int, *, request_id: int = 0) -> None:
        if theirs > ours:
            message = f"upgrade dedloc: this run speaks protocol {theirs}, you speak {ours}"
        else:
            message = (
                f"the peer speaks protocol {theirs}, older than this program's {ours}: it must upgrade "
                f"dedloc (or use a release that speaks {theirs})"
            )
        super().__init__(message, ErrorCode.WRONG_VERSION, request_id=request_id)
        self.theirs = theirs
        self.ours = ours


@contextlib.contextmanager
def wire_decoding(what: str) -> Iterator[None]:
    """Map every decoding failure inside the block to :class:`ProtocolError` (``BAD_REQUEST``).

    Raises:
        ProtocolError: ``malformed <what>: <reason>``.
    """
    try:
        yield
    except DECODE_FAILURES as exc:
        raise ProtocolError(f"malformed {what}: {str(exc)[:200]}") from exc


def decode_typed(decoder: msgspec.msgpack.Decoder[T], data: bytes | bytearray | memoryview, what: str) -> T:
    """``decoder.decode(data)``, with every decoding failure raised as :class:`ProtocolError`.

    Typed decoding is bounded work: msgspec checks each container's declared length against the schema's
    limits before decoding its items, and the input itself is size-checked by the caller.
    """
    with wire_decoding(what):
        return decoder.decode(data)
