"""A ledger with what the dashboard shows, written through the store's own methods (the ones the API's
join, heartbeat and capabilities endpoints and the step tracker call): steps with losses, two admitted
users -- one named like an XSS payload, with a device name like one -- with open sessions and
capabilities, and a strict parser of the Prometheus text format for the metrics tests."""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass

from backbone.ledger import LedgerStore
from protocols.ledger import Capabilities
from shared.auth.keys import Identity

HOSTILE_USER = "<img src=x onerror=alert(1)>"
HOSTILE_DEVICE = '<script>alert("device")</script>'


@dataclass(frozen=True)
class Seeded:
    hostile_peer: str
    bob_peer: str
    steps: int


def admit(store: LedgerStore, username: str, now: float) -> str:
    """Allowlist ``username`` and redeem an invite with a new key: its peer id."""
    store.add_user(username, now=now)
    secret = store.create_invite(username, now=now)
    identity = Identity.generate()
    store.redeem_invite(secret, identity.peer_id, identity.public_key_bytes, now=now)
    return identity.peer_id


def record_steps(store: LedgerStore, first: int, last: int, start: float) -> None:
    """Steps ``first..last``, one every 2 s from ``start``, 32 samples, loss falling with the step."""
    for step in range(first, last + 1):
        store.record_step(
            step,
            finished_at=start + 2.0 * step,
            loss=4.0 / math.sqrt(step),
            samples=32,
            peers=2,
            target_batch=32,
        )


def seed(store: LedgerStore, now: float, steps: int = 12) -> Seeded:
    hostile = admit(store, HOSTILE_USER, now)
    bob = admit(store, "bob", now)
    for peer, device, rate in ((hostile, HOSTILE_DEVICE, 12.5), (bob, "cpu (Test CPU)", 3.4)):
        store.session_heartbeat(peer, secrets.token_hex(16), "192.0.2.7", now=now)
        store.update_capabilities(peer, Capabilities(rate, 2e6, 8e6, device), now=now)
    record_steps(store, 1, steps, now - 2.0 * steps - 5)
    return Seeded(hostile, bob, steps)


# -------------------------------------------------------------------- Prometheus text format 0.0.4

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_metrics(text: str) -> dict[str, dict[str, object]]:
    """Strictly parse exposition text: ``{name: {"type", "help", "samples": [(labels, value)]}}``.

    Every family must have HELP then TYPE before its samples, every sample line must belong to the
    family last declared, label values must be correctly escaped, values must parse as floats."""
    assert text.endswith("\n"), "the exposition ends with a line feed"
    families: dict[str, dict[str, object]] = {}
    current: str | None = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name), line
            assert name not in families, f"{name} declared twice"
            families[name] = {"help": re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], help_text)}
            current = name
            continue
        if line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and "type" not in families[name], f"TYPE without its HELP: {line}"
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            families[name]["type"] = kind
            families[name]["samples"] = []
            continue
        assert not line.startswith("#"), f"unexpected comment {line!r}"
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, _, body, value = match.groups()
        assert name == current and "type" in families[name], f"sample of an undeclared family: {line!r}"
        labels: dict[str, str] = {}
        rest = body or ""
        while rest:
            label = _LABEL.match(rest)
            assert label, f"bad labels in {line!r}"
            key, raw, _sep = label.groups()
            assert key not in labels
            labels[key] = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m[0]], raw)
            rest = rest[label.end() :]
        number = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(value)
        samples = families[name]["samples"]
        assert isinstance(samples, list)
        samples.append((labels, number if number is not None else float(value)))
    return families
