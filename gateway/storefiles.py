"""The SQLite files a deployment writes, checked before any store opens them.

SQLite maps a WAL database's `-shm` file into memory and writes the mapping on every read and
write. When the file is made immutable or append-only (`chattr +i` / `chattr +a`), the kernel
answers the next write to the mapping with SIGBUS: the process dies at once, with no error to
catch (a red team ended a running proxy that way), and every restart dies the same way on its
first query. So at start the gateway and the proxy look at the database, `-wal` and `-shm` files
of each SQLite URL and refuse, naming the file and the fix, before SQLite touches them.

What this does not cover: flags set while a process runs. That process still dies of SIGBUS at
its next query, which fails closed (no result is passed on whose records were not committed;
committed records stay), and the restart is refused with this message. Setting the flag takes
root (CAP_LINUX_IMMUTABLE) on the host, which can end the process anyway.
"""
from __future__ import annotations

import array
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy.engine import make_url

FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h, _IOR('f', 1, long); the kernel reads and writes an int
LOCKED = {0x10: ("immutable", "chattr -i"), 0x20: ("append-only", "chattr -a")}  # FS_IMMUTABLE_FL, FS_APPEND_FL


def inode_flags(path: Path) -> int:
    """The file's inode flags (`lsattr`), or 0 where it does not exist or its filesystem has none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return 0
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        return flags[0]
    except OSError:  # ENOTTY, EINVAL: tmpfs, overlay and others keep no such flags
        return 0
    finally:
        os.close(fd)


def sqlite_files(url: str) -> list[Path]:
    """The database, `-wal` and `-shm` files of a SQLite file URL; none for another database."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return []
    db = Path(str(parsed.database))
    return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


def refuse_unwritable(urls: Iterable[str]) -> None:
    """SystemExit naming the file and the fix when a database file may not be written."""
    for url in dict.fromkeys(urls):
        for path in sqlite_files(url):
            flags = inode_flags(path)
            for bit, (what, fix) in LOCKED.items():
                if flags & bit:
                    raise SystemExit(f"lethe: the database file {path} is {what}, so SQLite cannot write it (it "
                                     f"would end this process with SIGBUS); run `{fix} {path}` as root, or "
                                     "point LETHE_DATABASE_URL at a writable file")
