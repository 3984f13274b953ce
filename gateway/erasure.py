"""Erasure and retention: exact forgets (policy, API, retention sweeper) and amortize splices, audited.

Order of every erasure: kernel, then ledger, then audit. The erasure stands even if the audit
write then fails (failing toward erasure); the caller gets a 503 naming the audit and the segments
whose record is missing.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

import structlog

from audit import AuditLog
from ledger import ErasureIncomplete, Ledger, Segment, SegmentState, SessionRecord
from policies import PolicyEngine

from .chat import stub_text
from .errors import GatewayError, busy, fails_as, not_found
from .metrics import Metrics
from .residency import Residency
from .sessions import LiveSession, PrefixCache, Sessions
from .tenants import Principal
from .turn import Action, PostTurn, Turn

log = structlog.get_logger(__name__)

DEAD = (SegmentState.FORGOTTEN, SegmentState.SUPERSEDED)


def audit_body(kind: str, record: SessionRecord, segment_id: str, span: tuple[int, int], token_count: int,
               content_sha256: str, gate: dict[str, Any] | None, decision: dict[str, Any] | None, actor: str,
               witness: dict[str, Any] | None) -> dict[str, Any]:
    """An audit record body: hashes, ranges and verdicts, never the content."""
    body = {"kind": kind, "tenant": record.tenant, "session": record.id, "segment_id": segment_id,
            "span": list(span), "token_count": token_count, "content_sha256": content_sha256, "actor": actor,
            "gate": gate, "decision": decision, "witness": witness}
    return {k: v for k, v in body.items() if v is not None}


CONTENT_ERASE = "content-erase"  # stored content of a segment not in the cache: no kernel work, no witness


def stored_kind(kind: str, seg: Segment) -> str:
    """The audit kind of erasing `seg`: a superseded segment holds no cache range, so its erasure
    is of stored content only and carries no never-saw witness."""
    return CONTENT_ERASE if seg.state is SegmentState.SUPERSEDED else kind


def retention_state(seg: Segment) -> str:
    """The retention policy's `state`: a superseded segment's stored content is kept (and swept)
    as what it was when it entered, classed by its gate summary."""
    if seg.state is not SegmentState.SUPERSEDED:
        return seg.state.value
    return "quarantined" if seg.meta.get("decision", {}).get("action") == "quarantine" else "live"


def actor_of(principal: Principal) -> str:
    who = principal.user or ("admin" if principal.is_admin else "key")
    return f"{principal.tenant or '*'}:{who}"


def stub_reason_of(seg: Segment) -> str:
    return str(seg.meta.get("stub_reason", "policy"))


class Erasure:
    def __init__(self, *, sessions: Sessions, ledger: Ledger, audit: AuditLog, policy: PolicyEngine,
                 metrics: Metrics, compute: Any, witness_mode: str, lock_timeout_s: float,
                 residency: Residency) -> None:
        self.sessions = sessions
        self.residency = residency
        self.ledger = ledger
        self.audit = audit
        self.policy = policy
        self.metrics = metrics
        self._compute = compute
        self.witness_mode = witness_mode
        self.lock_timeout_s = lock_timeout_s

    # ---- the turn's own erasures --------------------------------------------------------------

    def post_turn(self, turn: Turn) -> list[dict[str, Any]]:
        """Forget (exactly) or amortize what the policy admitted for this turn only."""
        pending = turn.pending()
        erasures: list[dict[str, Any]] = []
        forget = [p for p in pending if p.action.action == "forget"]
        if forget:
            erasures.append(self.forget(turn.live, [p.segment for p in forget], kind="forget", actor="policy",
                                        decisions={p.segment.id: p.action for p in forget}))
        for post in pending:
            if post.action.action == "amortize":
                erasures.append(self._amortize(turn.live, post))
        return erasures

    # ---- exact forget -------------------------------------------------------------------------

    def forget(self, live: LiveSession, segments: list[Segment], *, kind: str, actor: str,
               decisions: dict[str, Action] | None = None, copies: dict[str, Any] | None = None) -> dict[str, Any]:
        """Exact erasure of whole segments: kernel, then ledger, then one audit record per segment.

        `copies`: what `Residency.admit` did to the session's other copies first (an offloaded copy
        is restored, verified and erased, so the forget runs on the one copy left); the records
        name every copy touched, the resident cache and any prefix-cache entry included."""
        copies = {**(copies or {}), **self._prefix_copies(live, segments)}
        spans = sorted((s.start, s.end) for s in segments if s.n_tokens > 0)
        if spans and not len(live.cache):  # not resident (a restart): the next rebuild skips them anyway
            if kind == "forget":  # but a forget record carries the kernel's never-saw witness
                raise GatewayError(409, "session_not_resident",
                                   f"session {live.record.id} has no cache in memory (the gateway restarted); send "
                                   "a turn on it to rebuild the cache, then retry the erasure")
            spans = []
        started = time.perf_counter()
        with fails_as("kernel"):
            result = self._compute(live.cache.forget, spans, witness=self.witness_mode) if spans else None
        elapsed = time.perf_counter() - started
        with fails_as("ledger"):
            try:
                self.ledger.forget(live.record.id, [s.id for s in segments])
            except ErasureIncomplete as exc:  # rows erased, a copy may remain at rest: sign nothing
                log.error("forget.incomplete", session=live.record.id, segments=[s.id for s in segments],
                          error=str(exc))
                raise GatewayError(503, "ledger_failed",
                                   f"erasure incomplete in the ledger: {exc}; no audit record was signed, "
                                   "retry the erasure", retry_after=5) from exc
        self.metrics.erasures.labels(kind).inc(len(segments))
        self.metrics.erasure_seconds.observe(elapsed)
        witness = result.witness.to_dict() if result is not None and result.witness is not None else None
        if spans:
            copies["resident"] = {"action": "forgotten-exact", "tokens_after": len(live.cache)}
        records = [{**self._erasure_record(stored_kind(kind, s), live.record, s, actor,
                                           None if s.state is SegmentState.SUPERSEDED else witness,
                                           (decisions or {}).get(s.id)), "copies": copies} for s in segments]
        if result is not None and result.pending is not None:
            result.pending.add_done_callback(lambda fut: self._append_deferred(records, fut))
            indices: list[int | None] = [None] * len(records)
        else:
            indices = self.append_records(records)
        log.info("forget.done", session=live.record.id, kind=kind, segments=[s.id for s in segments],
                 spans=spans, ms=round(elapsed * 1e3, 1), equal=witness.get("equal") if witness else None)
        return {"kind": kind, "segments": [s.id for s in segments], "spans": [list(s) for s in spans],
                "audit_indices": indices, "witness": witness, "latency_ms": round(elapsed * 1e3, 3)}

    def _prefix_copies(self, live: LiveSession, segments: list[Segment]) -> dict[str, Any]:
        """A forgotten system prompt also leaves the salted prefix cache it seeded."""
        first = [s for s in segments if s.start == 0 and s.n_tokens > 0 and s.state.in_cache]
        if not first or len(live.cache) < first[0].end:
            return {}
        key = PrefixCache.key(live.record.salt_scope or "", tuple(live.cache.tokens[:first[0].end]))
        if not self.sessions.prefixes.discard(key):
            return {}
        return {"prefix": {"key_sha256": key, "action": "zeroed"}}

    def _erasure_record(self, kind: str, record: SessionRecord, seg: Segment, actor: str,
                        witness: dict[str, Any] | None, action: Action | None) -> dict[str, Any]:
        decision = {"action": action.action, "reasons": list(action.reasons),
                    "bundle_hash": seg.meta.get("decision", {}).get("bundle_hash")} if action else \
            seg.meta.get("decision")
        return audit_body(kind, record, seg.id, (seg.start, seg.end), seg.n_tokens, seg.content_sha256,
                          seg.meta.get("gate"), decision, actor, witness)

    def append_records(self, records: list[dict[str, Any]]) -> list[int | None]:
        try:
            indices: list[int | None] = list(self.audit.append_many(records))
            self.audit.checkpoint()
            return indices
        except Exception as exc:
            log.error("audit.append_failed", error=type(exc).__name__, segments=[r.get("segment_id") for r in records])
            raise GatewayError(503, "audit_failed",
                               "the span was erased, but its audit record could not be written "
                               f"({type(exc).__name__}); check the audit database and retry the erasure call",
                               retry_after=5) from exc

    def _append_deferred(self, records: list[dict[str, Any]], future: Any) -> None:
        witness = future.result().to_dict()
        for r in records:
            r["witness"] = witness
        self.append_records(records)

    def _amortize(self, live: LiveSession, post: PostTurn) -> dict[str, Any]:
        """Leyline splice: the span is replaced by its stub, positions fixed. NOT erasure."""
        seg = post.segment
        started = time.perf_counter()
        with fails_as("kernel"):
            result = self._compute(live.cache.amortize, (seg.start, seg.end), post.stub)
        elapsed = time.perf_counter() - started
        with fails_as("ledger"):
            self.ledger.amortize(live.record.id, seg.id, len(post.stub), stub_text(stub_reason_of(seg)).encode())
        witness = result.witness.to_dict()
        indices = self.append_records([self._erasure_record("amortize", live.record, seg, "policy", witness,
                                                            post.action)])
        return {"kind": "amortize", "segments": [seg.id], "audit_indices": indices, "witness": witness,
                "latency_ms": round(elapsed * 1e3, 3), "erasure": False}

    # ---- the erasure API ----------------------------------------------------------------------

    def forget_request(self, principal: Principal, session_id: str, selector: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/sessions/{id}/forget: erasure rights from the policy, then an exact forget."""
        record = self.sessions.scoped(principal, session_id)
        with fails_as("policy"):
            decision = self.policy.erasure_allowed({
                "actor": principal.policy_actor(),
                "target": {"tenant": record.tenant, "session_id": record.id, "session_owner": record.user},
                "action": "forget"})
        if not decision.allowed:
            raise GatewayError(403, "erasure_denied", "erasure denied by policy: " + "; ".join(decision.reasons))
        with self.sessions.resident(record).hold(self.lock_timeout_s) as live:
            try:
                copies = self.residency.admit(live)
                result = self.forget(live, self._select(session_id, selector), kind="forget",
                                     actor=actor_of(principal), copies=copies)
            finally:
                self.residency.settle(live)
        with fails_as("audit"):
            indices = [i for i in result["audit_indices"] if i is not None]
            proofs = [self.audit.inclusion_proof(i).to_dict() for i in indices]
            records = [self.audit.get(i).to_dict() for i in indices]
            checkpoint = self.audit.latest_checkpoint().to_dict()
        return {**result, "records": records, "inclusion_proofs": proofs, "checkpoint": checkpoint}

    def _select(self, session_id: str, selector: dict[str, Any]) -> list[Segment]:
        with fails_as("ledger"):
            everything = self.ledger.segments(session_id)
        alive = [s for s in everything if s.state not in DEAD]
        stored = [s for s in everything if s.state is not SegmentState.FORGOTTEN]  # superseded: out of the
        if "segment_id" in selector:  # cache but its content still stored, so it can be erased too
            seg = next((s for s in everything if s.id == selector["segment_id"]), None)
            if seg is None:
                raise not_found("segment", selector["segment_id"])
            if seg.state is SegmentState.FORGOTTEN:
                raise GatewayError(409, "already_forgotten", f"segment {seg.id} is {seg.state.value}")
            return [seg]
        if "content_sha256" in selector:
            found = [s for s in stored if s.content_sha256 == selector["content_sha256"]]
            if not found:
                raise not_found("content", selector["content_sha256"])
            return found
        start, end = selector["span"]
        chosen = [s for s in alive if start <= s.start and s.end <= end and s.n_tokens > 0]
        if not chosen or chosen[0].start != start or chosen[-1].end != end:
            raise GatewayError(422, "span_not_aligned",
                               f"span [{start}, {end}) must cover whole segments; see GET /v1/sessions/{session_id}"
                               "/segments for their token ranges", param="span")
        return chosen

    # ---- retention ----------------------------------------------------------------------------

    def sweep_retention(self, now: datetime | None = None) -> int:
        """Forget every segment whose retention TTL (from the policy) has passed; returns the count.

        A session busy with a turn is skipped (its lock is never waited on for long) and swept on
        the next pass, so one wedged session cannot stop retention for everyone else.
        """
        now = now or datetime.now(timezone.utc)
        sessions: dict[str, SessionRecord] = {}

        def ttl_for(record: SessionRecord, seg: Segment) -> float | None:
            sessions[record.id] = record
            return self.policy.retention({"tenant": record.tenant, "tool": seg.tool or "none",
                                          "state": retention_state(seg),
                                          "gate": _gate_input(seg.meta.get("gate", {}))}).ttl_seconds

        count = self._sweep_superseded(now, ttl_for)
        by_session: dict[str, list[Segment]] = {}
        for seg in self.ledger.expired(now, ttl_for):
            by_session.setdefault(seg.session_id, []).append(seg)
        for session_id, segments in by_session.items():
            try:
                count += self._expire(sessions[session_id], segments)
            except GatewayError as err:
                log.warning("retention.skipped", session=session_id, reason=err.code)
        return count

    def _sweep_superseded(self, now: datetime, ttl_for: Any) -> int:
        """Superseded segments (out of the cache after a history rewrite, content still stored)
        expire like the others: ledger only, no kernel work; one audit record each. A session
        whose superseded segment was swept re-admits its history from that point on its next
        turn (the dead segment no longer matches): slower, never less gated."""
        records: dict[str, SessionRecord] = {}

        def ttl(record: SessionRecord, seg: Segment) -> float | None:
            records[record.id] = record
            stored = [d for d in (seg.content_sha256, seg.replacement_sha256) if d]
            if not any(self.ledger.content.exists(d) for d in stored):
                return None  # nothing of it is stored any more (forgotten before it was superseded)
            return ttl_for(record, seg)  # type: ignore[no-any-return]
        with fails_as("ledger"):
            swept = self.ledger.sweep_superseded(now, ttl)
        if swept:
            self.append_records([audit_body(CONTENT_ERASE, records[seg.session_id], seg.id, (seg.start, seg.end),
                                            seg.n_tokens, seg.content_sha256, seg.meta.get("gate"),
                                            seg.meta.get("decision"), "retention", None) for seg in swept])
        return len(swept)

    def _expire(self, record: SessionRecord, segments: list[Segment]) -> int:
        quarantined = [s.id for s in segments if s.state is SegmentState.QUARANTINED]
        retired = self.ledger.retire_content(record.id, quarantined) if quarantined else []
        if retired:  # the stub stays; the withheld content goes (unless other segments hold it)
            self.append_records([audit_body("retention-retire", record, seg.id, (seg.start, seg.end), seg.n_tokens,
                                            seg.content_sha256, seg.meta.get("gate"), seg.meta.get("decision"),
                                            "retention", None) for seg in retired])
        live_segments = [s for s in segments if s.state is not SegmentState.QUARANTINED]
        if not live_segments:
            return len(quarantined)
        live = self.sessions.resident(record)
        if not live.lock.acquire(timeout=min(self.lock_timeout_s, 1.0)):
            raise busy(f"session {record.id}", 1.0)
        try:
            current = {s.id: s for s in self.ledger.segments(record.id)}
            fresh = [current[s.id] for s in live_segments if current[s.id].state not in DEAD]
            if fresh:
                copies = self.residency.admit(live)
                self.forget(live, fresh, kind="retention-forget", actor="retention", copies=copies)
                self.residency.settle(live)
        finally:
            live.lock.release()
        return len(quarantined) + len(live_segments)


def _gate_input(summary: dict[str, Any]) -> dict[str, Any]:
    return {"injection": summary.get("injection", 0.0), "secret": summary.get("secret", 0.0), "findings": []}
