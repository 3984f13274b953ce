"""Compiled Hyperscan databases kept between processes, so a Gate starts in a second, not in ~15.

Compiling the rules (one multi-pattern database per layer and one start-of-match database per
pattern) is most of a Gate's start-up, and every process that builds one (the gateway, `lethe
mcp`, each test server) compiled the same patterns again. A database is a pure function of its
expressions, ids, flags and mode, of the Hyperscan release and of the CPU it was compiled for
(Hyperscan picks instructions for the host), so the cache key is a SHA-256 over all of them.

What a cache file holds, and why each part: a magic and format version; the key it was written
for (a file copied under another entry's name is refused, not trusted); a SHA-256 of the payload
(Hyperscan's own loader accepted a database with flipped bytes when this was measured, so
corruption is caught here); and the payload: ``D`` + the serialized database, or ``E`` + the
compile error (a pattern Hyperscan rejects in one mode is retried in another on every start, and
that failed compile is as slow as a good one). Anything that does not check out is compiled again
and rewritten. Writes are atomic (a temporary file renamed over the entry).

Trust: whoever can write the cache directory can replace a rule's database, i.e. switch a rule
off. The directory therefore has the trust of the code itself: it is created 0700, and one that
is not owned by this user or that others can write is not used (a warning names the fix; the
gate then compiles every time). Set ``LETHE_GATE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/lethe/gate``, else ``~/.cache/lethe/gate``) to move it, or to ``off`` to
compile in every process. Within one process, compiled databases are also shared in memory.
"""
from __future__ import annotations

import hashlib
import os
import platform
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

MAGIC = b"LETHE-HS\x01"
MAX_BYTES = 256 << 20  # entries of rule sets no longer used are dropped, oldest first, past this
DATABASE, ERROR = b"D", b"E"
OFF = "off"


class CompileFailed(Exception):
    """Hyperscan refused the expressions (the message is Hyperscan's)."""


def default_dir(named: str | None = None) -> Path | None:
    """``named`` (the gateway's ``gate_cache_dir`` setting), else ``LETHE_GATE_CACHE_DIR``, else
    the user's XDG cache; None (compile in every process) when it is ``off``."""
    named = (named if named is not None else os.environ.get("LETHE_GATE_CACHE_DIR", "")).strip()
    if named.lower() == OFF:
        return None
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lethe" / "gate"


def _cpu_flags() -> str:
    """The host's instruction-set flags: a database compiled for one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def key_of(version: str, mode: int, expressions: Sequence[bytes], ids: Sequence[int], flags: Sequence[int]) -> bytes:
    """SHA-256 over everything a compiled database depends on (length-prefixed, so unambiguous)."""
    h = hashlib.sha256(b"lethe-hyperscan-key-v1")
    parts = [version.encode(), platform.machine().encode(), _cpu_flags().encode(), str(mode).encode()]
    parts += [e for e in expressions] + [f"{i}:{f}".encode() for i, f in zip(ids, flags, strict=True)]
    for part in parts:
        h.update(len(part).to_bytes(8, "big") + part)
    return h.digest()


def _usable(directory: Path) -> bool:
    """Create the directory 0700 if need be; refuse one another user owns or others can write."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as exc:
        log.warning("gate_cache_unusable", dir=str(directory), error=str(exc),
                    fix="set LETHE_GATE_CACHE_DIR to a writable directory, or to 'off'")
        return False
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("gate_cache_untrusted", dir=str(directory), owner=st.st_uid, mode=oct(st.st_mode & 0o777),
                    fix=f"chmod 700 {directory} as its owner, or set LETHE_GATE_CACHE_DIR to a directory of your own")
        return False
    return True


class CompileCache:
    """``get(key, compile, dump, load)``: the database for ``key`` from memory, disk or ``compile``."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory if directory is not None and _usable(directory) else None
        self._memory: dict[bytes, Any] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # compiles this cache could not spare (for tests and the start-up log)

    def get(self, key: bytes, compile: Callable[[], Any], dump: Callable[[Any], bytes],
            load: Callable[[bytes], Any]) -> Any:
        """The database, or raise ``CompileFailed`` with Hyperscan's message (also cached)."""
        with self._lock:
            if key not in self._memory:
                self._memory[key] = self._read(key, load) or self._compile(key, compile, dump)
            kind, value = self._memory[key]
        if kind == ERROR:
            raise CompileFailed(value)
        return value

    def _compile(self, key: bytes, compile: Callable[[], Any], dump: Callable[[Any], bytes]) -> tuple[bytes, Any]:
        self.compiled += 1
        try:
            db = compile()
        except CompileFailed as exc:
            self._write(key, ERROR + str(exc).encode())
            return ERROR, str(exc)
        self._write(key, DATABASE + dump(db))
        return DATABASE, db

    def _path(self, key: bytes) -> Path | None:
        return None if self.directory is None else self.directory / f"{key.hex()}.hsdb"

    def _read(self, key: bytes, load: Callable[[bytes], Any]) -> tuple[bytes, Any] | None:
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            blob = path.read_bytes()
            payload = _checked(blob, key)
            os.utime(path)  # in use: the last to be pruned
            if payload[:1] == ERROR:
                return ERROR, payload[1:].decode()
            return DATABASE, load(payload[1:])
        except Exception as exc:  # noqa: BLE001 - any bad entry is compiled again, never trusted
            log.warning("gate_cache_entry_rejected", path=str(path), error=str(exc))
            return None

    def _write(self, key: bytes, payload: bytes) -> None:
        path = self._path(key)
        if path is None:
            return
        blob = MAGIC + key + hashlib.sha256(payload).digest() + payload
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            self._prune()
        except OSError as exc:
            log.warning("gate_cache_write_failed", path=str(path), error=str(exc))
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


    def _prune(self) -> None:
        """Drop the least recently used entries while the directory holds over ``MAX_BYTES``."""
        assert self.directory is not None
        entries = []
        for path in self.directory.glob("*.hsdb"):
            try:
                st = path.stat()
            except OSError:  # pruned by another process meanwhile
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= MAX_BYTES:
                break
            path.unlink(missing_ok=True)
            total -= size


def _checked(blob: bytes, key: bytes) -> bytes:
    """The payload of a cache file, after its magic, key and checksum check out."""
    head = len(MAGIC)
    if blob[:head] != MAGIC:
        raise ValueError("not a Lethe gate cache file (magic)")
    if blob[head:head + 32] != key:
        raise ValueError("written for another key")
    digest, payload = blob[head + 32:head + 64], blob[head + 64:]
    if hashlib.sha256(payload).digest() != digest or payload[:1] not in (DATABASE, ERROR):
        raise ValueError("checksum mismatch (corrupt or truncated)")
    return payload


_SHARED: dict[Path | None, CompileCache] = {}
_SHARED_LOCK = threading.Lock()


def compile_cache(setting: str | None = None) -> CompileCache:
    """The process's cache for a ``gate_cache_dir`` setting (None: ``LETHE_GATE_CACHE_DIR``)."""
    return shared(default_dir(setting))


def shared(directory: Path | None) -> CompileCache:
    """One cache per directory in a process (None: memory only), so Gates built in one process
    share their compiled databases."""
    with _SHARED_LOCK:
        if directory not in _SHARED:
            _SHARED[directory] = CompileCache(directory)
        return _SHARED[directory]
