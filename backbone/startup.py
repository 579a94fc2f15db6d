"""What ``backbone start`` checks and claims before it announces anything.

The order of a start (:func:`backbone.service.serve_backbone`) is: every flag and the manifest are checked
(pure functions here and in :mod:`shared.manifest`, before the data dir is touched); the data dir is locked
and must hold this run or none (:func:`backbone.runinfo.check_held_run`); the API's port is bound
(:func:`bind_api`), then the ledger and the keys are opened and the node's ports bound; only then are the
shards prepared and ``listening on …`` printed, and ``run.json`` written once the API serves. So a taken
port, a typo'd flag or an unusable manifest ends the start with one line before anything is announced,
and leaves no corpus, ``run.json`` or printed run id behind.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from shared.errors import ConfigError
from shared.net.addresses import PeerAddress

__all__ = [
    "MAX_PUBLIC_URLS",
    "bind_api",
    "bind_dashboard",
    "check_authority_key",
    "check_listen",
    "check_public_url",
    "parse_api_listen",
    "parse_dashboard_listen",
]

#: An invite carries at most 8 API URLs (``protocols.api.Invite``).
MAX_PUBLIC_URLS = 8
_MAX_URL = 256  # ``protocols.api.UrlStr``
_BACKLOG = 128


def parse_api_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) of ``--api-listen`` as (IP address, port).

    Raises:
        ConfigError: not of that form, the host not an IP address, or the port out of range.
    """
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    usage = "give HOST:PORT with an IP address, e.g. 0.0.0.0:8443 (all interfaces) or 127.0.0.1:0"
    if not sep or not host:
        raise ConfigError(f"--api-listen {text!r} is not HOST:PORT: {usage}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"--api-listen {text!r}: {host!r} is not an IP address; {usage}") from None
    if not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ConfigError(f"--api-listen {text!r}: the port must be 0 to 65535 (0: any free port)")
    return str(address), int(port)


def check_listen(address: PeerAddress, text: str) -> None:
    """A ``--listen`` address must name an IP address of this machine's (or ``0.0.0.0``): a node binds it.

    Raises:
        ConfigError: the address names a host (``/dns4/…``).
    """
    try:
        ipaddress.ip_address(address.host)
    except ValueError:
        raise ConfigError(
            f"--listen {text}: give an IP address (/ip4/0.0.0.0/tcp/PORT for all interfaces), not a host name"
        ) from None


def bind_api(text: str) -> socket.socket:
    """A TCP socket listening on ``--api-listen`` (:func:`parse_api_listen`), for the API to serve later.

    Raises:
        ConfigError: the address is malformed, the port is taken, or the address is not this machine's.
    """
    host, port = parse_api_listen(text)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not over a listener: only TIME_WAIT
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            reason = "the port is in use by another process; choose another port (or 0 for any free one)"
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = "that address is not one of this machine's; use one of its addresses or 0.0.0.0"
        elif exc.errno == errno.EACCES:
            reason = "ports below 1024 need privileges; choose a port of 1024 or above"
        else:
            reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot serve the API on {text}: {reason}") from exc
    return sock


def parse_dashboard_listen(text: str) -> tuple[str, int]:
    """``--dashboard-listen HOST:PORT``, as :func:`parse_api_listen` reads ``--api-listen``.

    Raises:
        ConfigError: not of that form, the host not an IP address, or the port out of range.
    """
    try:
        return parse_api_listen(text)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--api-listen", "--dashboard-listen")) from None


def bind_dashboard(text: str) -> socket.socket:
    """A TCP socket listening on ``--dashboard-listen``, bound with the API's port (module docstring).

    Raises:
        ConfigError: the address is malformed, the port is taken, or the address is not this machine's.
    """
    parse_dashboard_listen(text)
    try:
        return bind_api(text)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("serve the API", "serve the dashboard")) from None


def check_public_url(url: str) -> str:
    """``url`` if it is an ``https://HOST[:PORT][/PATH]`` URL volunteers can use (``--public-url``).

    Raises:
        ConfigError: another scheme, no host, a bad port, a query or fragment, or too long.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"--public-url {url!r} is not a URL: {exc}") from None
    example = "e.g. https://bb1.example.org:8443"
    if parts.scheme != "https" or not parts.hostname:
        raise ConfigError(
            f"--public-url {url!r}: give the API's https://HOST:PORT as volunteers reach it, {example}"
        )
    if port == 0 or parts.query or parts.fragment or len(url) > _MAX_URL:
        raise ConfigError(
            f"--public-url {url!r}: give a plain https://HOST:PORT (a port of 1-65535), {example}"
        )
    return url


def check_authority_key(path: Path | None) -> None:
    """``--authority-key`` must name an existing file: a new key there would be another run's authority.

    Raises:
        ConfigError: the path does not exist or is not a file.
    """
    if path is None or os.path.isfile(path):
        return
    if os.path.exists(path):
        raise ConfigError(f"--authority-key {path} is not a file; give the run's authority.key")
    raise ConfigError(
        f"--authority-key {path} does not exist: copy the run's authority.key from its first backbone's data "
        "dir (or leave --authority-key out to create a new run's key in the data dir)"
    )
