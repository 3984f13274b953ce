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
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

import structlog

from kvkernel import Kernel
from ledger import Ledger, Segment, SegmentState
from policies import PolicyEngine

from .errors import NoRoom, busy, fails_as
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
                 offload_min_priority: int | None = None, retry_after_s: int = 2,
                 compute: Callable[..., Any] = lambda fn, *args: fn(*args)) -> None:
        self._kernel = kernel
        self._ledger = ledger
        self._policy = policy
        self._metrics = metrics
        self._sessions = sessions
        self.budget = budget_bytes
        self.offload = offload
        self._offload_min = offload_min_priority
        self._retry_after = retry_after_s
        self._compute = compute  # buffer moves run on the model thread, one at a time (see reserve)
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)  # notified when an eviction ends or a turn settles
        self._leaving: dict[str, int] = {}  # sessions being evicted now -> the bytes they still hold
        self._beside = 0  # bytes edits hold beside their caches: witnesses' references and copies
        self.peak = 0  # the most bytes ever accounted at once (the bench reports it)

    # ---- accounting ----------------------------------------------------------------------------

    def used(self) -> int:
        """Bytes held or reserved now: each session's max(held, reserved), plus the prefix caches.

        Under the budget's lock, so that the sum is one consistent moment (an eviction and the
        reservation it made room for are never both counted, nor both missed)."""
        with self._lock:
            return _claims(self._sessions.all()) + self._sessions.prefixes.nbytes + self._beside

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
        """Make room for `live` to hold `tokens` tokens (evicting others), then size its buffer.

        Moving a buffer holds the old and the new one for a moment, memory the claim does not
        count; run on the model thread, such moves happen one at a time, so their transient is
        one session's buffer at most, not one per concurrent turn (red team: RSS peaks past the
        budget under concurrent turns)."""
        self._make_room(live, live.cache.bytes_for(tokens))
        self._compute(live.cache.reserve, tokens)

    def settle(self, live: LiveSession) -> None:
        """At turn end (lock held): trim the buffer to what is held, note the ledger mark, the
        priorities and the time, and give the reservation back."""
        try:
            if not live.cache.staged:
                self._compute(live.cache.fit)  # a buffer move (see reserve)
            segments = self._ledger.segments(live.record.id)
            live.ledger_mark = ledger_mark(segments) if len(live.cache) else None
            live.priority = self._priority(live, segments)
        except Exception as exc:  # the next turn's admit re-checks the mark; a lost priority is 0
            log.error("kv.settle_failed", session=live.record.id, error=f"{type(exc).__name__}: {exc}")
            live.priority = Priority()
        finally:
            live.reserved = 0
            live.last_used = time.monotonic()
            with self._room:
                self._publish()
                self._room.notify_all()

    def claim_beside(self, live: LiveSession, nbytes: int) -> Callable[[], None]:
        """Count `nbytes` that an edit of `live` holds beside its cache (the never-saw witness's
        reference cache, a deferred witness's copy, an amortize's rollback copies) against the
        budget, evicting idle sessions for them first, or `NoRoom` when they cannot fit. Returns the release, to call once that memory is freed: after an inline witness,
        or when a deferred one finishes (red team: a forget of a long session held several
        cache-sized temporaries outside the budget, and deferred witnesses queued copies
        without bound)."""
        held = live.reserved
        try:
            self._make_room(live, max(held, live.cache.nbytes) + nbytes)
        except NoRoom as err:
            raise NoRoom(f"this edit (a forget or amortize and its never-saw witness) needs {nbytes} bytes "
                         f"beside the session's cache; {err.message}", retry_after=self._retry_after) from err
        with self._room:
            live.reserved = held
            self._beside += nbytes
            self._publish()
        owed = [nbytes]  # given back once, however often release is called

        def release() -> None:
            with self._room:
                self._beside -= owed.pop() if owed else 0
                self._publish()
                self._room.notify_all()
        return release

    def release(self, live: LiveSession) -> dict[str, Any]:
        """Session end (lock held): zero the resident cache, erase the offloaded copy, forget the
        session here. Returns the copies touched, for the audit record."""
        touched: dict[str, Any] = {}
        if live.cache.nbytes:
            touched["resident"] = {"tokens": len(live.cache), "action": "zeroed"}
        gone = self.offload.discard(live.record.id) if self.offload else None
        if gone is not None:
            touched["offload"] = {"sha256": gone[0].sha256, "tier": self.offload.tier.name,  # type: ignore[union-attr]
                                  "action": gone[1]}
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
        """Evict idle sessions until `live` can hold `need` bytes, then claim them (`reserved`),
        or refuse at once when even evicting every idle session would not be enough: one caller's
        impossible request must not flush every other tenant's sessions out of memory (red team).

        A claim is registered only once it fits, so `used()` never exceeds the budget. A victim's
        copy is written outside the budget lock, its own lock held and its bytes still counted
        until it is dropped (never claimed by another turn before the write is done), so turns
        that fit are not stalled behind a write. A turn short of room waits for the evictions in
        flight when they will free enough, and evicts more only when they will not."""
        claim = max(need, live.cache.nbytes)
        try:
            while (picked := self._next_victim(live, need, claim)) is not None:
                self._evict(*picked)
        finally:
            with self._lock:
                self._publish()

    def _next_victim(self, live: LiveSession, need: int, claim: int) -> tuple[LiveSession, float] | None:
        """None once `live`'s claim fits (it is then registered); else an idle session to evict,
        its lock taken and its bytes marked as leaving. Raises the 503 when nothing more can go."""
        with self._room:
            while True:
                others = [s for s in self._sessions.all() if s is not live]
                pinned = _claims(s for s in others if s.reserved) + claim + self._beside  # no eviction frees it
                if pinned > self.budget:
                    raise self._exhausted(live, need, pinned)
                over = _claims(others) + self._sessions.prefixes.nbytes + self._beside + claim - self.budget
                if over <= 0:
                    live.reserved = claim
                    return None
                if over <= sum(self._leaving.values()):
                    self._room.wait(timeout=1.0)
                    continue
                picked = self._pick(exclude=live)
                if picked is not None:
                    self._leaving[picked[0].record.id] = picked[0].cache.nbytes
                    return picked
                if self._sessions.prefixes.pop_oldest():
                    continue
                if not self._leaving:
                    raise self._exhausted(live, need, pinned)
                self._room.wait(timeout=1.0)  # what is leaving may still be enough

    def _exhausted(self, live: LiveSession, need: int, pinned: int) -> NoRoom:
        """The 503. Its message never says what other sessions hold: that is other tenants' business."""
        why = (f"this session alone needs {need} bytes of KV memory, more than the whole budget of {self.budget}"
               if need > self.budget else "the sessions now mid-turn leave too little room")
        log.warning("kv.budget_exhausted", session=live.record.id, need=need, budget=self.budget,
                    pinned=pinned)
        return NoRoom(f"KV memory budget exhausted: {why} (LETHE_KV_BUDGET_BYTES={self.budget}); retry "
                      "shortly, lower max_tokens, forget segments or raise the budget", retry_after=self._retry_after)

    def _pick(self, exclude: LiveSession) -> tuple[LiveSession, float] | None:
        """The first idle session in (priority, last used) order whose lock is free, locked."""
        now_wall = time.time()
        idle = [s for s in self._sessions.all() if s is not exclude and s.cache.nbytes and not s.reserved
                and s.record.id not in self._leaving]
        idle.sort(key=lambda s: (s.priority.now(now_wall), s.last_used))
        for victim in idle:
            if not victim.lock.acquire(blocking=False):
                continue  # mid-turn (or being erased): never touched
            if not victim.reserved and victim.cache.nbytes and self._sessions.registered(victim):
                return victim, victim.priority.now(now_wall)
            victim.lock.release()
        return None

    def _evict(self, victim: LiveSession, priority: float) -> None:
        """Offload or drop the victim (its lock held, taken by `_pick`), outside the budget lock."""
        try:
            where = "offloaded" if self._offload(victim, priority) else "dropped"
            log.info("kv.evicted", session=victim.record.id, tokens=len(victim.cache), bytes=victim.cache.nbytes,
                     priority=round(priority, 2), to=where)
            self._metrics.kv_evictions.labels(where).inc()
            self.drop(victim)
            self._sessions.prune(victim)
        finally:
            with self._room:
                self._leaving.pop(victim.record.id, None)
                self._room.notify_all()
            victim.lock.release()

    def _offload(self, victim: LiveSession, priority: float) -> bool:
        """Write the victim's copy if it is at or above the offload minimum; False: dropped."""
        minimum = self._offload_min if self._offload_min is not None else victim.priority.offload_min
        if self.offload is None or priority < minimum or not len(victim.cache) or not victim.ledger_mark:
            return False
        try:
            copy, lost = self.offload.store(victim.record.id, victim.cache, victim.ledger_mark)
        except Exception as exc:  # a copy that cannot be written is a rebuild later, never a failed turn now
            log.error("kv.offload_failed", session=victim.record.id, error=f"{type(exc).__name__}: {exc}")
            return False
        for gone in lost:
            log.info("kv.offload_dropped", session=gone.session_id, bytes=gone.nbytes)
        if copy is None:
            return False
        self._metrics.kv_offloads.inc()
        return True

    def drop(self, live: LiveSession) -> None:
        """Zero the cache's memory and leave an empty one that holds nothing."""
        live.cache.wipe()
        live.cache = self._kernel.new_cache(0)
        live.chunks = {}
        live.ledger_mark = None

    # ---- restore -------------------------------------------------------------------------------

    def _restore(self, live: LiveSession, copy: OffloadCopy, mark: str) -> str:
        """Replace the (empty) cache by the verified copy; the copy is erased once read (or found
        stale). A restore that cannot get room raises the 503 and keeps the copy for the retry."""
        assert self.offload is not None
        if copy.ledger_mark != mark:
            log.warning("kv.restore_stale", session=live.record.id)
            self._metrics.kv_restores.labels("rebuilt").inc()
            return self._erased(live, "erased-stale")
        self._make_room(live, live.cache.bytes_for(copy.tokens))
        started = time.perf_counter()
        result, action = "rebuilt", "erased-invalid"
        try:
            restored = self.offload.load(copy, self._kernel)
            self.drop(live)
            live.cache = restored
            result, action = "hit", "restored-erased"
        except (ValueError, OSError) as exc:  # torn, corrupted, unreadable or not ours: rebuilt instead
            log.warning("kv.restore_refused", session=live.record.id, reason=str(exc))
        finally:
            live.reserved = 0
            self._metrics.kv_restores.labels(result).inc()
            self._metrics.kv_restore_seconds.observe(time.perf_counter() - started)
        return self._erased(live, action)

    def _erased(self, live: LiveSession, action: str) -> str:
        """Erase the session's copy after a restore (or its refusal); the action the audit record
        names: `action`, or `not-found` if the copy's name no longer held the copy written."""
        gone = self.offload.discard(live.record.id)  # type: ignore[union-attr]
        return action if gone is None or gone[1] == "erased" else "not-found"

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


def _claims(sessions: Iterable[LiveSession]) -> int:
    """What sessions count against the budget: each one's max(held, claimed for its turn)."""
    return sum(max(s.cache.nbytes, s.reserved) for s in sessions)


def _epoch(moment: datetime) -> float:
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
