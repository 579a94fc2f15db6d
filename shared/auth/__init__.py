"""Identities and, later, admission: who a node is and what it may do.

Modules:
    keys    Ed25519 identity load/create (file mode 0600), signing, verification by peer id
"""

from __future__ import annotations

from .keys import Identity as Identity
from .keys import verify as verify
from .keys import verify_by_peer_id as verify_by_peer_id

__all__ = ["Identity", "verify", "verify_by_peer_id"]
