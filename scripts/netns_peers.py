"""Peer processes of the ``--netns`` benchmarks: one OS process per namespace host, driven by JSON lines.

The coordinator of a benchmark (``scripts/lowcomm_netns.py``, ``scripts/swarm_netns.py``) starts each peer
as ``host.popen(argv)`` (:class:`tests.netns.NetnsHost`) with pipes for stdin and stdout and a temporary
file for stderr, writes commands to its stdin as JSON lines and reads its answers from its stdout as JSON
lines. A peer that exits, writes something that is not JSON, or stays silent past the deadline given to
:meth:`PeerProcess.receive` raises :class:`PeerError` carrying the tail of its stderr, so the benchmark can
fail with one line that says why. :func:`stop` ends a group: end of file on every stdin (a peer exits on
it), ``SIGKILL`` for those still running after the grace period, every process reaped and every pipe
closed.

:func:`unavailable` says why namespaces with ``tc`` shaping cannot be built here (``None`` if they can).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any


class PeerError(Exception):
    """A peer process exited, wrote garbage, or stayed silent (one line, with its stderr's tail)."""


@dataclass
class PeerProcess:
    proc: subprocess.Popen[bytes]
    stderr: IO[bytes]
    rank: int
    pending: bytearray = field(default_factory=bytearray)

    def send(self, obj: object) -> None:
        """Write ``obj`` as one JSON line to the peer's stdin."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise PeerError(f"peer {self.rank} exited ({self.proc.poll()}): {self.stderr_tail()}") from None

    def receive(self, within: float) -> dict[str, Any]:
        """The next JSON line from the peer; ``PeerError`` if it dies or stays silent ``within`` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + within
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise PeerError(f"peer {self.rank} silent for {within:.0f} s: {self.stderr_tail()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise PeerError(f"peer {self.rank} exited ({self.proc.wait()}): {self.stderr_tail()}")
            self.pending += chunk
        line, _, rest = bytes(self.pending).partition(b"\n")
        self.pending[:] = rest
        try:
            obj: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"peer {self.rank} wrote {line[:200]!r}: {self.stderr_tail()}") from None
        return obj

    def stderr_tail(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        text = self.stderr.read().decode(errors="replace").strip()
        return text[-2000:] or "(no stderr)"


def start(host: Any, argv: list[str], rank: int) -> PeerProcess:
    """Start ``argv`` on the namespace ``host`` with JSON-line pipes (module docstring)."""
    stderr = tempfile.TemporaryFile()
    try:
        proc = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    except BaseException:
        stderr.close()
        raise
    return PeerProcess(proc, stderr, rank)


def stop(peers: Sequence[PeerProcess], grace_s: float) -> None:
    """Close every peer's stdin, ``SIGKILL`` those still running ``grace_s`` later, reap all, close pipes."""
    for p in peers:
        with contextlib.suppress(OSError, ValueError):
            assert p.proc.stdin is not None
            p.proc.stdin.close()
    end = time.monotonic() + grace_s
    for p in peers:
        try:
            p.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
        with contextlib.suppress(OSError):
            assert p.proc.stdout is not None
            p.proc.stdout.close()
        p.stderr.close()


def unavailable() -> str | None:
    """Why network namespaces with ``tc`` shaping cannot be built here; ``None`` if they can."""
    from tests.netns import netns_available, tc_available

    return netns_available() or tc_available()
