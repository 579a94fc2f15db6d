"""Multiaddr parsing at the edge (shared.net.addresses)."""

from __future__ import annotations

import pytest

from shared.auth.keys import Identity
from shared.errors import ConfigError
from shared.net.addresses import PeerAddress, format_multiaddr, parse_multiaddr

PEER = Identity.generate().peer_id


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/ip4/203.0.113.7/tcp/4001", PeerAddress("203.0.113.7", 4001, None, "ip4")),
        (f"/ip4/127.0.0.1/tcp/0/p2p/{PEER}", PeerAddress("127.0.0.1", 0, PEER, "ip4")),
        ("/ip6/::1/tcp/65535", PeerAddress("::1", 65535, None, "ip6")),
        (f"/ip6/2001:db8::7/tcp/4001/p2p/{PEER}", PeerAddress("2001:db8::7", 4001, PEER, "ip6")),
        ("/dns4/backbone.example.org/tcp/443", PeerAddress("backbone.example.org", 443, None, "dns4")),
        (
            f"/dns4/backbone.example.org/tcp/443/p2p/{PEER}",
            PeerAddress("backbone.example.org", 443, PEER, "dns4"),
        ),
        ("/dns/example.org/tcp/1", PeerAddress("example.org", 1, None, "dns")),
        ("/dns6/example.org/tcp/1", PeerAddress("example.org", 1, None, "dns6")),
    ],
)
def test_parse_multiaddr_accepts_tcp_multiaddrs_with_and_without_peer_id(
    text: str, expected: PeerAddress
) -> None:
    address = parse_multiaddr(text)

    assert address == expected
    assert str(address) == text


def test_peer_address_with_peer_keeps_endpoint_and_adds_peer_id() -> None:
    address = parse_multiaddr("/ip6/::1/tcp/4001").with_peer(PEER)

    assert address == PeerAddress("::1", 4001, PEER, "ip6")
    assert str(address) == f"/ip6/::1/tcp/4001/p2p/{PEER}"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("10.0.0.1", "/ip4/10.0.0.1/tcp/9"),
        ("fe80::1", "/ip6/fe80::1/tcp/9"),
        ("a.example", "/dns/a.example/tcp/9"),
    ],
)
def test_format_multiaddr_guesses_protocol_from_host(host: str, expected: str) -> None:
    assert format_multiaddr(host, 9) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello",
        "203.0.113.7:4001",
        "/ip4/203.0.113.7/udp/4001",
        "/ip4/203.0.113.7",
        "/ip4/203.0.113.7/tcp",
        "/ip4/203.0.113.7/tcp/99999",
        "/ip4/203.0.113.7/tcp/-1",
        "/ip4/999.0.113.7/tcp/4001",
        "/tcp/4001",
        "/ip4/203.0.113.7/tcp/4001/tcp/4002",
        "/ip4/203.0.113.7/tcp/4001/ws",
        "/ip4/203.0.113.7/tcp/4001/p2p/notapeerid",
        "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW",
        "/ip4/203.0.113.7/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
        f"/p2p/{PEER}",
    ],
)
def test_parse_multiaddr_rejects_garbage_with_the_input_quoted(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_multiaddr(text)

    assert repr(text) in str(info.value)
