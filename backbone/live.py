"""What the running backbone knows besides its ledger, for the dashboard and ``/metrics``
(:mod:`backbone.dashboard`): its node, aggregator, relay and checkpoint store. :mod:`backbone.service`
fills the fields in as it starts each; an API built alone (tests) leaves them None and the dashboard
shows those numbers as unknown."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocols.probe import CapabilityRecord
    from shared.averaging.auxiliary import AuxiliaryAggregator
    from shared.net.relay import RelayService
    from shared.node import Node

    from .checkpoints import CheckpointStore

__all__ = ["LiveSources"]


@dataclass
class LiveSources:
    """What the running service knows besides the ledger (None: not running here, or opted out)."""

    node: Node | None = None
    aggregator: AuxiliaryAggregator | None = None
    relay: RelayService | None = None
    checkpoints: CheckpointStore | None = None
    #: the DHT's capability records by peer id, and when they were read (trio clock; the dashboard's cache)
    records: dict[str, CapabilityRecord] = field(default_factory=dict)
    records_at: float = -math.inf
