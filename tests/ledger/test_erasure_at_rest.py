"""Erasure at rest: after every erasure path no byte run of the secret is left in any file of the
database (SQLite: the db, its -wal and -shm, anything else in the data dir), also across a kill -9.

Each secret is unique per test and long enough to span SQLite overflow pages; a file "holds" it when
any 48-byte slice of it (or its unique marker) occurs in the file's bytes.
"""
from __future__ import annotations

import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from ledger import ErasureIncomplete, Ledger, SegmentState
from ledger.content import ContentStore, sha256_hex
from tests.ledger.conftest import Clock

ROOT = Path(__file__).resolve().parents[2]


def make_secret(size: int) -> bytes:
    marker = b"LETHE-AT-REST-" + secrets.token_hex(8).encode() + b"-"
    return (marker + secrets.token_hex(size).encode())[:size]


def slices(secret: bytes) -> list[bytes]:
    return [secret[:32]] + [secret[i : i + 48] for i in range(0, max(len(secret) - 48, 1), 512)]


def holding_files(data_dir: Path, secret: bytes) -> list[str]:
    found = []
    for path in sorted(p for p in data_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if any(s in data for s in slices(secret)):
            found.append(path.name)
    return found


@pytest.fixture(params=[200, 20_000], ids=["inline", "overflow-pages"])
def secret(request: pytest.FixtureRequest) -> bytes:
    return make_secret(request.param)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


def _open(data_dir: Path, clock: Clock | None = None) -> Ledger:
    return Ledger(f"sqlite:///{data_dir / 'lethe.db'}", **({"clock": clock} if clock else {}))


def _filler(led: Ledger, sid: str, n: int = 30) -> None:
    for i in range(n):
        led.append(sid, role="user", tool=None, content=f"filler {i} ".encode() * 50, n_tokens=1)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["in-wal", "in-db-file"])
def test_forget_leaves_no_copy_at_rest(data_dir: Path, secret: bytes, checkpointed: bool) -> None:
    led = _open(data_dir)
    led.create_session("s", "t")
    _filler(led, "s", 5)
    seg = led.append("s", role="tool", tool="read_file", content=secret, n_tokens=3)
    _filler(led, "s")
    if checkpointed:  # the secret's pages are in lethe.db itself: secure_delete must zero them
        led.scrub()
    assert holding_files(data_dir, secret)  # the check can see the secret where it is stored
    led.forget("s", [seg.id])
    assert holding_files(data_dir, secret) == []
    assert not led.content.exists(sha256_hex(secret))
    led.close()
    assert holding_files(data_dir, secret) == []


def test_retention_of_a_quarantined_result_leaves_no_copy(data_dir: Path, secret: bytes) -> None:
    led = _open(data_dir)
    led.create_session("s", "t")
    seg = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=2, state=SegmentState.QUARANTINED)
    _filler(led, "s")
    assert led.retire_content("s", [seg.id])
    assert holding_files(data_dir, secret) == []


def test_live_retention_sweep_leaves_no_copy(data_dir: Path, secret: bytes) -> None:
    clock = Clock()
    led = _open(data_dir, clock)
    led.create_session("s", "t")
    led.append("s", role="tool", tool="fetch", content=secret, n_tokens=2)
    clock.advance(100)
    expired = led.expired(clock(), lambda _r, _s: 10.0)
    led.forget("s", [s.id for s in expired])
    assert holding_files(data_dir, secret) == []


def test_resent_then_forgotten_content_takes_its_superseded_copy_along(data_dir: Path, secret: bytes) -> None:
    """The issue's path: a history rewrite supersedes the segment, the client re-sends it, it is forgotten."""
    led = _open(data_dir)
    led.create_session("s", "t")
    _filler(led, "s", 2)
    old = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=4)
    led.truncate("s", old.start)
    new = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=4)
    out = led.forget("s", [new.id])
    assert {s.id for s in out} == {old.id, new.id} and all(s.state is SegmentState.FORGOTTEN for s in out)
    assert not led.content.exists(sha256_hex(secret))
    assert holding_files(data_dir, secret) == []


def test_superseded_segment_can_be_forgotten_by_id(data_dir: Path, secret: bytes) -> None:
    led = _open(data_dir)
    led.create_session("s", "t")
    old = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=4)
    (superseded,) = led.truncate("s", 0)
    assert superseded.id == old.id and led.content.exists(sha256_hex(secret))
    led.forget("s", [old.id])
    assert holding_files(data_dir, secret) == []


def test_retention_sweeps_superseded_segments(data_dir: Path, secret: bytes) -> None:
    clock = Clock()
    led = _open(data_dir, clock)
    led.create_session("s", "t")
    keep = led.append("s", role="user", tool=None, content=b"kept forever", n_tokens=1)
    old = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=4)
    led.truncate("s", old.start)
    clock.advance(5)
    assert led.sweep_superseded(clock(), lambda _r, _s: 10.0) == []  # not due yet
    clock.advance(10)
    swept = led.sweep_superseded(clock(), lambda _r, s: 10.0 if s.state is SegmentState.SUPERSEDED else None)
    assert [s.id for s in swept] == [old.id]
    assert led.get_segment("s", keep.id).state is SegmentState.LIVE
    assert holding_files(data_dir, secret) == []


def test_blob_goes_when_its_last_holder_goes(data_dir: Path, secret: bytes) -> None:
    led = _open(data_dir)
    for sid in ("a", "b"):
        led.create_session(sid, "t")
    seg_a = led.append("a", role="tool", tool="fetch", content=secret, n_tokens=1)
    seg_b = led.append("b", role="tool", tool="fetch", content=secret, n_tokens=1)
    led.forget("a", [seg_a.id])
    assert [s.id for s in led.holders(sha256_hex(secret))] == [seg_b.id]
    assert led.content.exists(sha256_hex(secret))  # session b still legitimately holds it
    led.forget("b", [seg_b.id])
    assert led.holders(sha256_hex(secret)) == []
    assert holding_files(data_dir, secret) == []


def test_a_forget_that_leaves_a_stored_copy_fails_loudly(data_dir: Path, secret: bytes, monkeypatch) -> None:
    led = _open(data_dir)
    led.create_session("s", "t")
    seg = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=1)
    monkeypatch.setattr(ContentStore, "release", lambda self, conn, digests: [])  # a store that keeps the blob
    with pytest.raises(ErasureIncomplete, match="no holder but is still stored"):
        led.forget("s", [seg.id])


def test_an_old_reader_snapshot_makes_the_erasure_fail_loudly_then_scrub_finishes(data_dir: Path) -> None:
    secret = make_secret(5000)
    led = _open(data_dir)
    led.create_session("s", "t")
    seg = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=1)
    reader = sqlite3.connect(data_dir / "lethe.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM ledger_blobs").fetchone()  # holds a snapshot with the secret
    with pytest.raises(ErasureIncomplete, match="call Ledger.scrub"):
        led.forget("s", [seg.id])
    assert led.get_segment("s", seg.id).state is SegmentState.FORGOTTEN  # the rows are erased
    assert holding_files(data_dir, secret)  # ... but the WAL still has it, and we said so
    reader.execute("COMMIT")
    reader.close()
    led.scrub()
    assert holding_files(data_dir, secret) == []


_CHILD = textwrap.dedent("""
    import sys
    from ledger import Ledger
    led = Ledger(f"sqlite:///{sys.argv[1]}/lethe.db")
    led.create_session("s", "t")
    seg = led.append("s", role="tool", tool="fetch", content=bytes.fromhex(sys.argv[2]), n_tokens=2)
    for i in range(20):
        led.append("s", role="user", tool=None, content=f"after {i} ".encode() * 40, n_tokens=1)
    if sys.argv[3] == "forget":
        led.forget("s", [seg.id])
    print("ready", flush=True)
    sys.stdin.read()  # wait to be killed
""")


@pytest.mark.parametrize("child_forgets", [True, False], ids=["killed-after-forget", "killed-before-forget"])
def test_kill_9_mid_session_leaves_no_copy_after_erasure(data_dir: Path, child_forgets: bool) -> None:
    secret = make_secret(20_000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(data_dir), secret.hex(),
                              "forget" if child_forgets else "keep"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT)
    for line in child.stdout:  # structured logs come first
        if line.strip() == b"ready":
            break
    else:
        raise AssertionError(f"child exited with {child.wait()} before it was ready")
    os.kill(child.pid, signal.SIGKILL)  # no close, no checkpoint on exit, WAL and SHM left as they are
    child.wait()
    if child_forgets:
        assert holding_files(data_dir, secret) == []
    else:
        assert holding_files(data_dir, secret)  # the crash left it in the WAL
    led = _open(data_dir)  # recovery replays the WAL
    segs = [s for s in led.segments("s") if s.content_sha256 == sha256_hex(secret)]
    led.forget("s", [s.id for s in segs])
    assert holding_files(data_dir, secret) == []
    led.close()
    assert holding_files(data_dir, secret) == []


@pytest.mark.postgres
def test_postgres_keeps_dead_tuples_until_vacuum(pg_url: str, pg_admin: sa.Engine) -> None:
    """What ledger/README.md says: after a forget the row is a dead tuple still in the heap file;
    `Ledger.vacuum()` rewrites the table so the live files no longer hold it (pg_wal still may)."""
    with pg_admin.connect() as conn:
        data_dir = Path(conn.exec_driver_sql("SHOW data_directory").scalar())
    if not os.access(data_dir, os.R_OK):
        pytest.skip(f"cannot read PostgreSQL's data directory {data_dir} from this process")
    secret = make_secret(300)
    led = Ledger(pg_url)
    led.create_session("s", "t")
    seg = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=1)

    def heap_holds() -> bool:
        with led._engine.connect() as conn:
            conn.exec_driver_sql("CHECKPOINT")  # flush shared buffers to the files we read
            rel = conn.exec_driver_sql("SELECT pg_relation_filepath('ledger_blobs')").scalar()
        return any(s in (data_dir / rel).read_bytes() for s in slices(secret))

    led.forget("s", [seg.id])
    assert not led.content.exists(sha256_hex(secret))
    assert heap_holds()  # the honest part: deleted is not gone
    led.vacuum()
    assert not heap_holds()
    led.close()


def test_sqlite_vacuum_keeps_the_ledger_and_the_files_clean(data_dir: Path, secret: bytes) -> None:
    led = _open(data_dir)
    led.create_session("s", "t")
    keep = led.append("s", role="user", tool=None, content=b"still here", n_tokens=1)
    seg = led.append("s", role="tool", tool="fetch", content=secret, n_tokens=1)
    led.forget("s", [seg.id])
    led.vacuum()
    assert led.content.get(keep.content_sha256) == b"still here"
    assert holding_files(data_dir, secret) == []
    result = subprocess.run([sys.executable, "-m", "ledger", "vacuum", f"sqlite:///{data_dir / 'lethe.db'}"],
                            capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, check=True)
    assert result.stdout.strip().splitlines()[-1] == b'{"vacuumed": "sqlite"}'
