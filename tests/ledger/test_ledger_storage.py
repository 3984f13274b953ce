"""Durability, transactions and concurrency: a file SQLite database, and PostgreSQL replicas."""
from __future__ import annotations

import threading
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from ledger import Ledger, LedgerInvariantError, SegmentState
from ledger.content import sha256_hex
from ledger.invariants import verify_tiling


def test_state_survives_reopening(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    first = Ledger(url)
    first.create_session("s", "t")
    a = first.append("s", role="user", tool=None, content=b"a", n_tokens=3)
    b = first.append("s", role="user", tool=None, content=b"b", n_tokens=2)
    first.forget("s", [a.id])
    first.close()
    second = Ledger(url)
    assert [(s.id, s.state, s.start, s.end) for s in second.segments("s")] == [
        (a.id, SegmentState.FORGOTTEN, 0, 0), (b.id, SegmentState.LIVE, 0, 2)]
    assert second.token_count("s") == 2 and second.content.get(b.content_sha256) == b"b"
    second.close()


def test_invariant_violation_rolls_the_operation_back(tmp_path: Path) -> None:
    """Corrupt a range behind the ledger's back: the next operation fails and leaves no trace."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    led = Ledger(url)
    led.create_session("s", "t")
    a = led.append("s", role="user", tool=None, content=b"a", n_tokens=3)
    led.append("s", role="user", tool=None, content=b"b", n_tokens=2)
    raw = sa.create_engine(url)
    with raw.begin() as conn:
        conn.execute(sa.text("UPDATE ledger_segments SET tok_end = 4 WHERE id = :id"), {"id": a.id})
    raw.dispose()
    before = led.segments("s")
    with pytest.raises(LedgerInvariantError, match="overlap, expected to start at 4"):
        led.append("s", role="user", tool=None, content=b"new", n_tokens=1)
    with pytest.raises(LedgerInvariantError):
        led.amortize("s", a.id, 1, b"repl")
    assert led.segments("s") == before and led.token_count("s") == 5
    assert not led.content.exists(sha256_hex(b"new")) and not led.content.exists(sha256_hex(b"repl"))
    # with the check off (production), the operation goes through; check_invariants still sees it
    unchecked = Ledger(url, check_invariants=False)
    unchecked.append("s", role="user", tool=None, content=b"new", n_tokens=1)
    with pytest.raises(LedgerInvariantError):
        unchecked.check_invariants("s")
    led.close()
    unchecked.close()


def test_verify_tiling_names_the_fault() -> None:
    led = Ledger("sqlite://", check_invariants=False)
    led.create_session("s", "t")
    segs = [led.append("s", role="user", tool=None, content=b"x", n_tokens=n) for n in (2, 3)]
    verify_tiling("s", segs, 5)
    gap = [segs[0], replace(segs[1], start=3, end=6)]
    with pytest.raises(LedgerInvariantError, match="gap, expected to start at 2"):
        verify_tiling("s", gap, 6)
    dead = [segs[0], replace(segs[1], state=SegmentState.FORGOTTEN)]
    with pytest.raises(LedgerInvariantError, match="dead segment must have an empty range"):
        verify_tiling("s", dead, 5)
    with pytest.raises(LedgerInvariantError, match="out of seq order"):
        verify_tiling("s", [segs[0], replace(segs[1], seq=0)], 5)
    with pytest.raises(LedgerInvariantError, match="token_count is 7"):
        verify_tiling("s", segs, 7)
    led.close()


def _hammer(make: Callable[[], Ledger], workers: int = 4, per_worker: int = 15) -> None:
    """Replicas append and forget in one session at once; per-session locking keeps the tiling."""
    replicas = [make() for _ in range(workers)]
    replicas[0].create_session("s", "t")
    errors: list[BaseException] = []

    def work(led: Ledger, w: int) -> None:
        try:
            for i in range(per_worker):
                seg = led.append("s", role="user", tool=None, content=f"{w}:{i}".encode(), n_tokens=1 + i % 3)
                if i % 4 == 3:
                    led.forget("s", [seg.id])
        except BaseException as err:  # surfaced below, with the thread's failure
            errors.append(err)

    threads = [threading.Thread(target=work, args=(led, w)) for w, led in enumerate(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    segs = replicas[0].segments("s")
    assert [s.seq for s in segs] == list(range(workers * per_worker))
    live = sum(1 + i % 3 for i in range(per_worker) if i % 4 != 3) * workers
    assert replicas[0].token_count("s") == live
    replicas[0].check_invariants("s", cache_len=live)
    for led in replicas:
        led.close()


def test_concurrent_replicas_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    Ledger(url).close()  # create the schema once, before the replicas race
    _hammer(lambda: Ledger(url))


def test_concurrent_threads_in_memory() -> None:
    shared = Ledger("sqlite://")
    _hammer(lambda: shared)


@pytest.mark.postgres
def test_concurrent_replicas_postgres(pg_url: str) -> None:
    Ledger(pg_url).close()
    _hammer(lambda: Ledger(pg_url))


def test_unsupported_database_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="supports sqlite and postgresql, not 'mysql'; fix the database URL"):
        Ledger("mysql://user@localhost/db")


def test_the_database_and_its_wal_and_shm_are_readable_by_the_owner_only(tmp_path: Path) -> None:
    """lethe.db holds tool results and secrets at rest (red team #13 F9: created 0644)."""
    db = tmp_path / "lethe.db"
    ledger = Ledger(f"sqlite:///{db}")
    ledger.create_session("s", "t")
    ledger.append("s", role="user", tool=None, content=b"a", n_tokens=1)
    files = [db, tmp_path / "lethe.db-wal", tmp_path / "lethe.db-shm"]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o600" for p in files}
    ledger.close()


def test_an_existing_world_readable_database_is_narrowed_to_the_owner(tmp_path: Path) -> None:
    db = tmp_path / "lethe.db"
    Ledger(f"sqlite:///{db}").close()
    db.chmod(0o644)
    Ledger(f"sqlite:///{db}").close()
    assert db.stat().st_mode & 0o777 == 0o600
