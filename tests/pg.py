"""A throw-away PostgreSQL server for tests (DESIGN §7): ``initdb`` + ``pg_ctl start`` on a temp dir.

:func:`postgres_cluster` finds the server binaries (``$DEDLOC_PG_BIN``, ``/usr/lib/postgresql/<newest>/bin``,
or wherever ``initdb`` on ``PATH`` lives), runs them as the ``postgres`` OS user when we are root (initdb
refuses root), initializes a cluster with trust authentication, and starts it on 127.0.0.1 at a free
port with its socket in the temp dir, so it never touches a system cluster. Each
:meth:`PostgresCluster.create_database` returns the SQLAlchemy URL of a fresh, empty database. The
cluster is stopped (``pg_ctl stop -m immediate``) and its directory removed when the context exits, or
at interpreter exit if that never happens.

Missing binaries skip the tests that need the server, except when ``$CI`` is set: CI must really
exercise PostgreSQL, so there they fail. ``scripts/test`` installs the binaries when it can.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

__all__ = ["PostgresCluster", "find_bindir", "postgres_cluster"]

_OS_USER = "postgres"
_START_ATTEMPTS = 3
_TIMEOUT_S = 120.0
_counter = itertools.count()


def find_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, newest major version first."""
    candidates: list[Path] = []
    if env := os.environ.get("DEDLOC_PG_BIN"):
        candidates.append(Path(env))

    def major(path: Path) -> float:
        match = re.fullmatch(r"\d+(\.\d+)?", path.parent.name)
        return float(match.group()) if match else -1.0

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=major, reverse=True)
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).resolve().parent)
    for bindir in candidates:
        if all(os.access(bindir / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return bindir
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class PostgresCluster:
    """A running throw-away cluster; build with :func:`postgres_cluster`."""

    bindir: Path
    root: Path
    run_as: list[str]
    port: int = 0
    _stopped: bool = field(default=False, repr=False)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def _run(self, argv: Sequence[str | Path]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.run_as, *map(str, argv)],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )

    def _start(self) -> None:
        initdb: list[str | Path] = [self.bindir / "initdb", "-D", self.data_dir, "--no-sync"]
        init = self._run([*initdb, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C"])
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed ({init.returncode}): {init.stderr.strip() or init.stdout}")
        error = ""
        for _ in range(_START_ATTEMPTS):  # the free port may be taken before the server binds it
            self.port = _free_port()
            # fsync off: the server is never crashed here (tests kill clients), and it saves seconds.
            options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
            log = self.root / "server.log"
            started = self._run(
                [self.bindir / "pg_ctl", "-D", self.data_dir, "-l", log, "-w", "-o", options, "start"]
            )
            if started.returncode == 0:
                return
            error = started.stderr.strip() or started.stdout.strip()
            if log.exists():
                error += "\n" + log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"pg_ctl start failed: {error}")

    def stop(self) -> None:
        """Stop the server at once and delete its files. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if (self.data_dir / "postmaster.pid").exists():
                self._run([self.bindir / "pg_ctl", "-D", self.data_dir, "-m", "immediate", "-w", "stop"])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """Create a fresh empty database and return its SQLAlchemy URL."""
        name = f"ledger_{os.getpid()}_{next(_counter)}"
        dsn = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)


def _missing(reason: str) -> None:
    message = f"PostgreSQL tests need a server: {reason}"
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{message} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(message)


@contextmanager
def postgres_cluster() -> Iterator[PostgresCluster]:
    """Start a throw-away cluster for the ``with`` block; skip (or fail under ``$CI``) without binaries."""
    bindir = find_bindir()
    if bindir is None:
        _missing("no initdb/pg_ctl/postgres under /usr/lib/postgresql/*/bin, $DEDLOC_PG_BIN or PATH")
        raise AssertionError("unreachable")  # _missing always raises
    run_as: list[str] = []
    owner: pwd.struct_passwd | None = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam(_OS_USER)
        except KeyError:
            _missing(f"running as root and there is no {_OS_USER!r} OS user for initdb to run as")
        run_as = ["runuser", "-u", _OS_USER, "--"]
    root = Path(tempfile.mkdtemp(prefix="dedloc-pg-"))
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    cluster = PostgresCluster(bindir, root, run_as)
    atexit.register(cluster.stop)
    try:
        cluster._start()
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)
