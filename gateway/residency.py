"""The KV budget: what every session's cache and the prefix caches may hold, and who leaves first.

Every byte of tensor memory a cache holds is counted (its buffer at capacity, logits, a stage's
saved logits, and the prefix caches), and a turn reserves what it can grow to before it grows:
its matched history, its new messages, the generation prompt and `max_tokens`. When a reservation
does not fit, whole idle sessions are evicted, lowest priority first (Rego's `kv_priority`), then
least recently used. A session whose lock is held is never touched (try-acquire only). If nothing
more can go, the turn gets 503 `kv_budget_exhausted` with Retry-After, never an out-of-memory
crash.

An evicted session at or above the offload minimum is written to the offload tier and restored
(verified) on its next turn; below it, it is dropped and rebuilt from the ledger and the request's
messages (the pipeline's ordinary sync). A cache, resident or offloaded, is used only while the
ledger still says what it said when the cache was last in step with it (`ledger_mark`): a forget
or a turn through another replica changes the mark, and the stale copy is wiped, never used.
"""
from __future__ import annotations

import hashlib
import threading
import time
from datetime import datetime, timezone
from typing import Any

import structlog

from kvkernel import Kernel
from ledger import Ledger, Segment, SegmentState
from policies import PolicyEngine

from .errors import GatewayError, busy, fails_as
from .metrics import Metrics
from .offload import Offload, OffloadCopy
from .sessions import LiveSession, Priority, Sessions

log = structlog.get_logger(__name__)


def ledger_mark(segments: list[Segment]) -> str:
    """The ledger's view of what a session's cache holds: every in-cache segment's id, state, range
    and content. Changes when a turn, forget, amortize or rewrite changes the cache's contents."""
    h = hashlib.sha256()
    for s in segments:
        if s.state.in_cache:
            h.update(f"{s.id}|{s.state.value}|{s.start}|{s.end}|{s.content_sha256}|{s.replacement_sha256}\n".encode())
    return h.hexdigest()


class Residency:
    """Budget, eviction, offload and restore of session caches. Thread-safe; see the module doc."""

    def __init__(self, *, kernel: Kernel, ledger: Ledger, policy: PolicyEngine, metrics: Metrics,
                 sessions: Sessions, budget_bytes: int, offload: Offload | None,
                 offload_min_priority: int | None = None, retry_after_s: int = 2) -> None:
        self._kernel = kernel
        self._ledger = ledger
        self._policy = policy
        self._metrics = metrics
        self._sessions = sessions
        self.budget = budget_bytes
        self.offload = offload
        self._offload_min = offload_min_priority
        self._retry_after = retry_after_s
        self._lock = threading.RLock()
        self.peak = 0  # the most bytes ever accounted at once (the bench reports it)

    # ---- accounting ----------------------------------------------------------------------------

    def used(self) -> int:
        """Bytes held or reserved now: each session's max(held, reserved), plus the prefix caches.

        Under the budget's lock, so that the sum is one consistent moment (an eviction and the
        reservation it made room for are never both counted, nor both missed)."""
        with self._lock:
            return sum(max(s.cache.nbytes, s.reserved) for s in self._sessions.all()) + self._sessions.prefixes.nbytes

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit without evicting anyone (for what only saves compute)."""
        with self._lock:
            return self.used() + nbytes <= self.budget

    def _publish(self) -> None:
        used = self.used()
        self.peak = max(self.peak, used)
        self._metrics.kv_resident_bytes.set(used)
        self._metrics.kv_offloaded_bytes.set(self.offload.nbytes if self.offload else 0)

    # ---- a turn's life -------------------------------------------------------------------------

    def admit(self, live: LiveSession) -> dict[str, Any]:
        """At turn start (session lock held): bring an offloaded cache back if it is still the
        ledger's, or wipe a resident one the ledger has moved past. Returns the copies touched."""
        if not self._sessions.adopt(live):  # ended (DELETE) while this request waited, then re-opened
            raise busy(f"session {live.record.id}", 0)
        with fails_as("ledger"):
            mark = ledger_mark(self._ledger.segments(live.record.id))
        touched: dict[str, Any] = {}
        copy = self.offloaded(live)
        if copy is not None:
            touched["offload"] = {"sha256": copy.sha256, "tier": self.offload.tier.name,  # type: ignore[union-attr]
                                  "action": self._restore(live, copy, mark)}
        elif len(live.cache) and live.ledger_mark != mark:
            log.warning("kv.stale_resident", session=live.record.id, tokens=len(live.cache))
            self.drop(live)
            touched["resident"] = "wiped-stale"
        live.ledger_mark = mark if len(live.cache) else None
        return touched

    def offloaded(self, live: LiveSession) -> OffloadCopy | None:
        """The session's copy in the offload tier, if it is there (nothing is restored)."""
        return self.offload.copy_of(live.record.id) if self.offload is not None else None

    def reserve(self, live: LiveSession, tokens: int) -> None:
        """Make room for `live` to hold `tokens` tokens (evicting others), then size its buffer."""
        self._make_room(live, live.cache.bytes_for(tokens))
        live.cache.reserve(tokens)

    def settle(self, live: LiveSession) -> None:
        """At turn end (lock held): trim the buffer to what is held, note the ledger mark, the
        priorities and the time, and give the reservation back."""
        try:
            if not live.cache.staged:
                live.cache.fit()
            segments = self._ledger.segments(live.record.id)
            live.ledger_mark = ledger_mark(segments) if len(live.cache) else None
            live.priority = self._priority(live, segments)
        except Exception as exc:  # the next turn's admit re-checks the mark; a lost priority is 0
            log.error("kv.settle_failed", session=live.record.id, error=f"{type(exc).__name__}: {exc}")
            live.priority = Priority()
        finally:
            live.reserved = 0
            live.last_used = time.monotonic()
            with self._lock:
                self._publish()

    def release(self, live: LiveSession) -> dict[str, Any]:
        """Session end (lock held): zero the resident cache, erase the offloaded copy, forget the
        session here. Returns the copies touched, for the audit record."""
        touched: dict[str, Any] = {}
        if live.cache.nbytes:
            touched["resident"] = {"tokens": len(live.cache), "action": "zeroed"}
        copy = self.offload.discard(live.record.id) if self.offload else None
        if copy is not None:
            touched["offload"] = {"sha256": copy.sha256, "tier": self.offload.tier.name,  # type: ignore[union-attr]
                                  "action": "erased"}
        self.drop(live)
        self._sessions.remove(live.record.id)
        with self._lock:
            self._publish()
        return touched

    def close(self) -> None:
        """Shutdown: every offloaded copy is erased (a restarted gateway never trusts them)."""
        if self.offload is not None:
            self.offload.close()

    # ---- eviction ------------------------------------------------------------------------------

    def _make_room(self, live: LiveSession, need: int) -> None:
        """Evict idle sessions until `live` can hold `need` bytes, or refuse at once when even
        evicting every idle session would not be enough: one caller's impossible request must not
        flush every other tenant's sessions out of memory (red team)."""
        with self._lock:
            live.reserved = max(need, live.cache.nbytes)
            try:
                if self._pinned() > self.budget:
                    raise self._exhausted(live, need)
                while self.used() > self.budget:
                    if not (self._evict_one(exclude=live) or self._sessions.prefixes.pop_oldest()):
                        raise self._exhausted(live, need)
            except BaseException:
                live.reserved = 0
                raise
            finally:
                self._publish()

    def _pinned(self) -> int:
        """Bytes no eviction can free: the sessions mid-turn (this one's reservation included)."""
        return sum(max(s.cache.nbytes, s.reserved) for s in self._sessions.all() if s.reserved)

    def _exhausted(self, live: LiveSession, need: int) -> GatewayError:
        """The 503. Its message never says what other sessions hold: that is other tenants' business."""
        why = (f"this session alone needs {need} bytes of KV memory, more than the whole budget of {self.budget}"
               if need > self.budget else "the sessions now mid-turn leave too little room")
        log.warning("kv.budget_exhausted", session=live.record.id, need=need, budget=self.budget,
                    pinned=self._pinned())
        return GatewayError(503, "kv_budget_exhausted",
                            f"KV memory budget exhausted: {why} (LETHE_KV_BUDGET_BYTES={self.budget}); retry "
                            "shortly, lower max_tokens, forget segments or raise the budget",
                            retry_after=self._retry_after)

    def _evict_one(self, exclude: LiveSession) -> bool:
        """Evict the first idle session in (priority, last used) order; False if none can go."""
        now_wall = time.time()
        idle = [s for s in self._sessions.all() if s is not exclude and s.cache.nbytes and not s.reserved]
        idle.sort(key=lambda s: (s.priority.now(now_wall), s.last_used))
        for victim in idle:
            if not victim.lock.acquire(blocking=False):
                continue  # mid-turn (or being erased): never touched
            try:
                if victim.reserved or not victim.cache.nbytes:
                    continue
                self._evict(victim, victim.priority.now(now_wall))
                return True
            finally:
                victim.lock.release()
        return False

    def _evict(self, victim: LiveSession, priority: float) -> None:
        minimum = self._offload_min if self._offload_min is not None else victim.priority.offload_min
        where = "dropped"
        if self.offload is not None and priority >= minimum and len(victim.cache) and victim.ledger_mark:
            copy, lost = self.offload.store(victim.record.id, victim.cache, victim.ledger_mark)
            for gone in lost:
                log.info("kv.offload_dropped", session=gone.session_id, bytes=gone.nbytes)
            if copy is not None:
                where = "offloaded"
                self._metrics.kv_offloads.inc()
        log.info("kv.evicted", session=victim.record.id, tokens=len(victim.cache), bytes=victim.cache.nbytes,
                 priority=round(priority, 2), to=where)
        self._metrics.kv_evictions.labels(where).inc()
        self.drop(victim)

    def drop(self, live: LiveSession) -> None:
        """Zero the cache's memory and leave an empty one that holds nothing."""
        live.cache.wipe()
        live.cache = self._kernel.new_cache(0)
        live.chunks = {}
        live.ledger_mark = None

    # ---- restore -------------------------------------------------------------------------------

    def _restore(self, live: LiveSession, copy: OffloadCopy, mark: str) -> str:
        """Replace the (empty) cache by the verified copy; the copy is erased either way."""
        assert self.offload is not None
        started = time.perf_counter()
        result = "rebuilt"
        try:
            if copy.ledger_mark != mark:
                log.warning("kv.restore_stale", session=live.record.id)
                return "erased-stale"
            self._make_room(live, live.cache.bytes_for(copy.tokens))
            try:
                restored = self.offload.load(copy, self._kernel)
            except ValueError as exc:
                log.warning("kv.restore_refused", session=live.record.id, reason=str(exc))
                return "erased-invalid"
            self.drop(live)
            live.cache = restored
            result = "hit"
            return "restored-erased"
        finally:
            self.offload.discard(live.record.id)
            live.reserved = 0
            self._metrics.kv_restores.labels(result).inc()
            self._metrics.kv_restore_seconds.observe(time.perf_counter() - started)

    # ---- priorities ----------------------------------------------------------------------------

    def _priority(self, live: LiveSession, segments: list[Segment]) -> Priority:
        """The session's priorities from Rego's `kv_priority`; on a policy failure the lowest (0):
        a policy that cannot answer must not pin memory."""
        held = [s for s in segments if s.state.in_cache and s.n_tokens > 0]
        try:
            answer = self._policy.kv_priority({
                "tenant": live.record.tenant,
                "segments": [{"role": s.role, "tool": s.tool, "n_tokens": s.n_tokens,
                              "state": "live" if s.state is SegmentState.LIVE else s.state.value} for s in held]})
        except Exception as exc:
            log.warning("kv.priority_failed", session=live.record.id, error=str(exc))
            return Priority()
        return Priority([(p, d, _epoch(s.created_at), s.n_tokens) for (p, d), s in zip(answer.segments, held)],
                        answer.default, answer.offload_min)


def _epoch(moment: datetime) -> float:
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
