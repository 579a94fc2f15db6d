"""Role-agnostic code shared by the volunteer and the backbone: pure cores plus thin trio services.

Packages and modules:
    errors      the exception hierarchy (tree in its docstring) and wire-code mapping
    auth/       node identities (Ed25519 keys, peer ids, signatures)
    net/        the networking engine: TLS 1.3 bound to identities, RPC, bulk lane, Host
    dht/        Kademlia: pure routing / lookup / storage / records, and the DHTNode service
    discovery/  finding a run on the LAN (mDNS)
    node        a run's node: Host + DHTNode, presence and status, ordered start and leave
    lifecycle   running under SIGINT/SIGTERM with a clean, graceful stop
    console     CLI support: logging, data-dir locks, errors to exit codes
    extras      each role's packages (dedloc[backbone], dedloc[volunteer]) and the error when one lacks them
    panel       the rich status panel
    progress    where the collaboration stands, from the peers' progress records (pure)
    progress_records  reading those records: through our DHT, and seeded at each backbone
    merge       which collaboration survives when the records show several (pure)
    alone       may a volunteer step without a group: evidence and the high-water mark
    tasks       the task catalog (names, option schemas, optimizers) and check_trainable, without torch
"""

from __future__ import annotations

__all__: list[str] = []
