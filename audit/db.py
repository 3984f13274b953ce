"""Tables, engines and the one write lock of the audit log (SQLite WAL or PostgreSQL).

Every table is append-only: the code only INSERTs, and triggers make the database refuse UPDATE,
DELETE (and TRUNCATE on PostgreSQL) and any INSERT onto an existing key (SQLite's INSERT OR
REPLACE, an upsert), so that a bug or a careless operator cannot rewrite history without first
dropping a trigger, which leaves the signed checkpoints to catch them.

Writers serialize on one lock per database, so indices have no gaps and no duplicates across
processes and replicas: ``BEGIN IMMEDIATE`` on SQLite, a transaction-scoped advisory lock on
PostgreSQL. Nothing mutable exists to lock: the head is ``max(idx) + 1``.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from .errors import AuditError, LogBusy

log = structlog.get_logger(__name__)

__all__ = ["checkpoints", "intents", "keys", "make_engine", "node_id", "nodes", "records", "write_transaction"]

metadata = MetaData()
_INDEX = BigInteger().with_variant(Integer, "sqlite")  # SQLite: INTEGER PRIMARY KEY is the rowid itself

records = Table(
    "audit_records",
    metadata,
    Column("idx", _INDEX, primary_key=True, autoincrement=False),
    Column("time_us", BigInteger, nullable=False),  # microseconds since the epoch, for since/until
    Column("kind", String(32), nullable=False),
    Column("tenant", String(255)),
    Column("session", String(255)),
    Column("entry", LargeBinary, nullable=False),  # the exact RFC 8785 bytes that were hashed
    Column("leaf_hash", LargeBinary(32), nullable=False),
    Index("audit_records_tenant_idx", "tenant", "idx"),
    Index("audit_records_session_idx", "session", "idx"),
    Index("audit_records_kind_idx", "kind", "idx"),
    Index("audit_records_time_idx", "time_us"),
)

# Hashes of complete perfect subtrees, written once when they complete. Node (level, index) covers
# leaves [index << level, (index + 1) << level) and is stored under id = level << 48 | index: one
# integer key, so a proof's O(log n) nodes are one `id IN (...)` look-up. Level 0 holds the leaves.
NODE_ID_SHIFT = 48

nodes = Table(
    "audit_nodes",
    metadata,
    Column("id", _INDEX, primary_key=True, autoincrement=False),
    Column("hash", LargeBinary(32), nullable=False),
)


def node_id(level: int, index: int) -> int:
    return level << NODE_ID_SHIFT | index


checkpoints = Table(
    "audit_checkpoints",
    metadata,
    Column("size", _INDEX, primary_key=True, autoincrement=False),
    Column("root_hash", LargeBinary(32), nullable=False),
    Column("key_id", String(8), nullable=False),
    Column("time_us", BigInteger, nullable=False),
    Column("note", Text, nullable=False),
)

# The key chain: seq 0 is the genesis key; each rotation adds the next, which signs checkpoints
# of size >= from_size.
keys = Table(
    "audit_keys",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("key_id", String(8), nullable=False),
    Column("name", String(255), nullable=False),
    Column("public_key_pem", Text, nullable=False),
    Column("from_size", BigInteger, nullable=False),
)

# The idempotency key of a record appended with `AuditLog.append_keyed` (a relayed ledger intent):
# written in the record's own transaction, so a retried relay finds it and appends nothing.
intents = Table(
    "audit_intents",
    metadata,
    Column("key", String(120), primary_key=True),
    Column("idx", _INDEX, nullable=False),
)

_WRITE = "lethe_audit_write"
BUSY_TIMEOUT_MS = 60_000  # how long a SQLite writer waits for another's lock (`wait=True`)
_SQLITE_BUSY = 5  # SQLite's primary result code for a lock held by another connection
_PG_LOCK = int.from_bytes(hashlib.sha256(b"lethe audit append lock").digest()[:8], "big", signed=True)

def _pk(table: str) -> str:
    (column,) = metadata.tables[table].primary_key.columns
    return column.name


# A row, once written, is final. UPDATE and DELETE are refused outright; an INSERT is refused when
# its key already exists, before any conflict clause runs: SQLite's INSERT OR REPLACE / REPLACE
# INTO delete the old row without firing DELETE triggers, and an upsert (ON CONFLICT DO UPDATE)
# would rewrite it. The triggers are (re)created on every start (IF NOT EXISTS / OR REPLACE), so an
# existing database gains the ones added since it was made.
_PG_TRIGGERS = [
    """CREATE OR REPLACE FUNCTION audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION '% is append-only: audit rows are never updated or deleted', TG_TABLE_NAME; END $$""",
    *(
        f"""CREATE OR REPLACE FUNCTION {t}_no_replace() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF EXISTS (SELECT 1 FROM {t} WHERE {_pk(t)} = NEW.{_pk(t)}) THEN
            RAISE EXCEPTION '{t} is append-only: row % exists and is never replaced', NEW.{_pk(t)};
          END IF;
          RETURN NEW;
        END $$"""
        for t in metadata.tables
    ),
    *(
        stmt
        for t in metadata.tables
        for stmt in (
            f"CREATE OR REPLACE TRIGGER {t}_append_only BEFORE UPDATE OR DELETE ON {t} "
            "FOR EACH ROW EXECUTE FUNCTION audit_append_only()",
            f"CREATE OR REPLACE TRIGGER {t}_no_truncate BEFORE TRUNCATE ON {t} "
            "FOR EACH STATEMENT EXECUTE FUNCTION audit_append_only()",
            f"CREATE OR REPLACE TRIGGER {t}_no_replace BEFORE INSERT ON {t} "
            f"FOR EACH ROW EXECUTE FUNCTION {t}_no_replace()",
        )
    ),
]
_SQLITE_TRIGGERS = [
    *(
        f"CREATE TRIGGER IF NOT EXISTS {t}_no_{op.lower()} BEFORE {op} ON {t} "
        f"BEGIN SELECT RAISE(ABORT, '{t} is append-only: audit rows are never updated or deleted'); END"
        for t in metadata.tables
        for op in ("UPDATE", "DELETE")
    ),
    *(
        f"CREATE TRIGGER IF NOT EXISTS {t}_no_replace BEFORE INSERT ON {t} "
        f"WHEN EXISTS (SELECT 1 FROM {t} WHERE {_pk(t)} = NEW.{_pk(t)}) "
        f"BEGIN SELECT RAISE(ABORT, '{t} is append-only: an existing row is never replaced'); END"
        for t in metadata.tables
    ),
]


_FILE = "lethe.database_file"  # a SQLite connection's info: (path, (st_dev, st_ino) when it was opened)


def _sqlite_engine(url: str) -> Engine:
    database = make_url(url).database
    if not database or database == ":memory:":
        raise AuditError("the audit log needs a file database (sqlite:///path/audit.db), not :memory:")
    Path(database).parent.mkdir(parents=True, exist_ok=True)
    path = os.path.abspath(database)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
        for pragma in ("journal_mode=WAL", "synchronous=FULL", f"busy_timeout={BUSY_TIMEOUT_MS}"):
            dbapi_conn.execute(f"PRAGMA {pragma}")  # FULL: a commit has reached the disk
        record.info[_FILE] = (path, _identity(path))

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

    return engine


def make_engine(url: str) -> Engine:
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        engine = _sqlite_engine(url)
    elif backend == "postgresql":
        engine = create_engine(url)
    else:
        raise AuditError(f"audit database {backend!r} is not supported; use sqlite:///… or postgresql+psycopg://…")
    try:
        _create(engine, backend, wait=False)
    except LogBusy:
        log.warning("audit.waiting_for_write_lock", database=engine.url.render_as_string(hide_password=True),
                    up_to_s=BUSY_TIMEOUT_MS / 1000 if backend == "sqlite" else None,
                    hint="another process holds the log's write lock (a long transaction, a backup, a replica "
                         "starting); this start goes on when it is released")
        try:
            _create(engine, backend, wait=True)
        except OperationalError as exc:
            raise AuditError(f"the audit database's write lock stayed held by another process for "
                             f"{BUSY_TIMEOUT_MS / 1000:g} s, so the log could not be opened; find the process "
                             "holding it (`fuser` on the database file) and start again") from exc
    return engine


def _create(engine: Engine, backend: str, wait: bool) -> None:
    """The tables and triggers, under the write lock: replicas starting together do not race."""
    with write_transaction(engine, wait=wait) as conn:
        metadata.create_all(conn)
        for stmt in _PG_TRIGGERS if backend == "postgresql" else _SQLITE_TRIGGERS:
            conn.execute(text(stmt))  # text(): psycopg would read the % in RAISE as a placeholder


@contextmanager
def write_transaction(engine: Engine, wait: bool = True) -> Iterator[Connection]:
    """A transaction holding the log's write lock; committed (durably) when the block exits.

    With `wait=False` a lock held by another writer raises `LogBusy` at once, with nothing written,
    where it would otherwise be waited for (up to `BUSY_TIMEOUT_MS` on SQLite, without bound on
    PostgreSQL): for a caller that must not block, and has somewhere else to send the write.
    """
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as conn:
        conn.execution_options(**{_WRITE: True})
        if sqlite and not wait:
            _busy_timeout(conn, 0)
        try:
            with conn.begin():
                if sqlite:
                    _same_file(conn)
                else:
                    _pg_lock(conn, wait)
                yield conn
        except OperationalError as exc:
            if not wait and (getattr(exc.orig, "sqlite_errorcode", 0) & 0xFF) == _SQLITE_BUSY:
                raise LogBusy("the audit log's write lock is held by another writer; nothing was written") from exc
            raise
        finally:
            if sqlite and not wait:
                _busy_timeout(conn, BUSY_TIMEOUT_MS)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _same_file(conn: Connection) -> None:
    """Refuse a write through a connection whose database file was deleted or replaced after it
    was opened: SQLite goes on writing into the unlinked file, and every record would be lost when
    the process ends (a red team deleted the database under a running proxy). Checked under the
    write lock, so the write that follows goes to the file the check saw; a stat per transaction."""
    path, opened = conn.connection.info[_FILE]
    now = _identity(path)
    if now is None or now != opened:
        raise AuditError(f"the database file {path} was {'deleted' if now is None else 'replaced'} after this "
                         "process opened it: nothing more is written to the old file, since no one could read "
                         "it back; restart the process (after restoring the file from a backup, if it was "
                         "removed by mistake)")


def _busy_timeout(conn: Connection, ms: int) -> None:
    """Set on the driver's connection itself: a statement through SQLAlchemy would begin a transaction."""
    conn.connection.driver_connection.execute(f"PRAGMA busy_timeout={int(ms)}")  # type: ignore[union-attr]


def _pg_lock(conn: Connection, wait: bool) -> None:
    if wait:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
    elif not conn.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": _PG_LOCK}):
        raise LogBusy("the audit log's write lock is held by another writer; nothing was written")
