"""kill -9 during appends, and four processes appending to PostgreSQL at once."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from audit import AuditLog, Signer
from audit.verify import verify_export

WORKER = Path(__file__).with_name("audit_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stderr=subprocess.PIPE)


def _acked(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _check_log(log: AuditLog, url: str, tmp_path: Path, signer: Signer) -> None:
    """Intact: the export verifies, every checkpoint is a prefix of the head, and the stored nodes are exactly the complete subtrees."""
    head = log.checkpoint()
    log.export(tmp_path / "export.json")
    report = verify_export(tmp_path / "export.json", public_key_pem=signer.public_key_pem)
    assert report.ok, report.summary()
    for cp in log.checkpoints():
        log.consistency_proof(cp.size, head.size).verify(cp.root_hash, head.root_hash)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT count(*) FROM audit_nodes").scalar()
    engine.dispose()
    assert stored == sum(head.size >> level for level in range(64))


@pytest.mark.slow
def test_kill_9_during_appends_loses_no_acknowledged_record(sqlite_url, tmp_path):
    key, ack = tmp_path / "key.pem", tmp_path / "acks"
    for round_ in range(3):
        child = _spawn(sqlite_url, str(key), str(ack), "0")
        deadline = time.monotonic() + 60
        target = 40 * (round_ + 1)
        while len(_acked(ack)) < target:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "worker made no progress"
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait()
    signer = Signer.load_or_create(key)
    log = AuditLog(sqlite_url, signer)
    acked = _acked(ack)
    assert len(acked) == len(set(acked))
    assert max(acked) < log.size
    for index in acked:
        assert log.get(index).body["segment_id"].startswith(str(ack))
    log.append({"kind": "quarantine"})  # the restarted log appends where it left off
    _check_log(log, sqlite_url, tmp_path, signer)
    head = log.checkpoint()
    for index in acked[:: max(1, len(acked) // 25)]:
        log.inclusion_proof(index, head.size).verify(bytes.fromhex(log.get(index).leaf_hash), head.root_hash)
    log.close()


@pytest.mark.postgres
@pytest.mark.slow
def test_four_processes_append_to_postgres_without_gaps_or_duplicates(pg_url, tmp_path):
    key, go = tmp_path / "key.pem", tmp_path / "go"
    signer = Signer.load_or_create(key)
    AuditLog(pg_url, signer).close()  # create the schema once; the workers also race on it harmlessly
    acks = [tmp_path / f"acks{w}" for w in range(4)]
    workers = [_spawn(pg_url, str(key), str(a), "500", str(go)) for a in acks]
    go.touch()
    for w in workers:
        assert w.wait(timeout=240) == 0, w.stderr.read().decode()
    indices = sorted(itertools.chain.from_iterable(_acked(a) for a in acks))
    assert indices == list(range(2000))  # no gaps, no duplicates
    log = AuditLog(pg_url, signer)
    assert log.size == 2000
    _check_log(log, pg_url, tmp_path, signer)
    cps = log.checkpoints()
    assert len(cps) >= 2000 // 64
    for old, new in itertools.combinations(cps, 2):  # every checkpoint consistent with every later one
        log.consistency_proof(old.size, new.size).verify(old.root_hash, new.root_hash)
    log.close()


@pytest.mark.postgres
def test_postgres_triggers_refuse_update_delete_truncate(pg_url, signer, record):
    log = AuditLog(pg_url, signer, batch_size=2)
    log.append_many([record(i) for i in range(4)])
    engine = sa.create_engine(pg_url)
    for stmt in (
        "UPDATE audit_records SET kind = 'quarantine' WHERE idx = 1",
        "DELETE FROM audit_records WHERE idx = 3",
        "UPDATE audit_nodes SET hash = '\\x00' WHERE id = 0",
        "DELETE FROM audit_checkpoints",
        "TRUNCATE audit_records",
        "DELETE FROM audit_keys",
    ):
        with engine.connect() as conn, pytest.raises(sa.exc.DatabaseError, match="append-only"):
            conn.exec_driver_sql(stmt)
    engine.dispose()
    assert log.size == 4 and log.get(1).body["kind"] == "forget"
    log.close()


def _held_elsewhere(url: str) -> tuple[sa.Engine, sa.Connection]:
    """Another writer holding the log's write lock: BEGIN IMMEDIATE on SQLite, the advisory lock on PostgreSQL."""
    from audit.db import _PG_LOCK

    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    conn = engine.connect()
    if url.startswith("sqlite"):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
    return engine, conn


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_append_that_must_not_wait_finds_a_held_lock_busy_at_once_and_writes_nothing(
        backend, request, signer, record, tmp_path):
    """`wait=False` (the MCP proxy's commit on its event loop): a lock held by another writer is
    LogBusy, raised before anything of the batch (or of the store written alongside) is written,
    instead of a wait of up to a minute; once the lock is free the same call appends."""
    from audit import LogBusy

    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    log = AuditLog(url, signer, batch_size=8)
    log.append(record(0))
    alongside: list[object] = []
    engine, holder = _held_elsewhere(url)
    try:
        with pytest.raises(LogBusy, match="held by another writer"):
            log.append_many([record(1)], alongside=alongside.append, wait=False)
        assert alongside == [] and log.size == 1
    finally:
        holder.exec_driver_sql("ROLLBACK")
        holder.close()
        engine.dispose()
    assert log.append_many([record(2)], alongside=alongside.append, wait=False) == [1]
    assert len(alongside) == 1 and log.get(1).body["segment_id"] == "seg-2"
    _check_log(log, url, tmp_path, signer)
    log.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_sqlite_file_deleted_or_replaced_under_an_open_log_refuses_every_append(how, signer, record, tmp_path):
    """SQLite goes on writing into an unlinked file, which no one can read back (a red team deleted
    the database under a running proxy and its records were lost). Every append through a
    connection opened on the old file fails, naming the fix, and a restart uses the file found."""
    from audit import AuditError

    path = tmp_path / "audit.db"
    url = f"sqlite:///{path}"
    log = AuditLog(url, signer, batch_size=8)
    log.append(record(0))
    backup = tmp_path / "backup.db"
    with sa.create_engine(url).connect() as conn:
        conn.exec_driver_sql(f"VACUUM INTO '{backup}'")
    for f in tmp_path.glob("audit.db*"):
        f.unlink()
    if how == "replaced":
        backup.rename(path)
    for n in (1, 2):
        with pytest.raises(AuditError, match=f"audit.db was {how} after this process opened it"):
            log.append(record(n))
    log.close()
    reopened = AuditLog(url, signer, batch_size=8)
    assert reopened.size == (1 if how == "replaced" else 0)
    reopened.append(record(3))
    _check_log(reopened, url, tmp_path, signer)
    reopened.close()


def test_opening_a_log_whose_lock_stays_held_says_so_and_names_the_fix(signer, record, tmp_path, monkeypatch):
    """Red team F11: a proxy started while another process held the lock waited a silent minute and
    died with a driver traceback. It now says at once that it waits, and past the busy timeout
    fails with an AuditError that names the fix (`lethe mcp` prints it as one line)."""
    import structlog

    from audit import AuditError, db

    url = f"sqlite:///{tmp_path / 'audit.db'}"
    AuditLog(url, signer).close()  # the file exists; another process now holds its lock
    monkeypatch.setattr(db, "BUSY_TIMEOUT_MS", 500)
    engine, holder = _held_elsewhere(url)
    try:
        with structlog.testing.capture_logs() as logs, \
                pytest.raises(AuditError, match="write lock stayed held by another process for 0.5 s.*fuser"):
            AuditLog(url, signer)
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["audit.waiting_for_write_lock"]
    finally:
        holder.exec_driver_sql("ROLLBACK")
        holder.close()
        engine.dispose()
    log = AuditLog(url, signer)  # released: opens
    log.append(record(0))
    log.close()
