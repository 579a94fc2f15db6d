"""Versioned, typed wire contracts. No I/O, no trio, nothing else of the project.

Modules:
    errors     ProjectError (root of the tree) and ProtocolError
    codes      ErrorCode: outcomes sent on the wire
    envelope   the envelope, framing, kind registry, size limits, validating decoders
    peer_id    peer ids: the libp2p encoding of an Ed25519 public key
    types      constrained wire scalars (peer ids, multiaddrs, run ids, fixed-size bytes)
    handshake  the in-band identity proof after TLS (ServerHello, ClientProof, Welcome)
    dht        Kademlia messages and signed records
"""

from __future__ import annotations

from .codes import ErrorCode as ErrorCode
from .dht import FindNodeRequest as FindNodeRequest
from .dht import FindNodeResponse as FindNodeResponse
from .dht import FindValueRequest as FindValueRequest
from .dht import FindValueResponse as FindValueResponse
from .dht import LeaveNotice as LeaveNotice
from .dht import NodeInfo as NodeInfo
from .dht import PingRequest as PingRequest
from .dht import PingResponse as PingResponse
from .dht import SignedRecord as SignedRecord
from .dht import StoreRequest as StoreRequest
from .dht import StoreResponse as StoreResponse
from .dht import record_payload as record_payload
from .envelope import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from .envelope import PROTOCOL_VERSION as PROTOCOL_VERSION
from .envelope import Envelope as Envelope
from .envelope import ErrorReply as ErrorReply
from .envelope import Flags as Flags
from .envelope import Message as Message
from .envelope import Request as Request
from .envelope import decode_envelope as decode_envelope
from .envelope import decode_message as decode_message
from .envelope import encode_frame as encode_frame
from .envelope import register as register
from .errors import ProjectError as ProjectError
from .errors import ProtocolError as ProtocolError
from .handshake import ClientProof as ClientProof
from .handshake import ServerHello as ServerHello
from .handshake import Welcome as Welcome
from .peer_id import PeerId as PeerId
from .peer_id import peer_id_from_public_key as peer_id_from_public_key
from .peer_id import public_key_from_peer_id as public_key_from_peer_id

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "ClientProof",
    "Envelope",
    "ErrorCode",
    "ErrorReply",
    "FindNodeRequest",
    "FindNodeResponse",
    "FindValueRequest",
    "FindValueResponse",
    "Flags",
    "LeaveNotice",
    "Message",
    "NodeInfo",
    "PeerId",
    "PingRequest",
    "PingResponse",
    "ProjectError",
    "ProtocolError",
    "Request",
    "ServerHello",
    "SignedRecord",
    "StoreRequest",
    "StoreResponse",
    "Welcome",
    "decode_envelope",
    "decode_message",
    "encode_frame",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "record_payload",
    "register",
]
