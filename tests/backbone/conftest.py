"""Backbone fixtures: a ledger database URL for SQLite and for a real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backbone.ledger import LedgerStore
from tests.pg import PostgresCluster, postgres_cluster


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    """One throw-away PostgreSQL cluster for the whole session (skipped without binaries, unless $CI)."""
    with postgres_cluster() as cluster:
        yield cluster


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty ledger database: a SQLite file, then a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'data' / 'ledger.sqlite3'}"
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    return cluster.create_database()


@pytest.fixture
def store(ledger_url: str) -> Iterator[LedgerStore]:
    with LedgerStore.open(ledger_url) as opened:
        yield opened
