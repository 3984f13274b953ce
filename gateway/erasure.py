"""Erasure and retention: exact forgets (policy, API, retention sweeper) and amortize splices, audited.

Order of every erasure: kernel, then ledger, then audit. The erasure stands even if the audit
write then fails (failing toward erasure); the caller gets a 503 naming the audit and the segments
whose record is missing.

What a turn owes once its ledger rows are written — its audit records, the forgets of what the
policy admitted for that turn only — is written as intents in the same ledger transaction
(`turn_intents`), done at the turn's end, and, if the process died first, at the next start-up
before the gateway turns ready (`settle`). Each audit record of an intent is appended under a key
(`AuditLog.append_keyed`), so redoing an intent never audits twice. A forget owed by a session
whose cache died with the process rebuilds the cache from the ledger first, so the kernel still
forgets and witnesses it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import structlog

from audit import AuditLog
from ledger import ContentStore, ErasureIncomplete, Intent, Ledger, Segment, SegmentState, SessionRecord
from policies import PolicyEngine

from .chat import ChatMessage, Conversation, stub_text
from .errors import GatewayError, NoRoom, fails_as, not_found
from .metrics import Metrics
from .residency import Residency
from .sessions import LiveSession, PrefixCache, Sessions, prefill_pieces
from .tenants import Principal
from .turn import Staged, Turn

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
    """The audit kind of erasing `seg`: a superseded segment holds no cache range (nor does one the
    ledger forgot already, when a crash came before its record), so its erasure is of stored
    content only and carries no never-saw witness."""
    return CONTENT_ERASE if seg.state in DEAD else kind


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


def segment_tokens(conv: Conversation, k: int, seg: Segment, content: ContentStore) -> tuple[int, ...]:
    """What segment `seg` (message k of `conv`) holds in the cache: nothing once dead, the stub of a
    quarantined or amortized result, the redacted text of a redacted one, else the message."""
    if seg.state in DEAD:
        return ()
    if seg.state in (SegmentState.QUARANTINED, SegmentState.AMORTIZED):
        return conv.stub(k, stub_reason_of(seg))
    if "redaction" in seg.meta and seg.replacement_sha256:  # only the redacted text ever entered
        return conv.chunk(k, content.get(seg.replacement_sha256).decode("utf-8", "replace"))
    return conv.chunk(k)


def turn_intents(staged: list[Staged], appended: Sequence[Segment]) -> list[tuple[str, dict[str, Any]]]:
    """What a turn owes once its rows are written, stored with them: its audit records (quarantine,
    redact), and the forget or amortize of what the policy admitted for this turn only. Stored, so
    that a crash between the turn's commit and its end cannot leave that content live."""
    records = [{**s.audit, "segment_id": seg.id, "span": [seg.start, seg.end]}
               for s, seg in zip(staged, appended) if s.audit is not None]
    owed = {kind: {seg.id: {"action": kind, "reasons": list(s.action.reasons),
                            **({"stub": list(s.stub)} if kind == "amortize" else {})}
                   for s, seg in zip(staged, appended) if s.action is not None and s.action.action == kind}
            for kind in ("forget", "amortize")}
    return ([("audit", {"records": records})] if records else []) + \
        [(kind, {"segments": list(decisions), "decisions": decisions}) for kind, decisions in owed.items() if decisions]


def intent_keys(intent: Intent, names: Sequence[str]) -> list[str]:
    """The audit idempotency key of each record an intent owes."""
    return [f"{intent.id}/{name}" for name in names]


class Erasure:
    def __init__(self, *, sessions: Sessions, ledger: Ledger, audit: AuditLog, policy: PolicyEngine,
                 metrics: Metrics, compute: Any, witness_mode: str, lock_timeout_s: float, tokenizer: Any,
                 residency: Residency) -> None:
        self.tokenizer = tokenizer  # to rebuild a cache from the ledger (`rebuild`)
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

    def relay(self, intent: Intent) -> list[int]:
        """Append the audit records a turn owes (once, keyed), then drop the intent."""
        records = intent.payload["records"]
        with fails_as("audit"):
            indices = self.audit.append_keyed(list(zip(intent_keys(intent, [str(i) for i in range(len(records))]), records)))
        self._done(intent)
        return indices

    def _done(self, intent: Intent) -> None:
        """Drop a done intent. Failing here only leaves it to be redone, which its keys make a no-op."""
        try:
            self.ledger.intent_done(intent.id)
        except Exception as exc:
            log.error("intent.done_failed", intent=intent.id, error=f"{type(exc).__name__}: {exc}")

    def post_turn(self, turn: Turn) -> list[dict[str, Any]]:
        """Forget (exactly) or amortize what the policy admitted for this turn only, and do whatever
        else the session still owes from before (its intents). The caller holds the session's lock."""
        return self._settle_session(turn.live)

    def settle(self) -> int:
        """Do what turns still owe, session by session under its lock: at start-up (after a crash)
        and on every sweeper pass. A session busy with a turn is left to that turn's end (its own
        intents are not owed yet). Returns how many sessions owed something and were settled."""
        with fails_as("ledger"):
            sessions = dict.fromkeys(i.session_id for i in self.ledger.pending_intents())
        done = 0
        for session_id in sessions:
            record = self.ledger.get_session(session_id)
            if record is None:
                continue
            try:
                with self.sessions.hold(record, min(self.lock_timeout_s, 1.0)) as live:
                    try:
                        self._settle_session(live)
                    finally:
                        self.residency.settle(live)  # a rebuild's KV reservation is given back
                    done += 1
            except GatewayError as err:
                if err.code != "session_busy":
                    raise
        if done:
            log.info("intents.settled", sessions=done)
        return done

    def _settle_session(self, live: LiveSession) -> list[dict[str, Any]]:
        """The session's intents, its audit records first; returns the forgets done."""
        with fails_as("ledger"):
            owed = sorted(self.ledger.pending_intents(session_id=live.record.id), key=lambda i: i.kind != "audit")
        done: list[dict[str, Any]] = []
        for intent in owed:
            if intent.kind == "audit":
                self.relay(intent)
            elif intent.kind == "amortize":
                done.extend(self._amortize_owed(live, intent))
            else:
                done.append(self._forget_owed(live, intent))
        return done

    def _owed(self, live: LiveSession, intent: Intent) -> tuple[dict[str, Segment], list[Segment]]:
        """The session's segments by id, and those of them the intent names (gone ones skipped)."""
        with fails_as("ledger"):
            current = {s.id: s for s in self.ledger.segments(live.record.id)}
        return current, [current[i] for i in intent.payload["segments"] if i in current]

    def _forget_owed(self, live: LiveSession, intent: Intent) -> dict[str, Any]:
        """A forget a turn owes, keyed to its intent (a cache lost with the process is rebuilt
        from the ledger first: see `forget`)."""
        _, segments = self._owed(live, intent)
        return self.forget(live, segments, kind="forget", actor="policy", decisions=intent.payload["decisions"],
                           intent=intent)

    def _amortize_owed(self, live: LiveSession, intent: Intent) -> list[dict[str, Any]]:
        """The amortizations a turn owes, keyed to its intent. A cache lost with the process is
        rebuilt from the ledger first; if it cannot be (the ledger no longer renders to its own
        token counts), the content is erased instead (`content-erase`): stronger than the splice
        the policy asked for, never weaker. Segments already amortized only get their record."""
        current, segments = self._owed(live, intent)
        todo = [s for s in segments if s.state is SegmentState.LIVE and s.n_tokens]
        if todo and not len(live.cache) and not self.rebuild(live, list(current.values())):
            return [self.forget(live, todo, kind=CONTENT_ERASE, actor="policy", intent=intent)]
        keys = iter(intent_keys(intent, [s.id for s in todo]))
        results = [self._amortize(live, seg, intent.payload["decisions"][seg.id], next(keys)) for seg in todo]
        self._done(intent)
        return results

    def rebuild(self, live: LiveSession, segments: list[Segment]) -> bool:
        """Prefill the session's (empty) cache with what its ledger says it holds, within the KV
        budget (the caller settles the reservation); False (cache left empty) when a segment does
        not render to its recorded token count. The caller holds the session's lock."""
        conversation = [s for s in segments if s.state is not SegmentState.SUPERSEDED]
        content = self.ledger.content
        texts = [content.get(s.content_sha256).decode("utf-8", "surrogatepass")
                 if s.state is SegmentState.LIVE and content.exists(s.content_sha256) else "" for s in conversation]
        # trusted rows, not a request: no wire validation (a tool row keeps no tool_call_id)
        conv = Conversation(self.tokenizer, [ChatMessage.model_construct(role=s.role, content=t)  # type: ignore[arg-type]
                                             for s, t in zip(conversation, texts)])
        tokens: list[int] = []
        for k, seg in enumerate(conversation):
            piece = segment_tokens(conv, k, seg, content)
            if len(piece) != seg.n_tokens:
                log.error("cache.rebuild_mismatch", session=live.record.id, segment=seg.id,
                          ledger_tokens=seg.n_tokens, rendered=len(piece))
                return False
            tokens.extend(piece)
        self.residency.reserve(live, len(tokens))  # within the KV budget, or 503 kv_budget_exhausted
        with fails_as("kernel"):
            for chunk in prefill_pieces(tokens):
                self._compute(live.cache.extend, chunk)
        log.info("cache.rebuilt", session=live.record.id, tokens=len(tokens))
        return True

    # ---- exact forget -------------------------------------------------------------------------

    def forget(self, live: LiveSession, segments: list[Segment], *, kind: str, actor: str,
               decisions: dict[str, dict[str, Any]] | None = None, intent: Intent | None = None,
               copies: dict[str, Any] | None = None) -> dict[str, Any]:
        """Exact erasure of whole segments: kernel, then ledger, then one audit record per segment
        (keyed, and the intent dropped after, when it is owed by a turn).

        `copies`: what `Residency.admit` did to the session's other copies first (an offloaded copy
        is restored, verified and erased, so the forget runs on the one copy left); the records
        name every copy touched, the resident cache and any prefix-cache entry included."""
        copies = {**(copies or {}), **self._prefix_copies(live, segments)}
        spans = sorted((s.start, s.end) for s in segments if s.n_tokens > 0)
        rebuilt, result = 0, None
        started = time.perf_counter()
        try:
            if spans and not len(live.cache) and kind == "forget":
                kind, rebuilt = self._resident_for_witness(live)
            if spans and not len(live.cache):  # no copy in memory (retention, content-erase): ledger only
                copies["resident"] = "none"
                spans = []
            result = self._forget_kernel(live, spans) if spans else None
        except NoRoom as err:
            kind, spans = CONTENT_ERASE, []
            copies["resident"] = self._wiped_for_room(live, err)
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
            copies["resident"] = {"action": "forgotten-exact", "tokens_after": len(live.cache),
                                  **({"rebuilt_from_ledger": rebuilt} if rebuilt else {})}
        records = [{**self._erasure_record(stored_kind(kind, s), live.record, s, actor,
                                           None if s.state in DEAD else witness,
                                           (decisions or {}).get(s.id)), "copies": copies} for s in segments]
        keys = intent_keys(intent, [s.id for s in segments]) if intent is not None else None
        if result is not None and result.pending is not None:
            result.pending.add_done_callback(lambda fut: self._append_deferred(records, keys, intent, fut))
            indices: list[int | None] = [None] * len(records)
        else:
            indices = self.append_records(records, keys)
            if intent is not None:
                self._done(intent)
        log.info("forget.done", session=live.record.id, kind=kind, segments=[s.id for s in segments],
                 spans=spans, ms=round(elapsed * 1e3, 1), equal=witness.get("equal") if witness else None)
        return {"kind": kind, "segments": [s.id for s in segments], "spans": [list(s) for s in spans],
                "audit_indices": indices, "witness": witness, "latency_ms": round(elapsed * 1e3, 3)}

    def _wiped_for_room(self, live: LiveSession, err: NoRoom) -> dict[str, Any]:
        """No room in the KV budget for the never-saw witness (a session near the budget's size,
        or too many turns mid-flight): erasure must not wait for memory, so the resident cache is
        zeroed and dropped instead (the next turn rebuilds the survivors from the ledger), and
        the records are `content-erase`, which claims no witness. Returns the copy's entry."""
        tokens = len(live.cache)
        log.warning("forget.no_room_for_witness", session=live.record.id, tokens=tokens, reason=err.message)
        self.residency.drop(live)
        return {"action": "wiped", "tokens": tokens, "reason": "no room in the KV budget for the never-saw witness"}

    def _forget_kernel(self, live: LiveSession, spans: list[tuple[int, int]]) -> Any:
        """The kernel's forget, with the witness's reference of the survivors claimed in the
        budget (deferred: also the copy the worker checks, until it ends). No rollback copy is
        kept (`rollback=False`): a forget that fails leaves the cache wiped, never the span
        back in memory, and a session near half the budget keeps its witness. A deferred
        witness that cannot get room for two copies runs inline, which needs one."""
        witness = self.sessions.kernel.cache_bytes(len(live.cache) - sum(b - a for a, b in spans))
        if self.witness_mode == "deferred":
            try:
                return self._edit(live, 2 * witness, live.cache.forget, spans, witness="deferred", rollback=False)
            except NoRoom:
                log.info("forget.witness_inline", session=live.record.id, reason="no room for a deferred copy")
        return self._edit(live, witness, live.cache.forget, spans, witness="full", rollback=False)

    def _edit(self, live: LiveSession, nbytes: int, edit: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a kernel edit of `live`'s cache on the model thread with the `nbytes` it holds
        beside the cache claimed in the KV budget first (or the 503). Given back when the edit
        returns, or when its deferred witness ends."""
        release = self.residency.claim_beside(live, nbytes)
        try:
            with fails_as("kernel"):
                result = self._compute(edit, *args, **kwargs)
        except BaseException:
            release()
            raise
        pending = getattr(result, "pending", None)
        if pending is None:
            release()
        else:
            pending.add_done_callback(lambda _done: release())
        return result

    def _resident_for_witness(self, live: LiveSession) -> tuple[str, int]:
        """A forget of a session with no cache in memory (dropped by the KV budget, or lost with a
        restart): its record must carry the kernel's never-saw witness, so the cache is rebuilt
        from the ledger (within the budget) and the forget runs on it. If the ledger no longer
        renders to its own token counts (the model changed), the stored content is erased instead
        (`content-erase`, which claims no witness). Returns the kind and the tokens rebuilt."""
        with fails_as("ledger"):
            segments = self.ledger.segments(live.record.id)
        if not self.rebuild(live, segments):
            return CONTENT_ERASE, 0
        return "forget", len(live.cache)

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
                        witness: dict[str, Any] | None, decision: dict[str, Any] | None) -> dict[str, Any]:
        decision = {**decision, "bundle_hash": seg.meta.get("decision", {}).get("bundle_hash")} if decision else \
            seg.meta.get("decision")
        return audit_body(kind, record, seg.id, (seg.start, seg.end), seg.n_tokens, seg.content_sha256,
                          seg.meta.get("gate"), decision, actor, witness)

    def append_records(self, records: list[dict[str, Any]], keys: list[str] | None = None) -> list[int | None]:
        try:
            indices: list[int | None] = list(self.audit.append_keyed(list(zip(keys, records))) if keys is not None
                                             else self.audit.append_many(records))
            self.audit.checkpoint()
            return indices
        except Exception as exc:
            log.error("audit.append_failed", error=type(exc).__name__, segments=[r.get("segment_id") for r in records])
            raise GatewayError(503, "audit_failed",
                               "the span was erased, but its audit record could not be written "
                               f"({type(exc).__name__}); check the audit database and retry the erasure call",
                               retry_after=5) from exc

    def _append_deferred(self, records: list[dict[str, Any]], keys: list[str] | None, intent: Intent | None,
                         future: Any) -> None:
        witness = future.result().to_dict()
        for r in records:
            r["witness"] = witness if r["kind"] != CONTENT_ERASE else None
        self.append_records([{k: v for k, v in r.items() if v is not None} for r in records], keys)
        if intent is not None:
            self._done(intent)

    def _amortize(self, live: LiveSession, seg: Segment, decision: dict[str, Any], key: str) -> dict[str, Any]:
        """Leyline splice: the span is replaced by its stub, positions fixed. NOT erasure."""
        stub = tuple(decision["stub"])
        started = time.perf_counter()
        size = self.sessions.kernel.cache_bytes(len(live.cache) + len(stub))
        result = self._edit(live, 3 * size, live.cache.amortize, (seg.start, seg.end), stub)
        elapsed = time.perf_counter() - started
        with fails_as("ledger"):
            self.ledger.amortize(live.record.id, seg.id, len(stub), stub_text(stub_reason_of(seg)).encode())
        witness = result.witness.to_dict()
        indices = self.append_records([self._erasure_record(
            "amortize", live.record, seg, "policy", witness,
            {"action": decision["action"], "reasons": decision["reasons"]})], [key])
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
        with self.sessions.hold(record, self.lock_timeout_s) as live:
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
        with self.sessions.hold(record, min(self.lock_timeout_s, 1.0)) as live:
            current = {s.id: s for s in self.ledger.segments(record.id)}
            fresh = [current[s.id] for s in live_segments if current[s.id].state not in DEAD]
            if fresh:
                copies = self.residency.admit(live)
                self.forget(live, fresh, kind="retention-forget", actor="retention", copies=copies)
                self.residency.settle(live)
        return len(quarantined) + len(live_segments)


def _gate_input(summary: dict[str, Any]) -> dict[str, Any]:
    return {"injection": summary.get("injection", 0.0), "secret": summary.get("secret", 0.0), "findings": []}
