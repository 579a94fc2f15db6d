"""Connection reversal: a peer that accepts no connections opens the one a reachable peer needs.

A peer behind NAT (client mode) cannot be dialed, but it keeps the RPC connections it opened itself -- to
the backbones and its DHT contacts. When a reachable node ``A`` needs a *bulk* connection to such a peer
``N`` (a backbone storing the state only NATed peers hold, DESIGN §6), it asks ``N`` over ``N``'s own
connection to dial back::

    A -> N   DialBackRequest{}     over an RPC connection N opened to A
    N -> A   a new connection: TCP, TLS 1.3, identity proof (protocols.handshake), N dialing, lane "reverse"
    N -> A   DialBackReply{}       once that connection is up (or an error reply: N could not dial)

A ``"reverse"`` lane is a bulk lane (:mod:`protocols.bulk`) with the roles swapped: the *listener* ``A``
sends the transfer headers and ``N``, the dialer, serves them with its bulk handlers. So every bulk
service (state chunks, probes) works towards a client-mode peer unchanged, over a connection it opened.

Rules (DESIGN D10: no amplification, no unsolicited work):

* ``N`` dials back only the exact address it dialed itself for its RPC connection to ``A`` -- never an
  address named in a message -- so nobody can aim ``N`` at a third party; a request arriving on a
  connection ``A`` opened is refused (``A`` can reach ``N`` directly: it should dial).
* ``N`` runs at most :data:`MAX_PENDING_DIAL_BACKS` dial-backs per peer at once (more are refused with
  ``OVERLOADED``), and dial-backs go through ``N``'s usual dial back-off.
* ``A`` accepts a reverse lane from ``N`` only while it has a dial-back to ``N`` outstanding, one lane per
  request (the oldest waiting request takes it); an unsolicited reverse lane is closed and counted. The
  lane is authenticated like any other (``N`` proves its identity), so it can only answer ``N``'s own
  requests.
"""

from __future__ import annotations

from typing import ClassVar

from .envelope import Message, Request, register

__all__ = ["MAX_PENDING_DIAL_BACKS", "DialBackReply", "DialBackRequest"]

#: Dial-backs one peer may have a node run at once.
MAX_PENDING_DIAL_BACKS = 4


@register
class DialBackReply(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "conn.dialback.reply"
    max_bytes: ClassVar[int] = 256


@register
class DialBackRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "conn.dialback"
    max_bytes: ClassVar[int] = 256
    response: ClassVar[type[Message]] = DialBackReply
