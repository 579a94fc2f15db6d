"""The contacts a node remembers across restarts: ``dht-contacts.json`` in its data dir.

A node killed and restarted on the same data dir would otherwise know nobody but its initial peers, and a
backbone usually has none: it knew 0 peers until some volunteer happened to call it, and the run split into
two DHTs. So a node writes the contacts of its routing table (peer id and dialable addresses, nothing
else) to this file every few seconds when the table changed, and pings them again when it starts
(:meth:`shared.dht.node.DHTNode.run`).

The file is the node's own, but it is still read as a stranger's bytes could be (DESIGN D10): it is read
only up to :data:`MAX_FILE_BYTES`, decoded with the wire's own bounds (a :class:`~protocols.dht.NodeInfo`
per contact, at most :data:`MAX_SAVED_CONTACTS`), entries that are not usable contacts are skipped, and
anything else wrong with the file (garbage, truncated, not JSON, unreadable) is logged once and ignored:
the node starts as if it had no file. Writes are atomic (a temporary file, then ``os.replace``) and the
file is created ``0600``.

:func:`encode_contacts` and :func:`decode_contacts` are pure; :func:`save_contacts` and
:func:`load_contacts` do blocking file I/O (call them through ``trio.to_thread``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import msgspec

from protocols.dht import NodeInfo

from .routing import Contact

__all__ = [
    "CONTACTS_FILE",
    "MAX_FILE_BYTES",
    "MAX_SAVED_CONTACTS",
    "decode_contacts",
    "encode_contacts",
    "load_contacts",
    "save_contacts",
]

logger = logging.getLogger(__name__)

CONTACTS_FILE = "dht-contacts.json"
MAX_SAVED_CONTACTS = 256  # the most recently seen ones; enough to find the network again
MAX_FILE_BYTES = 1024 * 1024  # 256 contacts of 8 addresses of <= 256 chars fit in well under this


class _ContactsFile(msgspec.Struct, frozen=True):
    version: int
    contacts: list[msgspec.Raw]


def encode_contacts(contacts: Iterable[Contact], limit: int = MAX_SAVED_CONTACTS) -> bytes:
    """The file's bytes for the first ``limit`` of ``contacts`` (pass the most valuable first)."""
    infos: list[msgspec.Raw] = []
    for contact in contacts:
        if len(infos) >= limit:
            break
        infos.append(msgspec.Raw(msgspec.json.encode(NodeInfo(contact.peer_id, list(contact.addrs[:8])))))
    return msgspec.json.encode(_ContactsFile(version=1, contacts=infos))


def decode_contacts(data: bytes) -> list[Contact]:
    """The usable contacts in a file's bytes, at most :data:`MAX_SAVED_CONTACTS`, duplicates dropped.

    Raises:
        ValueError: the bytes are not a contacts file at all (too big, not JSON, wrong shape or version).
            A single unusable entry (bad peer id, no dialable address) is skipped instead.
    """
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{len(data)} bytes is more than a contacts file may hold ({MAX_FILE_BYTES})")
    try:
        parsed = msgspec.json.decode(data, type=_ContactsFile)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ValueError(f"not a contacts file: {exc}") from exc
    if parsed.version != 1:
        raise ValueError(f"unknown contacts file version {parsed.version}")
    out: dict[str, Contact] = {}
    for raw in parsed.contacts[:MAX_SAVED_CONTACTS]:
        try:
            contact = Contact.from_info(msgspec.json.decode(raw, type=NodeInfo))
        except (msgspec.DecodeError, ValueError):
            continue
        out.setdefault(contact.peer_id, contact)
    return list(out.values())


def save_contacts(path: Path, contacts: Iterable[Contact], limit: int = MAX_SAVED_CONTACTS) -> None:
    """Atomically replace ``path`` with ``contacts`` (created ``0600``).

    Raises:
        OSError: the file could not be written (the old one, if any, is left as it was).
    """
    data = encode_contacts(contacts, limit)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a temporary file left by a crash
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_contacts(path: Path) -> list[Contact]:
    """The contacts saved in ``path``; ``[]`` if there is no file or it is unusable (logged, never raised)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("ignoring the saved DHT contacts in %s: %s", path, exc)
        return []
    try:
        return decode_contacts(data)
    except ValueError as exc:
        logger.warning("ignoring the saved DHT contacts in %s: %s", path, exc)
        return []
