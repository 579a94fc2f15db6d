"""Kademlia DHT (DESIGN D3; seed 001 App. B; Maymounkov & Mazières 2002): pure cores plus a trio service.

Modules:
    keys      the 160-bit id space: node ids from peer ids, key ids from user keys, XOR distance
    routing   Contact and RoutingTable: k-buckets that return the contact to ping, never doing I/O
    lookup    Lookup: the iterative node lookup as a state machine (next_queries / on_response / on_failure)
    storage   RecordStore: signed records by (key, subkey), newest wins, expiry heap, per-writer quotas
    records   sign_record, the newest-wins order, and record validators (signature, expiry, own subkeys)
    admission who may write: admitted, unrevoked writers (token in the record), the rule per key, users
    healing   when a contact comes back, whether it is a replica of a key, how often to re-announce to it
    contacts  the contacts file a node saves in its data dir and dials again when restarted
    node      DHTNode trio service: serves the RPCs, drives the cores above, refreshes, heals, leaves

Everything here but ``node`` is pure: no trio, no sockets, time passed in as ``now`` (``contacts`` also
reads and writes its file, blocking: call it through ``trio.to_thread``).
"""

from __future__ import annotations

from .admission import TOKEN_GRACE as TOKEN_GRACE
from .admission import AdmissionValidator as AdmissionValidator
from .admission import TokenlessValidator as TokenlessValidator
from .admission import record_user as record_user
from .keys import ID_BYTES as ID_BYTES
from .keys import KEY_BITS as KEY_BITS
from .keys import check_id as check_id
from .keys import distance as distance
from .keys import id_bytes as id_bytes
from .keys import key_id as key_id
from .keys import key_int as key_int
from .keys import node_id_of as node_id_of
from .lookup import Lookup as Lookup
from .node import DHTConfig as DHTConfig
from .node import DHTNode as DHTNode
from .node import DHTStatistics as DHTStatistics
from .node import DHTValue as DHTValue
from .records import CompositeValidator as CompositeValidator
from .records import ExpiryValidator as ExpiryValidator
from .records import RecordValidator as RecordValidator
from .records import SignatureValidator as SignatureValidator
from .records import SubkeyOwnerValidator as SubkeyOwnerValidator
from .records import default_validator as default_validator
from .records import newer as newer
from .records import sign_record as sign_record
from .routing import BucketInfo as BucketInfo
from .routing import Contact as Contact
from .routing import RoutingTable as RoutingTable
from .routing import random_id_in as random_id_in
from .storage import PutResult as PutResult
from .storage import RecordStore as RecordStore
from .storage import StoreLimits as StoreLimits
from .storage import record_cost as record_cost

__all__ = [
    "ID_BYTES",
    "KEY_BITS",
    "TOKEN_GRACE",
    "AdmissionValidator",
    "BucketInfo",
    "CompositeValidator",
    "Contact",
    "DHTConfig",
    "DHTNode",
    "DHTStatistics",
    "DHTValue",
    "ExpiryValidator",
    "Lookup",
    "PutResult",
    "RecordStore",
    "RecordValidator",
    "RoutingTable",
    "SignatureValidator",
    "StoreLimits",
    "SubkeyOwnerValidator",
    "TokenlessValidator",
    "check_id",
    "default_validator",
    "distance",
    "id_bytes",
    "key_id",
    "key_int",
    "newer",
    "node_id_of",
    "random_id_in",
    "record_cost",
    "record_user",
    "sign_record",
]
