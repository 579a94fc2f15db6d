"""Prometheus text exposition (format 0.0.4): the pure rendering both daemons' ``GET /metrics`` use (the
backbone's :mod:`backbone.dashboard`, the volunteer's :mod:`volunteer.metrics`).

**Pure rendering.** :func:`render` turns :class:`Family` values into the text format: a ``# HELP`` and a
``# TYPE`` line per family, then one sample line per label set, ``name{label="value",...} number``. Names
follow Prometheus conventions: the ``dedloc_`` prefix, base units as suffixes (``_seconds``, ``_bytes``),
``_total`` on counters. Label values are escaped as the format says (backslash, double quote and line
feed become ``\\\\``, ``\\"`` and ``\\n``); HELP text escapes backslash and line feed. Numbers are written
with ``repr`` (shortest round-trip), ``+Inf``/``-Inf``/``NaN`` for the non-finite ones.

What each daemon exposes, and why it is safe to, is said where its families are built:
:func:`backbone.dashboard.metric_families` (run-level only, public) and :mod:`volunteer.metrics` (this
machine's own numbers, served on loopback unless asked otherwise).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CONTENT_TYPE", "Family", "Sample", "escape_help", "escape_label", "format_value", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

MetricType = Literal["counter", "gauge"]


@dataclass(frozen=True)
class Sample:
    """One value of a family, with its labels (name -> value)."""

    value: float
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """One metric: its name, type, help text and samples (a family without samples is left out)."""

    name: str
    type: MetricType
    help: str
    samples: Sequence[Sample]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or not self.name.startswith("dedloc_"):
            raise ValueError(f"metric name {self.name!r} is not dedloc_[a-zA-Z0-9_:]*")
        if self.type == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name} must end in _total")
        for sample in self.samples:
            for label in sample.labels:
                if not _LABEL.match(label) or label.startswith("__"):
                    raise ValueError(f"label name {label!r} of {self.name} is not a Prometheus label name")


def escape_label(value: str) -> str:
    """A label value as the text format writes it between double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """HELP text as the text format writes it (quotes stay as they are)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: ``repr`` of the float (integers without ``.0``), ``+Inf``, ``-Inf`` or ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(float(value))


def render(families: Iterable[Family]) -> str:
    """The exposition text of ``families`` (ends with a line feed; empty families are skipped).

    Raises:
        ValueError: two families share a name.
    """
    lines: list[str] = []
    seen: set[str] = set()
    for family in families:
        if family.name in seen:
            raise ValueError(f"metric {family.name} twice")
        seen.add(family.name)
        if not family.samples:
            continue
        lines.append(f"# HELP {family.name} {escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{escape_label(v)}"' for k, v in sorted(sample.labels.items()))
            braces = f"{{{labels}}}" if labels else ""
            lines.append(f"{family.name}{braces} {format_value(sample.value)}")
    return "\n".join(lines) + "\n" if lines else ""
