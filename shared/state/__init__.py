"""Training state: its byte format and its transfer between peers (DESIGN §1, D2; seed 000 §3.1).

Modules:
    blob      a state as one canonical safetensors blob (tensors + str metadata), its digest, header
              reading without loading tensors; never pickle
    transfer  StateServer (serves offered blobs and files on the bulk lane), fetch_state (chunked,
              resumable, multi-source download verified against the announced SHA-256), trusted_state
              (which announcement to believe), and the DHT announcement helpers

No torch here: tensors are numpy arrays, so backbones store and serve states without it.
"""

from __future__ import annotations

from .blob import STATE_FORMAT as STATE_FORMAT
from .blob import decode_state as decode_state
from .blob import encode_state as encode_state
from .blob import file_digest as file_digest
from .blob import read_metadata as read_metadata
from .blob import state_digest as state_digest
from .blob import state_step as state_step
from .transfer import StateServer as StateServer
from .transfer import announce_state as announce_state
from .transfer import fetch_state as fetch_state
from .transfer import presence_addresses as presence_addresses
from .transfer import read_announcements as read_announcements
from .transfer import trusted_state as trusted_state

__all__ = [
    "STATE_FORMAT",
    "StateServer",
    "announce_state",
    "decode_state",
    "encode_state",
    "fetch_state",
    "file_digest",
    "presence_addresses",
    "read_announcements",
    "read_metadata",
    "state_digest",
    "state_step",
    "trusted_state",
]
