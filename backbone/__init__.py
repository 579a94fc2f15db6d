"""The backbone: organizer-run CPU nodes that keep a run's DHT alive and welcome newcomers.

Modules:
    cli       ``backbone start`` (typer)
    service   the backbone's root nursery: node, mDNS advertisement, presence, status
"""

from __future__ import annotations

__all__: list[str] = []
