"""The networking engine (DESIGN D1): trio, TCP, TLS 1.3 from the standard library, Ed25519 identities.

Modules (lowest first):
    addresses    multiaddr parsing and formatting (PeerAddress)
    tls          TLS contexts; certificates carry the identity key; peer id from a certificate
    ratelimit    upload/download caps: a pure token bucket and its trio wrapper, shared by a host's sockets
    tls_socket   TlsSocket: the stdlib's C-level SSLSocket driven by trio, or by a bulk thread
    connection   dial/accept: TLS + in-band identity proof -> SecureConnection; framed messages, frame
                 limits by stage, large frames decoded in a thread
    dialing      which advertised addresses a connection vouches for; per-target dial back-off (pure)
    rpc          RpcChannel: typed, multiplexed, bidirectional request/response; HandlerRegistry
    bulk         the bulk lane: raw bytes through worker threads, for gradients and state
    host         Host: listeners, pre-auth budgets per connection and address, connection pool, idle
                 reaping, call(), send_bulk(), statistics()
    probe        ProbeService and the clients measure_bandwidth(), check_reachable() (capabilities)
"""

from __future__ import annotations

from .addresses import PeerAddress as PeerAddress
from .addresses import parse_multiaddr as parse_multiaddr
from .host import Host as Host
from .host import HostConfig as HostConfig
from .host import HostStatistics as HostStatistics
from .rpc import HandlerRegistry as HandlerRegistry
from .rpc import RequestContext as RequestContext
from .rpc import RpcChannel as RpcChannel

__all__ = [
    "HandlerRegistry",
    "Host",
    "HostConfig",
    "HostStatistics",
    "PeerAddress",
    "RequestContext",
    "RpcChannel",
    "parse_multiaddr",
]
