"""The gateway's core: sessions, the tool-result pipeline, erasure and retention.

Each request's messages are reconciled with the session's ledger: the matched prefix stays in
the KV cache, a rewritten tail is superseded, and new messages are appended. Every new tool
result goes through gate → policy → kernel (stage, then commit or rollback) → ledger → audit,
and any failure there leaves the cache without the span (fail closed).

Threading: handlers run this code in worker threads. A per-session lock orders the requests of
one session; a single model lock serialises compute, since one model serves every session.
"""
from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import structlog

from audit import AuditLog
from gate import Gate, GateReport, InjectionProbe
from kvkernel import GenerationConfig, Kernel, KVCache, Model
from ledger import Ledger, Segment, SegmentState, SessionRecord
from policies import PolicyEngine, PolicyError, derive_salt

from .chat import ChatMessage, Chunk, Conversation, RenderedMessage, stub_text
from .errors import GatewayError, not_found, unavailable
from .metrics import Metrics
from .screen import Screened, apply_redact, refuse_withheld
from .tenants import Principal

log = structlog.get_logger(__name__)

_DEAD = (SegmentState.FORGOTTEN, SegmentState.SUPERSEDED)


@dataclass
class LiveSession:
    record: SessionRecord
    cache: KVCache
    lock: threading.Lock = field(default_factory=threading.Lock)
    chunks: dict[bytes, Chunk] = field(default_factory=dict)  # last request's renderings (Conversation memo)


class PrefixCache:
    """Salted system-prompt caches: a new session whose salt and system prompt match clones one.

    The salt is an HMAC of the tenancy scope under a server secret, so two tenants with the same
    prompt never share an entry, and rotating the scope's epoch in Rego retires every entry.
    """

    def __init__(self, capacity: int = 16) -> None:
        self._entries: dict[str, KVCache] = {}
        self._capacity = capacity

    @staticmethod
    def key(salt: str, tokens: tuple[int, ...]) -> str:
        return hashlib.sha256(salt.encode() + b"\0" + repr(tokens).encode()).hexdigest()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> KVCache | None:
        cache = self._entries.pop(key, None)
        if cache is None:
            return None
        self._entries[key] = cache  # most recently used last
        return cache.clone()

    def put(self, key: str, cache: KVCache) -> None:
        self._entries[key] = cache.clone()
        while len(self._entries) > self._capacity:
            del self._entries[next(iter(self._entries))]


@dataclass
class Action:
    """What happened to one tool result, as reported to the client."""

    message_index: int
    segment_id: str | None
    tool: str | None
    action: str
    reasons: tuple[str, ...]
    gate: dict[str, Any]
    audit_index: int | None = None
    overhead_ms: float = 0.0  # gate + policy + ledger + audit, model compute excluded

    def to_dict(self) -> dict[str, Any]:
        return {"message_index": self.message_index, "segment_id": self.segment_id, "tool": self.tool,
                "action": self.action, "reasons": list(self.reasons), "gate": self.gate,
                "audit_index": self.audit_index, "overhead_ms": round(self.overhead_ms, 3)}


class Stopwatch:
    """Adds up the time spent inside its `with` blocks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> "Stopwatch":
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._started


@dataclass(frozen=True)
class Verdict:
    """The gate's report, plus the hidden-state probe's score of the staged content when one runs.

    `injection` is the probe's calibrated stack of both scores: the byte layers catch what is
    written, the probe what the model reads as an instruction.
    """

    report: GateReport
    probe_score: float | None
    injection: float

    @classmethod
    def of(cls, report: GateReport, probe_score: float | None, probe: InjectionProbe | None) -> "Verdict":
        if probe is None or probe_score is None:
            return cls(report, None, report.injection)
        return cls(report, probe_score, float(probe.combine(probe_score, report.injection)))

    @property
    def label(self) -> str:
        return "injection" if self.injection >= 0.5 else "secret" if self.report.secret >= 0.5 else "clean"

    def findings(self) -> list[dict[str, Any]]:
        found = [{"kind": f.kind, "rule_id": f.rule_id, "layer": f.layer, "score": f.score}
                 for f in self.report.findings]
        if self.probe_score is not None and self.probe_score >= 0.5:
            found.append({"kind": "injection", "rule_id": "hidden-state-probe", "layer": "probe",
                          "score": self.probe_score})
        return found

    def policy_input(self) -> dict[str, Any]:
        scorer = "byte_gate" if self.probe_score is None else "stack"  # each has its own policy threshold
        return {"injection": self.injection, "secret": self.report.secret, "findings": self.findings(), "scorer": scorer}

    def summary(self) -> dict[str, Any]:
        summary = {**self.report.summary(), "injection": self.injection}
        if self.probe_score is not None:
            summary.update(injection_bytes=self.report.injection, probe=self.probe_score)
        return summary


@dataclass(frozen=True)
class PostTurn:
    """A tool result admitted for this turn only: forgotten or amortized once the reply is out."""

    segment: Segment
    action: Action
    stub: tuple[int, ...]


@dataclass
class Turn:
    """A prepared request: the cache holds the conversation plus a staged generation prompt."""

    session: LiveSession
    actions: list[Action]
    pending: list[PostTurn]
    prompt_tokens: int


@dataclass
class Components:
    model: Model
    kernel: Kernel
    ledger: Ledger
    audit: AuditLog
    policy: PolicyEngine
    gate: Gate
    metrics: Metrics
    salt_secret: bytes
    probe: InjectionProbe | None = None
    witness_mode: str = "full"
    max_tool_result_bytes: int = 256_000
    check_invariants: bool = False  # debug and test builds: the ledger must tile the cache exactly


class Gateway:
    """Sessions and their pipeline; the HTTP layer is a thin shell over this."""

    def __init__(self, parts: Components) -> None:
        self.p = parts
        self._sessions: dict[str, LiveSession] = {}
        self._sessions_lock = threading.Lock()
        # Reentrant: a tool result's whole admission holds it (see _admit_tool), and the kernel
        # calls inside take it again.
        self._model_lock = threading.RLock()
        self.prefixes = PrefixCache()

    # ---- sessions ---------------------------------------------------------------------------

    def _compute(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with self._model_lock:
            return fn(*args, **kwargs)

    def _salt(self, principal: Principal) -> str:
        """The session's cache salt: Rego names the scope, the server's secret keys the HMAC."""
        try:
            tenancy = self.p.policy.tenancy({"tenant": principal.tenant, "user": principal.user,
                                             "public_prefix": False})
        except PolicyError as exc:
            raise GatewayError(403, "tenancy_refused",
                               f"the tenancy policy gives no cache scope for this caller ({exc}); a tenant scoped "
                               "per user needs keys made with `lethe key create --user NAME`") from exc
        return derive_salt(self.p.salt_secret, tenancy)

    def open_session(self, principal: Principal, session_id: str | None) -> tuple[LiveSession, bool]:
        """The caller's session (404 for an unknown id or another tenant's), or a new one."""
        if principal.tenant is None:
            raise GatewayError(403, "tenant_required", "chat needs a tenant key; the global admin key has no tenant")
        if session_id is None:
            session_id = "ses_" + secrets.token_hex(12)
            record = self.p.ledger.create_session(session_id, principal.tenant, principal.user,
                                                  salt_scope=self._salt(principal))
            return self._resident(record), True
        with self._sessions_lock:
            live = self._sessions.get(session_id)
        if live is not None and live.record.tenant == principal.tenant:
            return live, False
        record = self.p.ledger.get_session(session_id, principal.tenant)
        if record is None:
            raise not_found("session", session_id)
        return self._resident(record), False

    def scoped_session(self, principal: Principal, session_id: str) -> SessionRecord:
        record = self.p.ledger.get_session(session_id, None if principal.is_admin and principal.tenant is None
                                           else principal.tenant)
        if record is None:
            raise not_found("session", session_id)
        return record

    def cache(self, session_id: str) -> KVCache | None:
        """The session's resident KV cache, if any (for inspection; callers must not mutate it)."""
        with self._sessions_lock:
            live = self._sessions.get(session_id)
        return live.cache if live is not None else None

    def inspect(self, principal: Principal, session_id: str) -> dict[str, Any]:
        """Token count, cache digest and KV memory of a session: what an auditor compares."""
        record = self.scoped_session(principal, session_id)
        live = self._resident(record)
        with live.lock:
            return {"session_id": record.id, "tenant": record.tenant, "tokens": len(live.cache),
                    "resident": len(live.cache) > 0, "cache_digest": self._compute(live.cache.digest),
                    "kv": live.cache.memory().to_dict()}

    def session_salt(self, session_id: str) -> str | None:
        record = self.p.ledger.get_session(session_id)
        return record.salt_scope if record else None

    def kv_bytes(self) -> int:
        with self._sessions_lock:
            sessions = list(self._sessions.values())
        return sum(s.cache.memory().total_bytes for s in sessions)

    # ---- a chat turn ------------------------------------------------------------------------

    def prepare(self, principal: Principal, session_id: str | None, messages: list[ChatMessage],
                max_new_tokens: int) -> Turn:
        """Reconcile, admit new messages through the pipeline, and stage the generation prompt.

        Returns with the session lock held; `finish` releases it, and must run even when the
        client goes away, since it applies the turn's pending erasures.
        """
        live, _ = self.open_session(principal, session_id)
        live.lock.acquire()
        pending: list[PostTurn] = []
        try:
            conv = Conversation(self.p.model.tokenizer, messages, memo=live.chunks)
            actions: list[Action] = []
            first_new = self._reconcile(live, conv)
            self._admit(principal, live, conv, first_new, actions, pending)
            prompt = conv.generation_prompt()
            total = len(live.cache) + len(prompt) + max_new_tokens
            if total > self.p.model.max_context:
                raise GatewayError(400, "context_length_exceeded",
                                   f"session needs {total} tokens (cache {len(live.cache)} + prompt {len(prompt)} + "
                                   f"max_tokens {max_new_tokens}) but the context window is "
                                   f"{self.p.model.max_context}; "
                                   "lower max_tokens, forget segments or start a new session", param="max_tokens")
            self._compute(live.cache.stage, prompt)
            self.p.metrics.tokens.labels("prefill").inc(len(prompt))
            live.chunks = conv.used
            return Turn(live, actions, pending, len(live.cache))
        except BaseException:
            try:  # what was admitted for this turn only is erased even though the turn failed
                self._post_turn(live, pending)
            finally:
                live.lock.release()
            raise

    def generate(self, turn: Turn, cfg: GenerationConfig) -> Iterator[int]:
        """Stream generated token ids; each decode step takes the model lock on its own."""
        tokens = turn.session.cache.generate(cfg)
        started, count = time.perf_counter(), 0
        while True:
            with self._model_lock:
                token = next(tokens, None)
            if token is None:
                break
            count += 1
            yield token
        elapsed = time.perf_counter() - started
        self.p.metrics.tokens.labels("decode").inc(count)
        if count and elapsed > 0:
            self.p.metrics.tokens_per_second.set(count / elapsed)

    def finish(self, turn: Turn) -> list[dict[str, Any]]:
        """Drop the generation (the client sends the reply back next turn) and run post-turn actions."""
        live = turn.session
        try:
            self._compute(live.cache.rollback)
            erasures = self._post_turn(live, turn.pending)
            self.p.metrics.kv_bytes.set(self.kv_bytes())
            if self.p.check_invariants:
                self.p.ledger.check_invariants(live.record.id, cache_len=len(live.cache))
            return erasures
        finally:
            live.lock.release()

    def _post_turn(self, live: LiveSession, pending: list[PostTurn]) -> list[dict[str, Any]]:
        """Forget (exactly) or amortize what the policy admitted for this turn only."""
        if live.cache.staged:
            self._compute(live.cache.rollback)
        erasures: list[dict[str, Any]] = []
        forget = [p for p in pending if p.action.action == "forget"]
        if forget:
            erasures.append(self._forget(live, [p.segment for p in forget], kind="forget", actor="policy",
                                         decisions={p.segment.id: p.action for p in forget}))
        for post in pending:
            if post.action.action == "amortize":
                erasures.append(self._amortize(live, post))
        return erasures

    # ---- reconciliation ---------------------------------------------------------------------

    def _segment_tokens(self, conv: Conversation, k: int, seg: Segment) -> tuple[int, ...]:
        if seg.state in _DEAD:
            return ()
        if seg.state in (SegmentState.QUARANTINED, SegmentState.AMORTIZED):
            return conv.stub(k, _stub_reason_of(seg))
        if "redaction" in seg.meta and seg.replacement_sha256:  # only the redacted text ever entered
            return conv.chunk(k, self.p.ledger.content.get(seg.replacement_sha256).decode("utf-8", "replace"))
        return conv.chunk(k)

    def _reconcile(self, live: LiveSession, conv: Conversation) -> int:
        """Match messages to ledger segments; make the cache hold exactly the matched prefix.

        Returns the index of the first message that is new to the session.
        """
        sid = live.record.id
        segments = [s for s in self.p.ledger.segments(sid) if s.state != SegmentState.SUPERSEDED]
        expected: list[int] = []
        k = 0
        for seg in segments:
            if k >= len(conv.messages):
                break
            rendered = conv.message(k)
            if (seg.role, seg.content_sha256, seg.tool) != (rendered.role, rendered.content_sha256, rendered.tool):
                break
            tokens = self._segment_tokens(conv, k, seg)
            if len(tokens) != seg.n_tokens:
                break  # the template or tokenizer changed: re-prefill from here
            expected.extend(tokens)
            k += 1
        if k < len(segments):
            self.p.ledger.truncate(sid, len(expected))
        self._sync_cache(live.cache, expected)
        return k

    def _sync_cache(self, cache: KVCache, expected: list[int]) -> None:
        have = cache.tokens
        common = 0
        for a, b in zip(have, expected):
            if a != b:
                break
            common += 1
        if common < len(have):
            self._compute(cache.truncate, common)
        if common < len(expected):
            self._compute(cache.extend, expected[common:])
            self.p.metrics.tokens.labels("prefill").inc(len(expected) - common)

    # ---- admission --------------------------------------------------------------------------

    def _admit(self, principal: Principal, live: LiveSession, conv: Conversation, first: int,
               actions: list[Action], pending: list[PostTurn]) -> None:
        batch: list[RenderedMessage] = []
        for k in range(first, len(conv.messages)):
            rendered = conv.message(k)
            if rendered.role != "tool":
                batch.append(rendered)
                continue
            self._append_plain(live, batch)
            batch = []
            action, segment = self._admit_tool(principal, live, conv, rendered)
            actions.append(action)
            if action.action in ("forget", "amortize"):
                pending.append(PostTurn(segment, action, conv.stub(k, _stub_reason_of(segment))))
        self._append_plain(live, batch)

    def _append_plain(self, live: LiveSession, batch: list[RenderedMessage]) -> None:
        """Non-tool messages enter as they are: one prefill for the batch, one ledger row each."""
        if not batch:
            return
        tokens = [t for m in batch for t in m.tokens]
        if not len(live.cache) and batch[0].role == "system":  # an empty cache means an empty ledger
            tokens = tokens[self._warm_start(live, batch[0].tokens):]
        self._compute(live.cache.stage, tokens)
        try:
            for m in batch:
                self.p.ledger.append(live.record.id, role=m.role, tool=None, content=m.content,
                                     n_tokens=len(m.tokens))
        except Exception:
            self._compute(live.cache.rollback)
            raise
        self._compute(live.cache.commit)
        self.p.metrics.tokens.labels("prefill").inc(len(tokens))

    def _warm_start(self, live: LiveSession, system: tuple[int, ...]) -> int:
        """Begin an empty session from the salted cache of its system prompt, or seed that cache.

        Returns how many tokens the cache now holds (the system prompt's)."""
        key = PrefixCache.key(live.record.salt_scope or "", system)
        cached = self.prefixes.get(key)
        if cached is not None:
            live.cache = cached
        else:
            self._compute(live.cache.extend, system)
            self.prefixes.put(key, live.cache)
        return len(system)

    def _admit_tool(self, principal: Principal, live: LiveSession, conv: Conversation,
                    m: RenderedMessage) -> tuple[Action, Segment]:
        """gate → stage (the probe reads the staged states) → policy → commit, or rollback to a stub.

        The whole admission holds the model lock. On a CPU host the model's compute saturates
        every core, so pipeline work run beside another session's forward pass only slows both
        (measured: 2-3x the CPU time from cache pressure, plus run-queue waits); run between
        forward passes it costs its own time, ~2 ms, and delays the next forward pass by as much.
        """
        if len(m.content) > self.p.max_tool_result_bytes:
            raise GatewayError(413, "tool_result_too_large",
                               f"messages[{m.index}] tool result is {len(m.content)} bytes; the limit is "
                               f"{self.p.max_tool_result_bytes} (LETHE_MAX_TOOL_RESULT_BYTES)",
                               param=f"messages.{m.index}.content")
        with self._model_lock:
            return self._admit_tool_locked(principal, live, conv, m)

    def _admit_tool_locked(self, principal: Principal, live: LiveSession, conv: Conversation,
                           m: RenderedMessage) -> tuple[Action, Segment]:
        own = Stopwatch()  # the gateway's own work: everything but model compute and its lock
        try:
            with own:
                report = self.p.gate.scan(m.content, tool=m.tool)
        except Exception as exc:
            log.error("gate.failed", session=live.record.id, error=type(exc).__name__)
            raise unavailable("gate", exc) from exc
        probe = self._stage_scored(live, conv, m, own)
        with own:
            verdict = Verdict.of(report, probe, self.p.probe)
            decision = self.p.policy.decide(self._decision_input(principal, live, m, verdict))
            screened = self._screen(principal, live, m, report, decision)
            decision = screened.decision
        self.p.metrics.gate_verdicts.labels(verdict.label).inc()
        self.p.metrics.actions.labels(decision.action).inc()
        quarantined = decision.action == "quarantine"
        reason = _stub_reason(verdict, decision.reasons)
        tokens = m.tokens
        if quarantined or screened.redaction is not None:  # the content leaves; a stub or its redaction enters
            tokens = conv.stub(m.index, reason) if quarantined else \
                conv.chunk(m.index, screened.redaction.data.decode("utf-8", "replace"))  # type: ignore[union-attr]
            self._compute(live.cache.rollback)
            self._compute(live.cache.stage, tokens)
        action = Action(m.index, None, m.tool, decision.action, decision.reasons, verdict.summary())
        try:
            with own:
                segment = self._record_admission(principal, live, m, tokens, verdict, screened, reason, action)
        except GatewayError:
            self._compute(live.cache.rollback)
            raise
        except Exception as exc:
            self._compute(live.cache.rollback)
            log.error("admission.failed", session=live.record.id, error=type(exc).__name__)
            raise unavailable("audit" if quarantined else "ledger", exc) from exc
        self._compute(live.cache.commit)
        action.segment_id = segment.id
        overhead = own.seconds
        action.overhead_ms = overhead * 1e3
        self.p.metrics.overhead_seconds.observe(overhead)
        log.info("tool.admitted", session=live.record.id, segment=segment.id, tool=m.tool, action=decision.action,
                 injection=round(verdict.injection, 4), secret=round(report.secret, 4),
                 overhead_ms=round(overhead * 1e3, 3))
        return action, segment

    def _stage_scored(self, live: LiveSession, conv: Conversation, m: RenderedMessage,
                      own: Stopwatch) -> float | None:
        """Stage the tool result; with a probe, score the residual states of its content tokens."""
        probe = self.p.probe
        if probe is None:
            self._compute(live.cache.stage, m.tokens)
            return None
        _, states = self._compute(live.cache.stage_with_states, m.tokens, probe.layers)
        with own:
            head, tail = conv.frame(m.index)
            content = {layer: s[head:len(m.tokens) - tail].float().numpy() for layer, s in states.items()}
            return probe.score(content)

    def _screen(self, principal: Principal, live: LiveSession, m: RenderedMessage, report: GateReport,
                decision: Any) -> Screened:
        """Refuse bytes the MCP proxy withheld from this tenant, then carry out a redact decision.

        The redacted bytes' re-scan is the byte gate's alone: the probe read the original's staged
        states, and an injection it flagged there already outranked the redaction (quarantine)."""
        decision = refuse_withheld(self.p.ledger.crossings, principal.tenant or "", m.content_sha256, decision)
        return apply_redact(self.p.gate, self.p.policy, m.content, report, decision,
                            lambda rescan, _n: self._decision_input(principal, live, m, Verdict.of(rescan, None, None)))

    def _decision_input(self, principal: Principal, live: LiveSession, m: RenderedMessage,
                        verdict: Verdict) -> dict[str, Any]:
        age = (datetime.now(timezone.utc) - _utc(live.record.created_at)).total_seconds()
        return {
            "tenant": principal.tenant, "user": principal.user,
            "session": {"id": live.record.id, "age_s": age, "tokens": len(live.cache) - len(m.tokens)},
            "tool": m.tool or "unknown",
            "span": {"bytes": len(m.content), "tokens": len(m.tokens)},
            "gate": verdict.policy_input(),
        }

    def _record_admission(self, principal: Principal, live: LiveSession, m: RenderedMessage,
                          tokens: tuple[int, ...], verdict: Verdict, screened: Screened, reason: str,
                          action: Action) -> Segment:
        """Ledger, then audit (for quarantine and redact). If the audit write fails, the new segment
        is superseded again and the caller rolls the stage back: no span without its record.

        A redacted segment stores only the redacted bytes; its gate summary is the re-scan's (so
        retention classes it by what entered), the original's is kept beside it."""
        decision, red = screened.decision, screened.redaction
        state = SegmentState.QUARANTINED if decision.action == "quarantine" else SegmentState.LIVE
        redacted = red is not None and decision.action == "redact"
        data_class = "secret" if verdict.report.secret >= 0.5 and not redacted else "quarantined" \
            if state is SegmentState.QUARANTINED else "normal"
        meta = {"gate": verdict.summary(), "decision": decision.to_dict(), "stub_reason": reason}
        if redacted:
            meta.update(gate=screened.rescan.summary(), gate_original=verdict.summary(),  # type: ignore[union-attr]
                        redaction=red.to_dict())  # type: ignore[union-attr]
        segment = self.p.ledger.append(live.record.id, role=m.role, tool=m.tool, content=m.content,
                                       n_tokens=len(tokens), state=state, data_class=data_class, meta=meta,
                                       replacement=red.data if redacted else None)  # type: ignore[union-attr]
        if state is SegmentState.QUARANTINED or redacted:
            try:
                body = self._record("redact" if redacted else "quarantine", live, segment.id,
                                    (segment.start, segment.end), len(m.tokens), m.content_sha256,
                                    verdict.summary(), decision.to_dict(), _actor(principal), None)
                action.audit_index = self.p.audit.append({**body, "redaction": red.to_dict()} if redacted else body)
            except Exception:
                self.p.ledger.truncate(live.record.id, segment.start)
                raise
        return segment

    @staticmethod
    def _record(kind: str, live: LiveSession | SessionRecord, segment_id: str, span: tuple[int, int],
                token_count: int, content_sha256: str, gate: dict[str, Any] | None, decision: dict[str, Any] | None,
                actor: str, witness: dict[str, Any] | None) -> dict[str, Any]:
        """An audit record body: hashes, ranges and verdicts, never the content."""
        record = live.record if isinstance(live, LiveSession) else live
        body = {"kind": kind, "tenant": record.tenant, "session": record.id, "segment_id": segment_id,
                "span": list(span), "token_count": token_count, "content_sha256": content_sha256, "actor": actor,
                "gate": gate, "decision": decision, "witness": witness}
        return {k: v for k, v in body.items() if v is not None}

    # ---- erasure ----------------------------------------------------------------------------

    def _forget(self, live: LiveSession, segments: list[Segment], *, kind: str, actor: str,
                decisions: dict[str, Any] | None = None) -> dict[str, Any]:
        """Exact erasure of whole segments: kernel, then ledger, then one audit record per segment.

        The erasure stands even if the audit write then fails (failing toward erasure); the
        caller gets a 503 naming the segments whose record is missing.
        """
        spans = sorted((s.start, s.end) for s in segments if s.n_tokens > 0)
        started = time.perf_counter()
        result = self._compute(live.cache.forget, spans, witness=self.p.witness_mode) if spans else None
        elapsed = time.perf_counter() - started
        self.p.ledger.forget(live.record.id, [s.id for s in segments])
        self.p.metrics.erasures.labels(kind).inc(len(segments))
        self.p.metrics.erasure_seconds.observe(elapsed)
        witness = result.witness.to_dict() if result is not None and result.witness is not None else None
        records = [self._erasure_record(kind, live, s, actor, witness, (decisions or {}).get(s.id)) for s in segments]
        if result is not None and result.pending is not None:
            result.pending.add_done_callback(lambda fut: self._append_deferred(records, fut))
            indices: list[int | None] = [None] * len(records)
        else:
            indices = self._append_records(records)
        log.info("forget.done", session=live.record.id, kind=kind, segments=[s.id for s in segments],
                 spans=spans, ms=round(elapsed * 1e3, 1), equal=witness.get("equal") if witness else None)
        return {"kind": kind, "segments": [s.id for s in segments], "spans": [list(s) for s in spans],
                "audit_indices": indices, "witness": witness, "latency_ms": round(elapsed * 1e3, 3)}

    def _erasure_record(self, kind: str, live: LiveSession, seg: Segment, actor: str,
                        witness: dict[str, Any] | None, action: Action | None) -> dict[str, Any]:
        decision = {"action": action.action, "reasons": list(action.reasons),
                    "bundle_hash": seg.meta.get("decision", {}).get("bundle_hash")} if action else \
            seg.meta.get("decision")
        return self._record(kind, live, seg.id, (seg.start, seg.end), seg.n_tokens, seg.content_sha256,
                            seg.meta.get("gate"), decision, actor, witness)

    def _append_records(self, records: list[dict[str, Any]]) -> list[int | None]:
        try:
            indices: list[int | None] = list(self.p.audit.append_many(records))
            self.p.audit.checkpoint()
            return indices
        except Exception as exc:
            log.error("audit.append_failed", error=type(exc).__name__, segments=[r["segment_id"] for r in records])
            raise GatewayError(503, "audit_failed",
                               "the span was erased, but its audit record could not be written "
                               f"({type(exc).__name__}); check the audit database and retry the erasure call",
                               retry_after=5) from exc

    def _append_deferred(self, records: list[dict[str, Any]], future: Any) -> None:
        witness = future.result().to_dict()
        for r in records:
            r["witness"] = witness
        self._append_records(records)

    def _amortize(self, live: LiveSession, post: PostTurn) -> dict[str, Any]:
        """Leyline splice: the span is replaced by its stub, positions fixed. NOT erasure."""
        seg = post.segment
        started = time.perf_counter()
        result = self._compute(live.cache.amortize, (seg.start, seg.end), post.stub)
        elapsed = time.perf_counter() - started
        self.p.ledger.amortize(live.record.id, seg.id, len(post.stub), stub_text(_stub_reason_of(seg)).encode())
        witness = result.witness.to_dict()
        indices = self._append_records([self._erasure_record("amortize", live, seg, "policy", witness, post.action)])
        return {"kind": "amortize", "segments": [seg.id], "audit_indices": indices, "witness": witness,
                "latency_ms": round(elapsed * 1e3, 3), "erasure": False}

    def forget_request(self, principal: Principal, session_id: str, selector: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/sessions/{id}/forget: erasure rights from the policy, then an exact forget."""
        record = self.scoped_session(principal, session_id)
        decision = self.p.policy.erasure_allowed({
            "actor": principal.policy_actor(),
            "target": {"tenant": record.tenant, "session_id": record.id, "session_owner": record.user},
            "action": "forget"})
        if not decision.allowed:
            raise GatewayError(403, "erasure_denied", "erasure denied by policy: " + "; ".join(decision.reasons))
        live = self._resident(record)
        with live.lock:
            segments = self._select(session_id, selector)
            result = self._forget(live, segments, kind="forget", actor=_actor(principal))
        proofs = [self.p.audit.inclusion_proof(i).to_dict() if i is not None else None
                  for i in result["audit_indices"]]
        records = [self.p.audit.get(i).to_dict() if i is not None else None for i in result["audit_indices"]]
        return {**result, "records": records, "inclusion_proofs": proofs,
                "checkpoint": self.p.audit.latest_checkpoint().to_dict()}

    def _select(self, session_id: str, selector: dict[str, Any]) -> list[Segment]:
        ledger = self.p.ledger
        alive = [s for s in ledger.segments(session_id) if s.state not in _DEAD]
        if "segment_id" in selector:
            seg = ledger.get_segment(session_id, selector["segment_id"])
            if seg is None:
                raise not_found("segment", selector["segment_id"])
            if seg.state in _DEAD:
                raise GatewayError(409, "already_forgotten", f"segment {seg.id} is {seg.state.value}")
            return [seg]
        if "content_sha256" in selector:
            found = [s for s in alive if s.content_sha256 == selector["content_sha256"]]
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

    # ---- retention --------------------------------------------------------------------------

    def sweep_retention(self, now: datetime | None = None) -> int:
        """Forget every segment whose retention TTL (from the policy) has passed; returns the count."""
        now = now or datetime.now(timezone.utc)
        sessions: dict[str, SessionRecord] = {}

        def ttl_for(record: SessionRecord, seg: Segment) -> float | None:
            sessions[record.id] = record
            state = seg.state.value
            return self.p.policy.retention({"tenant": record.tenant, "tool": seg.tool or "none", "state": state,
                                            "gate": _gate_input(seg.meta.get("gate", {}))}).ttl_seconds

        expired = self.p.ledger.expired(now, ttl_for)
        by_session: dict[str, list[Segment]] = {}
        for seg in expired:
            by_session.setdefault(seg.session_id, []).append(seg)
        count = 0
        for session_id, segments in by_session.items():
            count += self._expire(sessions[session_id], segments)
        return count

    def _expire(self, record: SessionRecord, segments: list[Segment]) -> int:
        quarantined = [s.id for s in segments if s.state is SegmentState.QUARANTINED]
        retired = self.p.ledger.retire_content(record.id, quarantined) if quarantined else []
        if retired:  # the stub stays; the withheld content goes (unless other segments hold it)
            self._append_records([self._record("retention-forget", record, seg.id, (seg.start, seg.end), seg.n_tokens,
                                               seg.content_sha256, seg.meta.get("gate"), seg.meta.get("decision"),
                                               "retention", None) for seg in retired])
        live_segments = [s for s in segments if s.state is not SegmentState.QUARANTINED]
        if live_segments:
            live = self._resident(record)
            with live.lock:
                current = {s.id: s for s in self.p.ledger.segments(record.id)}
                fresh = [current[s.id] for s in live_segments if current[s.id].state not in _DEAD]
                if fresh and len(live.cache):
                    self._forget(live, fresh, kind="retention-forget", actor="retention")
                elif fresh:  # no cache resident: the next rebuild from the ledger already skips them
                    self.p.ledger.forget(record.id, [s.id for s in fresh])
                    self._append_records([self._erasure_record("retention-forget", live, s, "retention", None, None)
                                          for s in fresh])
        return len(quarantined) + len(live_segments)

    def _resident(self, record: SessionRecord) -> LiveSession:
        with self._sessions_lock:
            live = self._sessions.get(record.id)
            if live is None:
                live = LiveSession(record, self.p.kernel.new_cache())
                self._sessions[record.id] = live
            return live


def _actor(principal: Principal) -> str:
    who = principal.user or ("admin" if principal.is_admin else "key")
    return f"{principal.tenant or '*'}:{who}"


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _gate_input(summary: dict[str, Any]) -> dict[str, Any]:
    return {"injection": summary.get("injection", 0.0), "secret": summary.get("secret", 0.0), "findings": []}


def _stub_reason_of(seg: Segment) -> str:
    return str(seg.meta.get("stub_reason", "policy"))


def _stub_reason(verdict: Verdict, reasons: tuple[str, ...]) -> str:
    if verdict.injection >= 0.5:
        return "prompt-injection"
    if verdict.report.secret >= 0.5:
        return "secret"
    if any(r.startswith("policy-error") for r in reasons):
        return "policy-error"
    return "policy"
