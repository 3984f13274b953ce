"""Sessions resident in memory: their KV caches, their locks, and the salted system-prompt caches.

Every lock here is taken with a timeout: a request that cannot get its session in time answers
503 with Retry-After instead of parking a worker thread behind a turn that never ends.
"""
from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvkernel import Kernel, KVCache
from ledger import Ledger, SessionRecord
from policies import PolicyEngine, PolicyError, derive_salt

from .chat import Chunk
from .errors import GatewayError, busy, fails_as, not_found
from .tenants import Principal

T = TypeVar("T")


@dataclass
class Priority:
    """A session's priority inputs, kept from its last turn so that choosing a victim costs no
    policy call: per segment (priority, duration_s, entered at, tokens), and the defaults."""

    segments: list[tuple[int, float | None, float, int]] = field(default_factory=list)
    default: int = 0
    offload_min: int = 101  # nothing is offloaded until the policy has spoken

    def now(self, at: float) -> float:
        """Token-weighted mean of the segments' current priorities (a priority past its duration
        reverts to the default); the default for an empty session."""
        total = sum(n for *_, n in self.segments)
        if not total:
            return float(self.default)
        return sum((p if d is None or at - t < d else self.default) * n for p, d, t, n in self.segments) / total


@dataclass
class LiveSession:
    """A session this replica knows: its cache (empty, holding nothing, while evicted), its lock,
    and what the KV budget needs to choose whom to evict (see gateway/residency.py)."""

    record: SessionRecord
    cache: KVCache
    lock: threading.Lock = field(default_factory=threading.Lock)
    chunks: dict[bytes, Chunk] = field(default_factory=dict)  # last request's renderings (Conversation memo)
    reserved: int = 0  # bytes reserved by the running turn (0 when idle)
    last_used: float = field(default_factory=time.monotonic)
    ledger_mark: str | None = None  # the ledger's view when the cache was last in step with it
    priority: Priority = field(default_factory=Priority)


class PrefixCache:
    """Salted system-prompt caches: a new session whose salt and system prompt match clones one.

    The salt is an HMAC of the tenancy scope under a server secret, so two tenants with the same
    prompt never share an entry, and rotating the scope's epoch in Rego retires every entry.
    """

    def __init__(self, capacity: int = 16) -> None:
        self._entries: dict[str, KVCache] = {}
        self._capacity = capacity
        self._lock = threading.Lock()
        self.room: Callable[[int], bool] = lambda _nbytes: True  # the KV budget's say (Residency.fits)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._entries.values())

    def discard(self, key: str) -> bool:
        """Drop one entry, its memory zeroed; False when there is none under `key`."""
        with self._lock:
            cache = self._entries.pop(key, None)
        if cache is None:
            return False
        cache.wipe()
        return True

    def pop_oldest(self) -> bool:
        """Drop the least recently used entry, its memory zeroed; False when there is none."""
        with self._lock:
            if not self._entries:
                return False
            cache = self._entries.pop(next(iter(self._entries)))
        cache.wipe()
        return True

    @staticmethod
    def key(salt: str, tokens: tuple[int, ...]) -> str:
        return hashlib.sha256(salt.encode() + b"\0" + repr(tokens).encode()).hexdigest()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> KVCache | None:
        with self._lock:
            cache = self._entries.pop(key, None)
            if cache is None:
                return None
            self._entries[key] = cache  # most recently used last
        return cache.clone()

    def put(self, key: str, cache: KVCache) -> None:
        """Keep a trimmed copy, if the KV budget has room for it (an entry only saves compute)."""
        clone = cache.clone()
        clone.fit()
        if not self.room(clone.nbytes):
            clone.wipe()
            return
        with self._lock:
            self._entries[key] = clone
            while len(self._entries) > self._capacity:
                self._entries.pop(next(iter(self._entries))).wipe()


class Sessions:
    """The caller's sessions: tenant scoping, creation with a policy-derived salt, residency."""

    def __init__(self, kernel: Kernel, ledger: Ledger, policy: PolicyEngine, salt_secret: bytes) -> None:
        self.kernel = kernel
        self._ledger = ledger
        self._policy = policy
        self._salt_secret = salt_secret
        self._resident: dict[str, LiveSession] = {}
        self._lock = threading.Lock()
        self.prefixes = PrefixCache()

    def salt(self, principal: Principal) -> str:
        """The session's cache salt: Rego names the scope, the server's secret keys the HMAC."""
        try:
            with fails_as("policy"):
                tenancy = self._policy.tenancy({"tenant": principal.tenant, "user": principal.user,
                                                "public_prefix": False})
        except GatewayError as err:
            if not isinstance(err.__cause__, PolicyError):
                raise
            raise GatewayError(403, "tenancy_refused",
                               f"the tenancy policy gives no cache scope for this caller ({err.__cause__}); a tenant "
                               "scoped per user needs keys made with `lethe key create --user NAME`") from err
        return derive_salt(self._salt_secret, tenancy)

    def open(self, principal: Principal, session_id: str | None) -> LiveSession:
        """The caller's session (404 for an unknown id or another tenant's), or a new one."""
        if principal.tenant is None:
            raise GatewayError(403, "tenant_required", "chat needs a tenant key; the global admin key has no tenant")
        if session_id is None:
            salt = self.salt(principal)
            with fails_as("ledger"):
                record = self._ledger.create_session("ses_" + secrets.token_hex(12), principal.tenant,
                                                     principal.user, salt_scope=salt)
            return self.resident(record)
        with self._lock:
            live = self._resident.get(session_id)
        if live is not None and live.record.tenant == principal.tenant and principal.may_see(self._policy, live.record):
            return live
        return self.resident(self.scoped(principal, session_id))

    def scoped(self, principal: Principal, session_id: str) -> SessionRecord:
        """The session if the caller may see it; 404 otherwise (as for another tenant's, so that
        ids do not leak which sessions exist)."""
        with fails_as("ledger"):
            record = self._ledger.get_session(session_id, None if principal.is_admin and principal.tenant is None
                                              else principal.tenant)
        if record is None or not principal.may_see(self._policy, record):
            raise not_found("session", session_id)
        return record

    def audit_filter(self, principal: Principal) -> Callable[[dict[str, Any]], bool] | None:
        """For a caller who sees only its own sessions: whether an audit record body is about one
        of them (or about no session). None when the tenant scoping of the audit API suffices."""
        if not principal.owner_only(self._policy):
            return None
        owners: dict[str, str | None] = {}

        def sees(body: dict[str, Any]) -> bool:
            sid = body.get("session")
            if not isinstance(sid, str):
                return True
            if sid not in owners:
                record = self._ledger.get_session(sid, principal.tenant)
                owners[sid] = record.user if record is not None else None
            return owners[sid] is not None and owners[sid] == principal.user
        return sees

    def resident(self, record: SessionRecord) -> LiveSession:
        with self._lock:
            live = self._resident.get(record.id)
            if live is None:
                live = LiveSession(record, self.kernel.new_cache(0))  # room is reserved per turn
                self._resident[record.id] = live
            return live

    def get(self, session_id: str) -> LiveSession | None:
        with self._lock:
            return self._resident.get(session_id)

    def all(self) -> list[LiveSession]:
        with self._lock:
            return list(self._resident.values())

    @contextmanager
    def hold(self, session: LiveSession | SessionRecord, timeout_s: float) -> Iterator[LiveSession]:
        """The session's lock, on the one object that stands for it when the lock is taken.

        An idle session that holds nothing is forgotten here (`prune`), and an ended one removed,
        by whoever holds its lock; a request that waited on the old object's lock then re-registers
        it, or moves to the object created meanwhile, so two objects never serve one session."""
        live = session if isinstance(session, LiveSession) else self.resident(session)
        deadline = time.monotonic() + timeout_s
        while True:
            if not live.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise busy(f"session {live.record.id}", timeout_s)
            if self.adopt(live):
                break
            live.lock.release()
            live = self.resident(live.record)
        try:
            yield live
        finally:
            self.prune(live)
            live.lock.release()

    def adopt(self, live: LiveSession) -> bool:
        """Register `live` again if its session was pruned or ended meanwhile; False when another
        object now stands for the session (the caller must not use this one)."""
        with self._lock:
            return self._resident.setdefault(live.record.id, live) is live

    def registered(self, live: LiveSession) -> bool:
        with self._lock:
            return self._resident.get(live.record.id) is live

    def prune(self, live: LiveSession) -> None:
        """Forget a session that holds nothing here (its lock held by the caller): it costs no
        memory until its next request, which rebuilds or restores it. Without this every session
        ever served, and every refused first turn, kept an object for the life of the process."""
        if len(live.cache) or live.cache.nbytes or live.reserved:
            return
        with self._lock:
            if self._resident.get(live.record.id) is live:
                del self._resident[live.record.id]

    def remove(self, session_id: str) -> None:
        with self._lock:
            self._resident.pop(session_id, None)


# Rows a prefill computes per hold of the model lock. Between pieces a turn checks whether its
# client left (or the gateway is stopping), and other sessions' turns get the model: a long prompt
# abandoned by its client stops within one piece instead of running to its end. The piece also
# bounds a prefill's activations, memory outside the KV budget. Pieces give the same bits as one
# call (the kernel's canonical forward is chunking-invariant).
PREFILL_PIECE = 512


def prefill_pieces(tokens: Sequence[int]) -> Iterator[Sequence[int]]:
    for at in range(0, len(tokens), PREFILL_PIECE):
        yield tokens[at:at + PREFILL_PIECE]


class Compute:
    """The model lock and the model's thread: one model serves every session, so kernel calls take
    turns, and every one of them runs on one thread.

    Why one thread: MKL and OpenMP keep per-thread state (GEMM packing buffers, a thread team) for
    each thread that ever ran a GEMM, about 23 MB a thread on SmolLM2's shapes (measured), and
    ThreadPoolExecutor threads live for ever. With kernel calls made from each of the 32 turn
    threads the process grew by ~0.7 GB outside the KV budget, flood after flood (red team); here
    that state exists once.

    The lock is reentrant, so that a tool result's whole admission can hold it while the kernel
    calls inside take it again. Held only inside one synchronous call, never across a yield to a
    client.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._local = threading.local()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model",
                                          initializer=lambda: setattr(self._local, "model", True))

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self.lock:
            if getattr(self._local, "model", False):  # a kernel call made from a kernel call
                return fn(*args, **kwargs)
            return self._worker.submit(fn, *args, **kwargs).result()
