"""No SQL statement replaces an audit row: INSERT OR REPLACE, REPLACE INTO, upserts, on SQLite and PostgreSQL.

Before the insert guard, SQLite's INSERT OR REPLACE rewrote a record past the UPDATE/DELETE
triggers (REPLACE deletes without firing DELETE triggers). An existing database gains the guard
the next time a log opens it.
"""
from __future__ import annotations

import pytest
import sqlalchemy as sa

from audit import AuditLog

# (table, a statement that would replace an existing record, node, checkpoint or key)
SQLITE_REPLACES = [
    ("audit_records", "INSERT OR REPLACE INTO audit_records (idx, time_us, kind, tenant, session, entry, leaf_hash) "
                      "VALUES (1, 0, 'forget', 'evil', 's', x'7b7d', x'00')"),
    ("audit_records", "REPLACE INTO audit_records (idx, time_us, kind, entry, leaf_hash) VALUES (1, 0, 'forget', x'7b7d', x'00')"),
    ("audit_records", "INSERT INTO audit_records (idx, time_us, kind, entry, leaf_hash) VALUES (1, 0, 'forget', x'7b7d', x'00') "
                      "ON CONFLICT (idx) DO UPDATE SET tenant = 'evil'"),
    ("audit_nodes", "INSERT OR REPLACE INTO audit_nodes (id, hash) VALUES (0, x'00')"),
    ("audit_checkpoints", "INSERT OR REPLACE INTO audit_checkpoints (size, root_hash, key_id, time_us, note) "
                          "VALUES (8, x'00', 'evil', 0, 'forged')"),
    ("audit_keys", "INSERT OR REPLACE INTO audit_keys (seq, key_id, name, public_key_pem, from_size) "
                   "VALUES (0, 'evil', 'evil', 'pem', 0)"),
]

PG_REPLACES = [
    ("audit_records", "INSERT INTO audit_records (idx, time_us, kind, entry, leaf_hash) VALUES (1, 0, 'forget', '\\x7b7d', '\\x00') "
                      "ON CONFLICT (idx) DO UPDATE SET tenant = 'evil', entry = EXCLUDED.entry"),
    ("audit_nodes", "INSERT INTO audit_nodes (id, hash) VALUES (0, '\\x00') ON CONFLICT (id) DO UPDATE SET hash = EXCLUDED.hash"),
    ("audit_checkpoints", "INSERT INTO audit_checkpoints (size, root_hash, key_id, time_us, note) VALUES (4, '\\x00', 'e', 0, 'f') "
                          "ON CONFLICT (size) DO UPDATE SET note = EXCLUDED.note"),
    ("audit_keys", "INSERT INTO audit_keys (seq, key_id, name, public_key_pem, from_size) VALUES (0, 'e', 'e', 'p', 0) "
                   "ON CONFLICT (seq) DO UPDATE SET public_key_pem = EXCLUDED.public_key_pem"),
    ("audit_records", "INSERT INTO audit_records (idx, time_us, kind, entry, leaf_hash) VALUES (1, 0, 'forget', '\\x7b7d', '\\x00') "
                      "ON CONFLICT DO NOTHING"),
]


def _snapshot(url: str) -> dict[str, list]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = {t: [tuple(r) for r in conn.exec_driver_sql(f"SELECT * FROM {t} ORDER BY 1")]
                for t in ("audit_records", "audit_nodes", "audit_checkpoints", "audit_keys")}
    engine.dispose()
    return rows


def _refused(url: str, statements: list[tuple[str, str]]) -> None:
    before = _snapshot(url)
    engine = sa.create_engine(url)
    for table, stmt in statements:
        with engine.connect() as conn, pytest.raises(sa.exc.DatabaseError, match=f"{table} is append-only"):
            conn.exec_driver_sql(stmt)
            conn.commit()
    engine.dispose()
    assert _snapshot(url) == before


def test_sqlite_refuses_every_statement_that_would_replace_a_row(sqlite_log, record, sqlite_url):
    sqlite_log.append_many([record(i) for i in range(8)])
    _refused(sqlite_url, SQLITE_REPLACES)
    assert sqlite_log.append(record(8)) == 8  # new rows still go in


def test_an_existing_sqlite_database_gains_the_guard_when_a_log_opens_it(sqlite_url, signer, record):
    log = AuditLog(sqlite_url, signer, batch_size=8)
    log.append_many([record(i) for i in range(8)])
    log.close()
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:  # the database as the previous version left it
        for t in ("audit_records", "audit_nodes", "audit_checkpoints", "audit_keys"):
            conn.exec_driver_sql(f"DROP TRIGGER {t}_no_replace")
    with engine.connect() as conn:
        conn.exec_driver_sql(SQLITE_REPLACES[3][1])  # unguarded: a node is silently replaced
        conn.exec_driver_sql("INSERT OR REPLACE INTO audit_nodes (id, hash) VALUES (1, x'00')")
        conn.commit()
    engine.dispose()
    AuditLog(sqlite_url, signer).close()  # opening migrates the triggers
    _refused(sqlite_url, SQLITE_REPLACES)


@pytest.mark.postgres
def test_postgres_refuses_every_upsert_of_an_existing_row(pg_url, signer, record):
    log = AuditLog(pg_url, signer, batch_size=2)
    log.append_many([record(i) for i in range(4)])
    _refused(pg_url, PG_REPLACES)
    assert log.append(record(4)) == 4
    log.close()


@pytest.mark.postgres
def test_an_existing_postgres_database_gains_the_guard_when_a_log_opens_it(pg_url, signer, record):
    log = AuditLog(pg_url, signer, batch_size=2)
    log.append_many([record(i) for i in range(4)])
    log.close()
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        for t in ("audit_records", "audit_nodes", "audit_checkpoints", "audit_keys"):
            conn.exec_driver_sql(f"DROP TRIGGER {t}_no_replace ON {t}")
            conn.exec_driver_sql(f"DROP FUNCTION {t}_no_replace()")
    engine.dispose()
    AuditLog(pg_url, signer).close()
    _refused(pg_url, PG_REPLACES)
