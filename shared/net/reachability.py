"""Whether others can dial this node, how we found out, and what we therefore tell them (issue 14).

A node behind a NAT or a firewall that announces its private or loopback addresses makes every peer
that learns them dial nowhere (or, worse, someone else's machine: every home has a 192.168.1.10). So a
volunteer announces only what was *proven* (:func:`verify_reachability`):

1. right after its host starts, before it joins the DHT (so that the very first connections it opens
   already carry the right addresses in their identity proofs, which is where peers learn contacts), it
   asks a backbone of the run to dial its listen addresses back (:func:`shared.net.probe.check_reachability`:
   a fresh, authenticated dial from the backbone, on the IP the request came from; then once more on the
   IP the backbone saw, for a forwarded port);
2. the addresses dialed back are what it advertises (:meth:`Host.advertise <shared.net.host.Host.advertise>`):
   its identity proofs, presence record and round tickets carry them and nothing else. None dialed back,
   or no backbone answered: it advertises nothing and runs in **client mode** -- it still trains, pushes
   its gradient parts and fetches averages over connections it opens itself, and backbones fetch state
   from it over lanes it dials back (:mod:`protocols.reversal`); the LP gives it no slice.

A failed check is *not* a pass: a node we could not ask is treated as unreachable (the safe side: a
client-mode peer costs some of its bandwidth to the run, a falsely reachable one fails every round it is
in). :class:`Reachability` says which case holds, for the panel, ``status.json`` and the capabilities.

**Relayed** (:func:`keep_relayed`). A client-mode node whose checker also relays (backbones do) reserves a
slot there (:class:`~shared.net.relay.RelayClient`) and advertises its relayed address
``…/p2p/<relay>/p2p-circuit/p2p/<us>`` instead of nothing: it can then be dialed, so it may aggregate (the
LP bounds its links by its relay's, :mod:`shared.averaging.load_balance`). While it holds the slot, every
new relayed connection to a peer is upgraded to a direct one by hole punching when our peer id is the
lower of the two (one side starts, so two punches never cross; :class:`~shared.net.punch.HolePuncher`);
a punch that fails (a symmetric NAT) leaves the connection relayed.

**Fallback** (:func:`relay_candidates`). The checker is not the only relay: backbones that relay and
volunteers started with ``--relay`` publish relay records in the DHT (:mod:`shared.relays`). When the relay
we hold a slot at fails us (or refuses us), we try the next candidate at once: the checker first, then the
others found in the DHT, never ourselves, never one that failed us less than :data:`RELAY_RETRY` seconds
ago. The others are ordered by a hash of (our id, their id) (rendezvous hashing), so that the clients of a
dead relay spread over the remaining ones instead of all taking the first. A record is only a hint: a
relay counts once a reservation there succeeded over the authenticated handshake, which proves its peer
id. Only when no candidate is left do we advertise nothing (client mode), and look again after
:data:`RELAY_RETRY` seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from protocols.errors import WrongVersion
from protocols.peer_id import PeerId

from ..errors import AccessDenied, ConfigError, ProjectError, WrongRun
from .addresses import PeerAddress, parse_multiaddr
from .host import CALL_FAILURES, Host
from .probe import check_reachability

__all__ = ["RELAY_RETRY", "Reachability", "keep_relayed", "relay_candidates", "verify_reachability"]

logger = logging.getLogger(__name__)

#: How long one backbone may take to answer a reachability check (it dials each address for 3 s).
CHECK_DEADLINE = 15.0


@dataclass(frozen=True)
class Reachability:
    """What a reachability check found: where we were dialed back, which IP the checker saw us on."""

    reachable: tuple[str, ...] = ()
    observed: str = ""  # our IP as the checking backbone saw it ("" if unknown)
    checked_with: str = ""  # the backbone that checked ("" if none could)
    error: str = ""  # why no check was possible (then ``reachable`` is empty)
    relayed: tuple[str, ...] = ()  # our relayed addresses while a relay holds a slot for us

    @property
    def client_mode(self) -> bool:
        return not self.reachable and not self.relayed

    @property
    def mode(self) -> str:
        """``"direct"`` (dialed back), ``"relayed"``, ``"client"`` (checked, unreachable), ``"unchecked"``."""
        if self.reachable:
            return "direct"
        if self.relayed:
            return "relayed"
        return "client" if self.checked_with else "unchecked"

    def describe(self) -> str:
        """One line for people: what mode we are in and why."""
        if self.reachable:
            return f"reachable at {', '.join(_short(a) for a in self.reachable)}"
        if self.relayed:
            relays = ", ".join(_short(a.split("/p2p-circuit", 1)[0]) for a in self.relayed)
            seen = f", seen as {self.observed}" if self.observed else ""
            why = f"behind NAT or a firewall{seen}"
            return f"relayed through {relays} ({why}); punching direct links where the NATs allow"
        if not self.checked_with:
            return f"client mode: reachability unknown ({self.error or 'no backbone to check with'})"
        seen = f", seen as {self.observed}" if self.observed else ""
        why = "behind NAT or a firewall" if self.observed else "not reachable"
        return f"client mode: {why}{seen} (forward a port and pass --listen to aggregate for the run)"


async def verify_reachability(host: Host, checkers: Sequence[PeerAddress | str]) -> Reachability:
    """Ask the first of ``checkers`` (backbones) that answers to dial us back; advertise what it reached.

    Never raises for a checker's failure: with none answering, the result is ``unchecked`` (client mode).

    Raises:
        WrongVersion, WrongRun, AccessDenied: the checker speaks another protocol, serves another run, or
            refuses our credentials (the DHT join would fail the same way: the caller reports it as such).
    """
    errors: list[str] = []
    for checker in checkers:
        try:
            address = parse_multiaddr(checker) if isinstance(checker, str) else checker
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        try:
            with trio.fail_after(CHECK_DEADLINE):
                reachable, observed = await check_reachability(host, address)
        except (WrongVersion, WrongRun, AccessDenied):
            raise  # this run is not for us as we are: joining would fail the same way, so say it now
        except (*CALL_FAILURES, ProjectError) as exc:
            errors.append(f"{address}: {exc}")
            logger.info("reachability check with %s failed: %s", address, exc)
            continue
        result = Reachability(reachable, observed, str(address))
        break
    else:
        result = Reachability(error="; ".join(errors)[:300] or "no backbone to check with")
    host.advertise(result.reachable)
    logger.info("%s", result.describe())
    return result


def _short(text: str) -> str:
    """A multiaddr without its ``/p2p/…`` suffix, for one-line messages."""
    return text.split("/p2p/", 1)[0]


#: Seconds before a client-mode node asks its relay for a slot again after losing or failing to get one.
RELAY_RETRY = 30.0


def relay_candidates(
    first: PeerAddress | None,
    found: Sequence[PeerAddress],
    own: str,
    failed_at: Mapping[str, float],
    now: float,
    retry: float = RELAY_RETRY,
) -> list[PeerAddress]:
    """The relays to try, in order: ``first`` (the checker), then ``found`` ordered by
    ``sha256(own | relay)``; one address per peer id (the first seen), none without a peer id, not ``own``,
    none that failed us less than ``retry`` seconds before ``now`` (``failed_at``: peer id -> time)."""

    def usable(address: PeerAddress) -> bool:
        peer = address.peer_id
        if peer is None or peer == own:
            return False
        failed = failed_at.get(peer)
        return failed is None or now - failed >= retry

    def rank(address: PeerAddress) -> bytes:
        return hashlib.sha256(f"{own}|{address.peer_id}".encode()).digest()

    out: list[PeerAddress] = []
    seen: set[str] = set()
    head = [first] if first is not None else []
    for address in [*head, *sorted(found, key=rank)]:
        if usable(address) and address.peer_id not in seen:
            seen.add(str(address.peer_id))
            out.append(address)
    return out


async def keep_relayed(
    host: Host,
    relay: PeerAddress | None,
    on_change: Callable[[tuple[str, ...]], None],
    *,
    candidates: Callable[[], Awaitable[Sequence[PeerAddress]]] | None = None,
    punch_timeout: float = 5.0,
) -> None:
    """Hold a slot at ``relay`` (else at the next of :func:`relay_candidates`, with ``candidates()``
    listing the relays found in the DHT) and advertise our relayed address while we do; punch direct
    connections to the peers we reach through it (module docstring). ``on_change(relayed_addresses)`` is
    called whenever they change (empty: client mode). Runs until cancelled; never raises for the relays'
    failures."""
    from .addresses import relayed
    from .punch import HolePuncher
    from .relay import RelayClient

    client = RelayClient(host)
    puncher: HolePuncher | None = None
    wanted: trio.MemorySendChannel[PeerId]
    wanted, pending = trio.open_memory_channel[PeerId](64)
    failed_at: dict[str, float] = {}

    def observe(peer: PeerId) -> None:
        if host.connection_kind(peer) == "relayed" and host.peer_id < peer:
            with contextlib.suppress(trio.WouldBlock):
                wanted.send_nowait(peer)

    async def punch_forever() -> None:
        async for peer in pending:
            with contextlib.suppress(*CALL_FAILURES, ProjectError, OSError):
                if (
                    puncher is not None
                    and host.connection_kind(peer) == "relayed"
                    and await puncher.punch(peer)
                ):
                    logger.info("punched a direct connection to %s", peer)

    async def next_candidate() -> PeerAddress | None:
        found: Sequence[PeerAddress] = ()
        if candidates is not None:
            try:
                found = await candidates()
            except (*CALL_FAILURES, ProjectError, OSError) as exc:
                logger.info("could not look up relays in the DHT: %s", exc)
        order = relay_candidates(relay, found, host.peer_id, failed_at, trio.current_time())
        return order[0] if order else None

    host.connection_observers.append(observe)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(punch_forever)
            relayed_now, idle = False, False
            while True:
                candidate = await next_candidate()
                if candidate is None:
                    if not idle:
                        logger.info(
                            "no relay holds a slot for us: client mode; looking again in %g s", RELAY_RETRY
                        )
                    host.advertise([])
                    on_change(())
                    relayed_now, idle = False, True
                    await trio.sleep(RELAY_RETRY)
                    continue
                assert candidate.peer_id is not None  # relay_candidates guarantees it
                idle = False
                try:
                    await client.reserve(candidate)
                    if puncher is None:
                        puncher = HolePuncher(host, candidate, timeout=punch_timeout)
                    puncher.relay = candidate
                    addresses = (str(relayed(candidate, host.peer_id)),)
                    host.advertise(addresses)
                    on_change(addresses)
                    relayed_now = True
                    logger.info("reachable through relay %s", candidate)
                    await client.keep(candidate)  # renews; returns only by raising when the relay fails us
                except (*CALL_FAILURES, ProjectError, OSError) as exc:
                    logger.info("relay %s: %s; trying the next one", candidate, exc)
                failed_at[candidate.peer_id] = trio.current_time()
                if relayed_now:  # our relayed address is dead: advertise nothing until another relay holds us
                    host.advertise([])
                    on_change(())
                    relayed_now = False
    finally:
        host.connection_observers.remove(observe)
