"""Training state: its byte format and its transfer between peers (DESIGN §1, D2; seed 000 §3.1).

Modules:
    blob      a state as one canonical safetensors blob (tensors + str metadata), its digest, header
              reading without loading tensors; never pickle
    limits    bounds on a download decided before anything is allocated (a volunteer's model bound, a
              backbone's checkpoint limit), and the SourceBook of failed sources and refused announcements
    trust     trusted_state: which announcement to believe (majorities of distinct admitted users);
              usable_states: which of them a re-syncing peer may load (the surviving collaboration's)
    transfer  StateServer (serves offered blobs and files on the bulk lane), fetch_state / fetch_state_file
              (chunked, resumable, multi-source download to a file, verified against the announced
              SHA-256), and the DHT announcement helpers

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
from .limits import SourceBook as SourceBook
from .limits import checkpoint_size_limit as checkpoint_size_limit
from .limits import state_size_bound as state_size_bound
from .transfer import StateServer as StateServer
from .transfer import announce_state as announce_state
from .transfer import fetch_state as fetch_state
from .transfer import fetch_state_file as fetch_state_file
from .transfer import presence_addresses as presence_addresses
from .transfer import read_announcements as read_announcements
from .trust import Announced as Announced
from .trust import trusted_state as trusted_state
from .trust import usable_states as usable_states

__all__ = [
    "STATE_FORMAT",
    "Announced",
    "SourceBook",
    "StateServer",
    "announce_state",
    "checkpoint_size_limit",
    "decode_state",
    "encode_state",
    "fetch_state",
    "fetch_state_file",
    "file_digest",
    "presence_addresses",
    "read_announcements",
    "read_metadata",
    "state_digest",
    "state_size_bound",
    "state_step",
    "trusted_state",
    "usable_states",
]
