"""The offload tier: where an evicted session's KV cache waits, byte for byte, for its next turn.

On CPU the tier is a directory (`$LETHE_DATA_DIR/kv-offload/`); when the kernel runs on CUDA it
is host memory (the device's memory is what the budget protects, and the host is the next tier).
Both hold the same encoding: a JSON header (tokens, shapes, the cache digest at eviction, the
ledger mark, the payload's sha256) and the raw rows of K, V and pre-RoPE K, then the logits.

Why every copy is checked twice on the way back: the payload's sha256 catches a torn or corrupted
copy before a single tensor is built, and the restored cache's `digest()` must equal the digest
recorded at eviction, so nothing the kernel would not have computed ever re-enters a cache.

Erasure: a copy is deleted by overwriting it with zeros, fsync, then unlink (and fsync of the
directory); in memory the buffer is zeroed before it is dropped. On a copy-on-write or
wear-levelling device an overwrite does not reach every physical block (the same caveat as the
ledger's SQLite secure_delete); encrypt the volume if that matters.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
import torch

from kvkernel import Kernel, KVCache

log = structlog.get_logger(__name__)

MAGIC = b"LETHEKV1"
SUFFIX = ".kv"


@dataclass(frozen=True)
class OffloadCopy:
    """Where one evicted session's cache is, and what it must be when it comes back."""

    session_id: str
    key: str  # the file name or the memory slot
    nbytes: int
    sha256: str  # of the whole encoded copy: named in audit records as the copy touched
    digest: str  # KVCache.digest() at eviction
    ledger_mark: str  # the ledger's view of the session at eviction (see residency.ledger_mark)
    tokens: int


class Tier(Protocol):
    """A bounded store of encoded copies; `put` may refuse (None) when the copy cannot fit."""

    name: str

    def put(self, session_id: str, data: bytearray) -> str | None: ...

    def get(self, key: str) -> bytearray | None: ...

    def erase(self, key: str) -> None: ...

    def keys(self) -> list[str]: ...


def encode(cache: KVCache, session_id: str, ledger_mark: str) -> tuple[bytearray, dict[str, object]]:
    """The copy's bytes and its header; rows beyond the length (always zero) are not stored.

    A bytearray, so that the caller can zero it once it is stored (`scrub`)."""
    tokens, rows, logits = cache.export_rows()
    parts = [rows] + ([logits] if logits is not None else [])
    payload = bytearray(sum(t.numel() * t.element_size() for t in parts))
    at = 0
    for t in parts:
        host = t.contiguous().cpu()  # a copy when the kernel runs on CUDA
        flat = host.view(torch.uint8).reshape(-1)
        payload[at:at + flat.numel()] = flat.numpy().data
        at += flat.numel()
        host.zero_()
        t.zero_()
    header = {"session": session_id, "tokens": tokens, "shape": list(rows.shape), "dtype": str(rows.dtype),
              "digest": cache.digest(), "ledger_mark": ledger_mark,
              "payload_sha256": hashlib.sha256(payload).hexdigest(), "logits": logits is not None}
    head = json.dumps(header, separators=(",", ":")).encode()
    data = bytearray(MAGIC + len(head).to_bytes(8, "big") + head)
    data += payload
    scrub(payload)
    return data, header


def decode(kernel: Kernel, data: bytearray, expected_digest: str) -> KVCache:
    """The cache a copy holds, or ValueError naming what is wrong with it (torn, corrupted, another
    session's, not what was evicted)."""
    if len(data) < 16 or not data.startswith(MAGIC):
        raise ValueError("not a Lethe KV copy (bad magic or truncated header)")
    size = int.from_bytes(data[8:16], "big")
    try:
        header = json.loads(bytes(data[16:16 + size]))
        shape, tokens, has_logits = tuple(header["shape"]), header["tokens"], header["logits"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"header unreadable: {exc}") from exc
    payload = memoryview(data)[16 + size:]
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise ValueError("payload sha256 mismatch (truncated or corrupted)")
    dtype = kernel.model.dtype
    count = 1
    for dim in shape:
        count *= dim
    size_rows = count * torch.tensor([], dtype=dtype).element_size()
    try:
        rows = torch.frombuffer(payload[:size_rows], dtype=dtype).reshape(shape) if count else \
            torch.zeros(shape, dtype=dtype)
        logits = torch.frombuffer(payload[size_rows:], dtype=torch.float32) if has_logits else None
        cache = KVCache.from_rows(kernel, tokens, rows, logits)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"rows do not fit this kernel: {exc}") from exc
    finally:
        del payload
    if cache.digest() != expected_digest or header.get("digest") != expected_digest:
        cache.wipe()
        raise ValueError("restored digest differs from the digest recorded at eviction")
    return cache


def scrub(buffer: bytearray) -> None:
    """Zero a transient copy before it is released."""
    buffer[:] = bytes(len(buffer))


class DiskTier:
    """A directory of copies, written atomically: tmp file, fsync, rename, fsync of the directory.

    A restart never trusts what an earlier process left (its ledger may have moved on): every file
    found at start is erased (`sweep`)."""

    name = "disk"

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def put(self, session_id: str, data: bytearray) -> str | None:
        key = f"{hashlib.sha256(session_id.encode()).hexdigest()[:32]}{SUFFIX}"
        tmp = self.dir / f".{key}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / key)
            self._sync_dir()
        except OSError as exc:
            log.error("kv.offload_write_failed", session=session_id, error=f"{type(exc).__name__}: {exc}")
            self._shred(tmp)
            return None
        return key

    def get(self, key: str) -> bytearray | None:
        try:
            path = self.dir / key
            data = bytearray(path.stat().st_size)
            with open(path, "rb") as f:
                f.readinto(data)
            return data
        except OSError:
            return None

    def erase(self, key: str) -> None:
        self._shred(self.dir / key)
        self._sync_dir()

    def keys(self) -> list[str]:
        return sorted(p.name for p in self.dir.iterdir() if p.is_file())

    def sweep(self) -> int:
        """Erase every file here (copies and torn tmp files alike); returns how many."""
        names = self.keys()
        for name in names:
            self.erase(name)
        return len(names)

    @staticmethod
    def _shred(path: Path) -> None:
        """Overwrite with zeros, fsync, unlink: the file's blocks never keep the rows."""
        try:
            size = path.stat().st_size
            with open(path, "r+b") as f:
                for at in range(0, size, 1 << 20):
                    f.write(bytes(min(1 << 20, size - at)))
                f.flush()
                os.fsync(f.fileno())
            path.unlink()
        except FileNotFoundError:
            return

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class HostTier:
    """Copies in host memory, for a kernel on CUDA; an erased copy's buffer is zeroed first."""

    name = "host"

    def __init__(self) -> None:
        self._copies: dict[str, bytearray] = {}
        self._lock = threading.Lock()

    def put(self, session_id: str, data: bytearray) -> str | None:
        key = hashlib.sha256(session_id.encode()).hexdigest()[:32]
        with self._lock:
            self._copies[key] = bytearray(data)
        return key

    def get(self, key: str) -> bytearray | None:
        with self._lock:
            held = self._copies.get(key)
            return None if held is None else bytearray(held)

    def erase(self, key: str) -> None:
        with self._lock:
            held = self._copies.pop(key, None)
        if held is not None:
            held[:] = bytes(len(held))

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._copies)

    def sweep(self) -> int:
        names = self.keys()
        for name in names:
            self.erase(name)
        return len(names)


class Offload:
    """The bounded tier: which sessions have a copy, how many bytes they take, and the checks."""

    def __init__(self, tier: DiskTier | HostTier, max_bytes: int) -> None:
        self.tier = tier
        self.max_bytes = max_bytes
        self._copies: dict[str, OffloadCopy] = {}
        self._lock = threading.Lock()
        swept = tier.sweep()
        if swept:
            log.info("kv.offload_swept", tier=tier.name, copies=swept)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._copies.values())

    def copy_of(self, session_id: str) -> OffloadCopy | None:
        with self._lock:
            return self._copies.get(session_id)

    def store(self, session_id: str, cache: KVCache, ledger_mark: str) -> tuple[OffloadCopy | None, list[OffloadCopy]]:
        """Write the session's copy; returns it (None: it cannot fit) and the older copies erased
        to make room (oldest first: those sessions rebuild from the ledger)."""
        data, header = encode(cache, session_id, ledger_mark)
        try:
            return self._store(session_id, data, header, ledger_mark, len(cache))
        finally:
            scrub(data)

    def _store(self, session_id: str, data: bytearray, header: dict[str, object], ledger_mark: str,
               tokens: int) -> tuple[OffloadCopy | None, list[OffloadCopy]]:
        dropped: list[OffloadCopy] = []
        if len(data) > self.max_bytes:
            return None, dropped
        with self._lock:
            old = self._copies.pop(session_id, None)
            while self._copies and sum(c.nbytes for c in self._copies.values()) + len(data) > self.max_bytes:
                dropped.append(self._copies.pop(next(iter(self._copies))))
        for gone in ([old] if old else []) + dropped:
            self.tier.erase(gone.key)
        key = self.tier.put(session_id, data)
        if key is None:
            return None, dropped
        copy = OffloadCopy(session_id, key, len(data), hashlib.sha256(data).hexdigest(), str(header["digest"]),
                           ledger_mark, tokens)
        with self._lock:
            self._copies[session_id] = copy
        return copy, dropped

    def load(self, copy: OffloadCopy, kernel: Kernel) -> KVCache:
        """The verified cache of a copy; ValueError if missing, torn, corrupted or not as evicted."""
        data = self.tier.get(copy.key)
        if data is None:
            raise ValueError("the copy is gone")
        try:
            if hashlib.sha256(data).hexdigest() != copy.sha256:  # header (token ids) included
                raise ValueError("the copy's bytes differ from those written at eviction (sha256)")
            return decode(kernel, data, copy.digest)
        finally:
            scrub(data)

    def discard(self, session_id: str) -> OffloadCopy | None:
        """Erase the session's copy (zeros, fsync, unlink); returns what was erased."""
        with self._lock:
            copy = self._copies.pop(session_id, None)
        if copy is not None:
            self.tier.erase(copy.key)
        return copy

    def close(self) -> None:
        with self._lock:
            self._copies.clear()
        self.tier.sweep()
