"""The offload tier: where an evicted session's KV cache waits, byte for byte, for its next turn.

On CPU the tier is a directory (`$LETHE_DATA_DIR/kv-offload/`); when the kernel runs on CUDA it
is host memory (the device's memory is what the budget protects, and the host is the next tier).
Both hold the same encoding: a JSON header (tokens, shapes, the cache digest at eviction, the
ledger mark), then the raw rows of rotated K, V and pre-RoPE K, one plane of one layer after the
other, then the logits.

A copy is streamed both ways, one plane of one layer at a time (1/90 of a SmolLM2 cache): writing
an evicted session never builds a second whole copy of it in memory, nor does restoring one, so
what an offload costs beyond the KV budget is one plane, not the largest session (red team: RSS
grew far past the budget while copies were encoded whole).

Why every copy is checked twice on the way back: the sha256 of the whole copy (header and token ids
included) is recorded in memory at eviction and recomputed while it is read back; the restored
cache is used only if that matches and its `digest()` equals the digest recorded at eviction, so
nothing the kernel would not have computed ever re-enters a cache. A copy that fails either check
has its partly filled buffer wiped.

Erasure: a copy is deleted by overwriting it with zeros, fsync, then unlink (and fsync of the
directory); in memory the buffer is zeroed before it is dropped, as is every transient plane. On a
copy-on-write or wear-levelling device an overwrite does not reach every physical block (the same
caveat as the ledger's SQLite secure_delete); encrypt the volume if that matters.

The directory is not trusted beyond the files this process wrote: a copy is read and overwritten
only through a descriptor opened without following links and checked to be the regular file this
tier wrote (its device and inode); a symlink, a hard link to another file or a replaced file found
under a copy's name is never read or written through, only its name is unlinked, and the audit
record says the copy was not found instead of "erased" (red team: erasure followed planted links
and zeroed files outside the directory, at start-up without any request).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import stat
import threading
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import structlog
import torch

from kvkernel import Kernel, KernelError, KVCache

log = structlog.get_logger(__name__)

MAGIC = b"LETHEKV2"
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
    """A store of encoded copies; `put` may refuse (None) when the copy cannot be written."""

    name: str

    def put(self, session_id: str, size: int, chunks: Iterable[memoryview]) -> str | None: ...

    def open(self, key: str) -> BinaryIO | None: ...

    def erase(self, key: str) -> bool: ...  # False: what was there was not the copy written

    def keys(self) -> list[str]: ...

    def sweep(self) -> int: ...


def encoded(cache: KVCache, session_id: str, ledger_mark: str) -> tuple[int, str, Generator[memoryview, None, None]]:
    """The copy's size, the cache's digest, and its bytes as chunks: the header, the logits, then
    each plane of each layer (a host copy, zeroed with the device copy once the consumer has moved
    on). Rows beyond the length (always zero) are not stored."""
    digest = cache.digest()
    logits = cache.logits  # a copy
    header = {"session": session_id, "tokens": cache.tokens, "digest": digest, "ledger_mark": ledger_mark,
              "logits": logits is not None}
    head = json.dumps(header, separators=(",", ":")).encode()
    size = 16 + len(head) + (logits.numel() * 4 if logits is not None else 0) + \
        cache.memory().total_bytes

    def chunks() -> Generator[memoryview, None, None]:
        yield memoryview(MAGIC + len(head).to_bytes(8, "big") + head)
        for part in [*([logits] if logits is not None else []), *cache.export_planes()]:
            host = part.cpu()  # a copy when the kernel runs on CUDA
            try:
                yield host.view(torch.uint8).numpy().data.cast("B")
            finally:
                host.zero_()
                part.zero_()
    return size, digest, chunks()


class _Reader:
    """Reads a copy in order, hashing every byte; `exact` reads fail on a short copy."""

    def __init__(self, source: BinaryIO) -> None:  # a file opened "rb": buffered, so it has readinto
        self._source = source
        self.sha256 = hashlib.sha256()

    def exact(self, buffer: bytearray | memoryview) -> None:
        view = memoryview(buffer).cast("B")
        got = 0
        while got < len(view):
            n = self._source.readinto(view[got:])  # type: ignore[attr-defined]
            if not n:
                raise ValueError("the copy is truncated")
            got += n
        self.sha256.update(view)

    def at_end(self) -> bool:
        return not self._source.read(1)


def decoded(kernel: Kernel, source: BinaryIO, copy: OffloadCopy) -> KVCache:
    """The cache a copy holds, read one plane at a time into the new buffer, or ValueError naming
    what is wrong (torn, corrupted, another session's, not what was evicted); a refused cache is
    wiped before the error."""
    reader = _Reader(source)
    lead = bytearray(16)
    reader.exact(lead)
    if not lead.startswith(MAGIC):
        raise ValueError("not a Lethe KV copy (bad magic)")
    head = bytearray(int.from_bytes(lead[8:16], "big"))
    if len(head) > copy.nbytes:
        raise ValueError("header larger than the copy")
    reader.exact(head)
    try:
        header = json.loads(bytes(head))
        tokens, has_logits = list(header["tokens"]), bool(header["logits"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"header unreadable: {exc}") from exc
    shape = kernel.transformer.shape
    dtype = kernel.model.dtype
    plane_bytes = shape.kv_heads * len(tokens) * shape.head_dim * torch.tensor([], dtype=dtype).element_size()
    logits_bytes = shape.vocab * 4 if has_logits else 0
    if len(tokens) != copy.tokens or 16 + len(head) + logits_bytes + 3 * shape.layers * plane_bytes != copy.nbytes:
        raise ValueError("the copy's header does not describe the copy recorded at eviction")  # before any allocation
    logits, plane = bytearray(logits_bytes), bytearray(plane_bytes)

    def planes() -> Iterator[torch.Tensor]:
        for _ in range(3 * shape.layers):
            reader.exact(plane)
            yield torch.frombuffer(plane, dtype=dtype).view(shape.kv_heads, len(tokens), shape.head_dim) \
                if plane else torch.zeros(shape.kv_heads, 0, shape.head_dim, dtype=dtype)
    try:
        reader.exact(logits)
        cache = KVCache.from_planes(kernel, tokens, planes(),
                                    torch.frombuffer(logits, dtype=torch.float32) if logits else None)
    except KernelError as exc:
        raise ValueError(f"rows do not fit this kernel: {exc}") from exc
    finally:
        scrub(plane)
        scrub(logits)
    if not reader.at_end() or reader.sha256.hexdigest() != copy.sha256:  # header (token ids) included
        cache.wipe()
        raise ValueError("the copy's bytes differ from those written at eviction (sha256)")
    if cache.digest() != copy.digest:  # (the header's own digest is under the sha256 above)
        cache.wipe()
        raise ValueError("restored digest differs from the digest recorded at eviction")
    return cache


def _hashed(chunks: Iterable[memoryview], sha: "hashlib._Hash") -> Iterator[memoryview]:
    for chunk in chunks:
        sha.update(chunk)
        yield chunk


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
        self._written: dict[str, tuple[int, int]] = {}  # key -> (device, inode) of the file written

    def put(self, session_id: str, size: int, chunks: Iterable[memoryview]) -> str | None:
        key = f"{hashlib.sha256(session_id.encode()).hexdigest()[:32]}{SUFFIX}"
        tmp = self.dir / f".{key}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                identity = _identity(os.fstat(fd))
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / key)
            self._sync_dir()
        except OSError as exc:
            log.error("kv.offload_write_failed", session=session_id, error=f"{type(exc).__name__}: {exc}")
            self._shred(tmp, None)
            return None
        self._written[key] = identity
        return key

    def open(self, key: str) -> BinaryIO | None:
        """The copy written under `key`, or None if what is there now is anything else."""
        fd = self._open_own(self.dir / key, os.O_RDONLY, self._written.get(key))
        return None if fd is None else os.fdopen(fd, "rb")

    def erase(self, key: str) -> bool:
        erased = self._shred(self.dir / key, self._written.pop(key, None))
        self._sync_dir()
        return erased

    def keys(self) -> list[str]:
        return sorted(p.name for p in self.dir.iterdir() if not p.is_dir() or p.is_symlink())

    def sweep(self) -> int:
        """Erase every entry here (copies and torn tmp files alike; links only unlinked); returns how many."""
        names = self.keys()
        for name in names:
            self._shred(self.dir / name, None)
        self._sync_dir()
        return len(names)

    @staticmethod
    def _open_own(path: Path, flags: int, identity: tuple[int, int] | None) -> int | None:
        """A descriptor on `path` if it is this tier's own copy: opened without following a link,
        a regular file, and the very file written (`identity`); with none known (a file an
        earlier process left), a regular file with no other name. Else None (nothing opened)."""
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone, or a symlink (ELOOP), or not openable: not ours to read or write
            return None
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and (_identity(st) == identity if identity else st.st_nlink == 1):
            return fd
        os.close(fd)
        return None

    @classmethod
    def _shred(cls, path: Path, identity: tuple[int, int] | None) -> bool:
        """Overwrite the copy with zeros, fsync, unlink: the file's blocks never keep the rows.
        Only this tier's own copy is written (`_open_own`); anything else under the name has its
        name unlinked and is left alone. Returns whether the copy itself was overwritten."""
        fd = cls._open_own(path, os.O_RDWR, identity)
        if fd is not None:
            with os.fdopen(fd, "r+b") as f:
                size = os.fstat(fd).st_size
                for at in range(0, size, 1 << 20):
                    f.write(bytes(min(1 << 20, size - at)))
                f.flush()
                os.fsync(fd)
        elif os.path.lexists(path):
            log.warning("kv.offload_foreign", file=path.name,
                        reason="not the copy this tier wrote (a link or another file): unlinked, never written through")
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return fd is not None

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _View(io.RawIOBase):
    """A reader over a held copy's own buffer (io.BytesIO would copy it whole first)."""

    def __init__(self, data: bytearray) -> None:
        self._view = memoryview(data)
        self._at = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), len(self._view) - self._at)
        buffer[:n] = self._view[self._at:self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._view.release()
        super().close()


class HostTier:
    """Copies in host memory, for a kernel on CUDA; an erased copy's buffer is zeroed first."""

    name = "host"

    def __init__(self) -> None:
        self._copies: dict[str, bytearray] = {}
        self._lock = threading.Lock()

    def put(self, session_id: str, size: int, chunks: Iterable[memoryview]) -> str | None:
        key = hashlib.sha256(session_id.encode()).hexdigest()[:32]
        held = bytearray(size)
        at = 0
        for chunk in chunks:
            held[at:at + len(chunk)] = chunk
            at += len(chunk)
        with self._lock:
            self._copies[key] = held
        return key

    def open(self, key: str) -> BinaryIO | None:
        with self._lock:
            held = self._copies.get(key)
        return None if held is None else _View(held)  # type: ignore[return-value]

    def erase(self, key: str) -> bool:
        with self._lock:
            held = self._copies.pop(key, None)
        if held is not None:
            held[:] = bytes(len(held))
        return held is not None

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
        self._pending: dict[str, int] = {}  # writes in flight: session -> bytes
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
        """Write the session's copy, streamed; returns it (None: it cannot fit or be written) and
        the older copies erased to make room (oldest first: those sessions rebuild from the ledger).

        The copy's bytes are counted against the tier's bound (`_pending`) before the write
        starts, so concurrent evictions never write past it together."""
        size, digest, chunks = encoded(cache, session_id, ledger_mark)
        dropped: list[OffloadCopy] = []
        if size > self.max_bytes:
            chunks.close()
            return None, dropped
        with self._lock:
            old = self._copies.pop(session_id, None)
            while self._copies and self._held() + size > self.max_bytes:
                dropped.append(self._copies.pop(next(iter(self._copies))))
            room = self._held() + size <= self.max_bytes
            if room:
                self._pending[session_id] = size
        for gone in ([old] if old else []) + dropped:
            self.tier.erase(gone.key)
        if not room:  # other writes in flight hold the rest of the bound
            chunks.close()
            return None, dropped
        sha = hashlib.sha256()
        try:
            key = self.tier.put(session_id, size, _hashed(chunks, sha))
        finally:
            chunks.close()
            with self._lock:
                del self._pending[session_id]
        if key is None:
            return None, dropped
        copy = OffloadCopy(session_id, key, size, sha.hexdigest(), digest, ledger_mark, len(cache))
        with self._lock:
            self._copies[session_id] = copy
        return copy, dropped

    def _held(self) -> int:
        """Bytes of the copies and of the writes in flight (the lock held)."""
        return sum(c.nbytes for c in self._copies.values()) + sum(self._pending.values())

    def load(self, copy: OffloadCopy, kernel: Kernel) -> KVCache:
        """The verified cache of a copy, streamed into its buffer; ValueError if missing, torn,
        corrupted or not as evicted."""
        source = self.tier.open(copy.key)
        if source is None:
            raise ValueError("the copy is gone")
        with source:
            return decoded(kernel, source, copy)

    def discard(self, session_id: str) -> tuple[OffloadCopy, str] | None:
        """Erase the session's copy (zeros, fsync, unlink); returns the copy and what was done:
        `erased`, or `not-found` when its name held anything but the copy written (a link, a
        replaced or vanished file: only the name was unlinked, so the copy's bytes, if they
        still exist somewhere, were not reached)."""
        with self._lock:
            copy = self._copies.pop(session_id, None)
        if copy is None:
            return None
        return copy, "erased" if self.tier.erase(copy.key) else "not-found"

    def close(self) -> None:
        with self._lock:
            self._copies.clear()
        self.tier.sweep()
