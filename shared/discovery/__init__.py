"""Finding a run's nodes without knowing an address (DESIGN D8): today mDNS / DNS-SD on the LAN, where a
backbone advertises its run (``backbone start --run-id``) and ``volunteer join RUN`` looks for it; the
answer is only a hint of where to dial, and the handshake and the run's authority decide trust.

Modules:
    mdns    advertise_run / discover_run over zeroconf (record format in its docstring), Advertisement
"""

from __future__ import annotations

from .mdns import FORMAT_VERSION as FORMAT_VERSION
from .mdns import MDNS_THREADS as MDNS_THREADS
from .mdns import SERVICE_TYPE as SERVICE_TYPE
from .mdns import Advertisement as Advertisement
from .mdns import advertise_run as advertise_run
from .mdns import discover_run as discover_run

__all__ = [
    "FORMAT_VERSION",
    "MDNS_THREADS",
    "SERVICE_TYPE",
    "Advertisement",
    "advertise_run",
    "discover_run",
]
