"""Ledger fixtures: a fresh in-memory SQLite ledger, or one in a private PostgreSQL schema.

The PostgreSQL test database is shared with other packages' tests, so each ledger gets its own
schema (search_path) and drops it afterwards; nothing outside that schema is touched.
"""
from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from ledger import Ledger

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


class Clock:
    """A settable UTC clock, so retention tests do not sleep."""

    def __init__(self) -> None:
        self.now = datetime(2025, 1, 1, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[sa.Engine]:
    engine = sa.create_engine(PG_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as err:
        pytest.skip(f"PostgreSQL unreachable at {PG_URL} ({err.__class__.__name__}); start it to run postgres tests")
    yield engine
    engine.dispose()


@pytest.fixture
def pg_url(pg_admin: sa.Engine) -> Iterator[str]:
    schema = f"ledger_test_{secrets.token_hex(6)}"
    with pg_admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    with pg_admin.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    return "sqlite://" if request.param == "sqlite" else request.getfixturevalue("pg_url")


@pytest.fixture
def ledger(db_url: str, clock: Clock) -> Iterator[Ledger]:
    led = Ledger(db_url, clock=clock)
    yield led
    led.close()
