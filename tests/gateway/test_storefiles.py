"""A database file the filesystem will not let SQLite write (immutable or append-only) is refused at
start, naming the file and the fix, instead of a SIGBUS on SQLite's first touch of its shared
memory (red team F10: `chattr +i` ended the proxy, and every restart died the same way)."""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import storefiles
from gateway.config import Settings
from gateway.wiring import build_state

ROOT = Path(__file__).parents[2]


def _wal_database(path: Path) -> sqlite3.Connection:
    """A WAL database held open, so that its -wal and -shm files exist."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    return conn


@pytest.mark.parametrize(("flag", "what", "fix"), [(0x10, "immutable", "chattr -i"), (0x20, "append-only", "chattr -a")])
@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
def test_a_locked_database_file_is_refused_at_start_naming_the_file_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: int, what: str, fix: str, suffix: str) -> None:
    """Injected flags, so the path runs on any filesystem: the gateway's stores are never opened."""
    db = tmp_path / "lethe.db"
    locked = db.with_name(db.name + suffix)
    real = storefiles.inode_flags
    monkeypatch.setattr(storefiles, "inode_flags", lambda p: flag if Path(p) == locked else real(p))
    with pytest.raises(SystemExit, match=f"database file {locked} is {what}.*run `{fix} {locked}`"):
        build_state(Settings(data_dir=tmp_path, database_url=f"sqlite:///{db}"))
    assert not db.exists()  # refused before SQLite created anything


def test_flags_are_read_where_the_filesystem_keeps_them_and_zero_elsewhere(tmp_path: Path) -> None:
    assert storefiles.inode_flags(tmp_path / "absent.db") == 0
    assert storefiles.inode_flags(tmp_path) & 0x30 == 0
    assert storefiles.sqlite_files("postgresql+psycopg://h/db") == [] == storefiles.sqlite_files("sqlite://")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("chattr") is None,
                    reason="chattr +i needs root (CAP_LINUX_IMMUTABLE) and the chattr tool")
def test_lethe_mcp_refuses_an_immutable_shm_file_instead_of_dying_of_sigbus(tmp_path: Path) -> None:
    """The red team's attack for real: `chattr +i` on the -shm file of the proxy's database."""
    db = tmp_path / "lethe.db"
    holder = _wal_database(db)
    shm = db.with_name("lethe.db-shm")
    if subprocess.run(["chattr", "+i", str(shm)], capture_output=True).returncode != 0:
        holder.close()
        pytest.skip(f"this filesystem keeps no immutable flag ({tmp_path})")
    try:
        env = {**os.environ, "LETHE_DATA_DIR": str(tmp_path), "LETHE_DATABASE_URL": f"sqlite:///{db}",
               "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "mcp", "--tenant", "acme",
                               "--upstream", "fx=true"], env=env, capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(shm)], check=True)
        holder.close()
    assert done.returncode == 1, (done.returncode, done.stderr)  # SIGBUS would be -7
    assert f"the database file {shm} is immutable" in done.stderr and f"chattr -i {shm}" in done.stderr
