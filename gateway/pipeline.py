"""The request pipeline of one chat turn, top to bottom.

    match     the request's messages against the session's ledger (the reused prefix)
    validate  limits and the context window: before anything is admitted or audited
    sync      the KV cache to the matched prefix
    admit     every new message gated first, outside the model lock (adjacent untrusted ones
              joined); a principal's message the policy allows enters as it is, anything else
              (tool results, assistant text, tool-call arguments, tool definitions, and what the
              policy did not allow) through stage -> probe -> policy -> keep, or a stub / its redaction
    write     the turn's ledger rows in one transaction, with what it owes (audit records, forgets)
    prompt    stage the generation prompt
    ...       generation (service.py), then at the turn's end:
    commit    the turn's audit records; then its post-turn forgets (erasure.py)

Nothing here rolls back: a failing step raises (a GatewayError naming its component, via
`fails_as`), and `Turn.end` — the one place that rolls back — puts the cache and the ledger back
as they were through `restore`. Until `commit` returns, nothing of the turn is in the audit log.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from pathlib import Path

import structlog

from audit import AuditLog
from gate import Gate, GateReport, InjectionProbe
from kvkernel import Kernel, Model
from ledger import CONTENT_RETIRED, Ledger, NewSegment, SegmentState
from policies import PolicyEngine, tool_identity

from .chat import Conversation, RenderedMessage, name_folds
from .errors import GatewayError, fails_as
from .erasure import Erasure, actor_of, audit_body, segment_tokens, turn_intents
from .metrics import Metrics
from .residency import Residency
from .screen import Screened, apply_redact, pasted_digests, policy_findings, refuse_withheld, withheld_at_boundary
from .sessions import Compute, LiveSession, PrefixCache, prefill_pieces
from .tenants import Principal
from .turn import Action, Staged, Turn

log = structlog.get_logger(__name__)

# Tokens a stub or a redaction may take beyond its message's own (the KV reservation's margin):
# a quarantine stub replaces a short tool result with a longer sentence.
STUB_ROOM = 64


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
    scorer: str = "byte_gate"

    @classmethod
    def of(cls, report: GateReport, probe_score: float | None, probe: InjectionProbe | None,
           probe_blind: bool = False) -> "Verdict":
        """`probe_blind`: the gate's evidence is in a reading the probe never saw (text joined across
        a message boundary, or normalised: fullwidth, soft hyphens), so the byte gate's score and
        operating point decide; stacking would let the probe's clean reading outvote it."""
        if probe is None or probe_score is None or probe_blind:
            return cls(report, probe_score, report.injection)
        return cls(report, probe_score, float(probe.combine(probe_score, report.injection)), "stack")

    @property
    def label(self) -> str:
        return "injection" if self.injection >= 0.5 else "secret" if self.report.secret >= 0.5 else "clean"

    def findings(self) -> list[dict[str, Any]]:
        found = policy_findings(self.report.findings)
        if self.probe_score is not None and self.probe_score >= 0.5:
            found.append({"kind": "injection", "rule_id": "hidden-state-probe", "layer": "probe",
                          "score": self.probe_score, "count": 1})
        return found

    def policy_input(self) -> dict[str, Any]:
        # each scorer has its own policy threshold
        return {"injection": self.injection, "secret": self.report.secret, "findings": self.findings(),
                "scorer": self.scorer}

    def summary(self) -> dict[str, Any]:
        summary = {**self.report.summary(), "injection": self.injection}
        if self.probe_score is not None:
            summary.update(injection_bytes=self.report.injection, probe=self.probe_score, scorer=self.scorer)
        return summary

    def stub_reason(self, reasons: tuple[str, ...]) -> str:
        if self.injection >= 0.5:
            return "prompt-injection"
        if self.report.secret >= 0.5:
            return "secret"
        if any(r.startswith("policy-error") for r in reasons):
            return "policy-error"
        return "policy"


PRINCIPAL_CHANNELS = frozenset({"user", "system", "developer"})  # the principal's own words


def channel_of(conv: Conversation, m: RenderedMessage, tool_spec: bool) -> str:
    """The decision policy's `input.channel` of one message."""
    if m.role == "tool":
        return "tool"
    if m.index == 0 and tool_spec:
        return "tool_definition"  # the system message that carries the request's tools[]
    if m.role == "assistant" and conv.messages[m.index].tool_calls:
        return "tool_call_arguments"
    return m.role


def tool_of(conv: Conversation, m: RenderedMessage, channel: str, issued: dict[str, str]) -> dict[str, Any] | None:
    """The policy's `input.tool`: who a tool result (or the called tools, or the tool definitions)
    comes from. `issued` is the session's record of the calls the gateway's own model made
    (call id -> name): a result's trust-relevant name is the recorded one, and it is verified only
    when its call id was issued here and the client's claimed name agrees. Principal and assistant
    text has no tool (None)."""
    if channel == "tool":
        return _identity([(conv.messages[m.index].tool_call_id or "", m.tool or "unknown")], issued)
    if channel == "tool_call_arguments":
        calls = conv.messages[m.index].tool_calls or ()
        return _identity([(c.id, c.function.name) for c in calls], issued) if calls else None
    if channel == "tool_definition":  # the client's own tools[]: a label, nothing to verify
        return tool_identity("tools[]", source="client")
    return None


def _identity(calls: list[tuple[str, str]], issued: dict[str, str]) -> dict[str, Any]:
    """The identity of one or more (call id, claimed name) pairs, names joined with ","."""
    claimed = ",".join(name for _, name in calls)
    recorded = [issued.get(cid) for cid, _ in calls]
    folded = name_folds(*(name for _, name in calls))
    if any(r is None for r in recorded):
        return tool_identity(claimed, source="client", claimed_name=claimed, folded=folded)
    name = ",".join(r for r in recorded if r is not None)
    return tool_identity(name, source="gateway", claimed_name=claimed, verified=name == claimed, folded=folded)


def _kept_identity(identity: dict[str, Any], kept: dict[str, str]) -> dict[str, Any]:
    """`input.tool` as the segment's meta keeps it: every name as `_kept_names` keeps it."""
    out = {k: kept.get(v, v) if k in ("name", "claimed_name") else v for k, v in identity.items()}
    if "folded" in out:
        out["folded"] = [kept.get(n, n) for n in out["folded"]]
    return out


@dataclass(frozen=True)
class Gated:
    """What the gate and the ledger say about one new message before the policy decides."""

    channel: str
    tool: dict[str, Any] | None  # the policy's input.tool (see tool_of)
    report: GateReport
    quarantined: list[str]
    probe_blind: bool = False


@dataclass
class Components:
    """The gateway's parts, as wired at start-up (gateway/wiring.py)."""

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
    lock_timeout_s: float = 15.0
    check_invariants: bool = False  # debug and test builds: the ledger must tile the cache exactly
    kv_budget_bytes: int | None = None  # None: kv_budget_share of the memory free at start-up
    kv_budget_share: float = 0.4
    kv_offload_bytes: int | None = None  # None: twice the budget; 0: no offload tier
    kv_offload_min_priority: int | None = None  # None: Rego's kv_priority.offload_min_priority
    offload_dir: Path | None = None  # the disk tier on CPU (data_dir/kv-offload); None: no disk tier
    hold_at: str | None = None  # tests only: a turn waits at this point (`hold_point`) until it is abandoned

    def hold_point(self, name: str, abandoned: Callable[[], bool]) -> None:
        """Tests only (LETHE_TEST_HOLD_AT): park the turn at point `name` until its client leaves,
        so that a test can kill the process exactly there."""
        if self.hold_at != name:
            return
        log.warning("test.holding", point=name)
        while not abandoned():
            time.sleep(0.05)


class Pipeline:
    """Prepares a turn (everything up to generation) and implements `TurnOps` for its end."""

    def __init__(self, parts: Components, *, prefixes: PrefixCache, erasure: Erasure, compute: Compute,
                 residency: Residency) -> None:
        self.p = parts
        self.prefixes = prefixes
        self.erasure = erasure
        self._compute = compute
        self.residency = residency

    # ---- prepare: the pipeline, in order ------------------------------------------------------

    def prepare(self, turn: Turn, principal: Principal, conv: Conversation, max_new_tokens: int,
                offset: int, tool_spec: bool = False) -> None:
        """Run the pipeline up to a staged generation prompt. `offset` is how many messages the
        gateway put before the client's own (a tools note), so reported indices are the client's;
        `tool_spec`: message 0 carries the request's tool definitions."""
        live = turn.live
        turn.keep, expected = self._match(live, conv)
        most = self._validate(conv, turn.keep, len(expected), max_new_tokens, offset)
        self.residency.reserve(live, most)
        with fails_as("kernel"):
            self._sync_cache(live, expected, turn.abandoned)
        self._admit(turn, principal, conv, offset, tool_spec)
        self._write(turn)
        prompt = conv.generation_prompt()
        with fails_as("kernel"):
            self._compute(live.cache.stage, prompt)
        self.p.metrics.tokens.labels("prefill").inc(len(prompt))
        live.chunks = conv.used
        turn.prompt_tokens = len(live.cache)

    def _match(self, live: LiveSession, conv: Conversation) -> tuple[int, list[int]]:
        """How many conversation segments the request's messages match, and their tokens."""
        with fails_as("ledger"):
            segments = [s for s in self.p.ledger.segments(live.record.id) if s.state is not SegmentState.SUPERSEDED]
        expected: list[int] = []
        k = 0
        for seg in segments:
            if k >= len(conv.messages):
                break
            rendered = conv.message(k)
            if (seg.role, seg.content_sha256, seg.tool) != (rendered.role, rendered.content_sha256, rendered.tool):
                break
            tokens = segment_tokens(conv, k, seg, self.p.ledger.content)
            if len(tokens) != seg.n_tokens:
                break  # the template or tokenizer changed: re-prefill from here
            expected.extend(tokens)
            k += 1
        return k, expected

    def _validate(self, conv: Conversation, first: int, matched_tokens: int, max_new_tokens: int,
                  offset: int) -> int:
        """Tool-result size and the context window, counting every new message in full (a
        quarantined result would take less: the check errs on the safe side). Returns the most
        tokens the cache can hold during the turn, what the KV budget reserves: every new message
        in full or as its stub (STUB_ROOM), the prompt and max_tokens."""
        new_tokens = 0
        for k in range(first, len(conv.messages)):
            m = conv.message(k)
            if m.role == "tool" and len(m.content) > self.p.max_tool_result_bytes:
                raise GatewayError(413, "tool_result_too_large",
                                   f"messages[{k - offset}] tool result is {len(m.content)} bytes; the limit is "
                                   f"{self.p.max_tool_result_bytes} (LETHE_MAX_TOOL_RESULT_BYTES)",
                                   param=f"messages[{k - offset}].content")
            new_tokens += len(m.tokens)
        prompt = len(conv.generation_prompt())
        total = matched_tokens + new_tokens + prompt + max_new_tokens
        if total > self.p.model.max_context:
            raise GatewayError(400, "context_length_exceeded",
                               f"session needs {total} tokens (kept {matched_tokens} + new messages {new_tokens} + "
                               f"prompt {prompt} + max_tokens {max_new_tokens}) but the context window is "
                               f"{self.p.model.max_context}; lower max_tokens, forget segments or start a new session",
                               param="max_tokens")
        stubs = STUB_ROOM * (len(conv.messages) - first)
        return min(total + stubs, self.p.model.max_context)

    def _sync_cache(self, live: LiveSession, expected: list[int],
                    abandoned: Callable[[], bool] = lambda: False) -> None:
        """Make the cache hold exactly `expected`: keep the common prefix, re-prefill the rest."""
        have = live.cache.tokens
        common = 0
        for a, b in zip(have, expected):
            if a != b:
                break
            common += 1
        if common < len(have):
            self._compute(live.cache.truncate, common)
        if common < len(expected):
            self._extend(live, expected[common:], abandoned)

    def _extend(self, live: LiveSession, tokens: list[int], abandoned: Callable[[], bool]) -> None:
        """Prefill `tokens` in pieces (`prefill_pieces`), each under the model lock on its own."""
        for piece in prefill_pieces(tokens):
            if abandoned():
                raise GatewayError(503, "turn_cancelled", "the client went away or the gateway is stopping; "
                                   "this turn was rolled back and nothing of it was kept", retry_after=1)
            self._compute(live.cache.extend, piece)
            self.p.metrics.tokens.labels("prefill").inc(len(piece))

    def _admit(self, turn: Turn, principal: Principal, conv: Conversation, offset: int, tool_spec: bool) -> None:
        """Every new message is gated, outside the model lock. A principal's own message
        (user, system, developer) the policy allows enters with the plain batch; anything else
        goes through the tool path: stage -> probe -> policy -> keep, or a stub / its redaction."""
        new = [conv.message(k) for k in range(turn.keep, len(conv.messages))]
        channels = [channel_of(conv, m, tool_spec) for m in new]
        with fails_as("gate"):
            reports = self._scan(new, channels)
            blind = [report.injection > alone.injection or report.normalised for report, alone in reports]
        quarantined = self._quarantined_hashes(turn.live)
        with fails_as("ledger"):
            issued = self.p.ledger.tool_calls.names(turn.live.record.id)
        batch: list[Staged] = []
        batch_msgs: list[RenderedMessage] = []
        for m, channel, (report, _), probe_blind in zip(new, channels, reports, blind):
            gated = Gated(channel, tool_of(conv, m, channel, issued), report, quarantined, probe_blind)
            if channel in PRINCIPAL_CHANNELS:
                plain = self._admit_principal(principal, turn.live, m, gated)
                if plain is not None:
                    batch.append(plain)
                    batch_msgs.append(m)
                    continue
            self._admit_plain(turn, batch_msgs, batch)
            batch, batch_msgs = [], []
            with self._compute.lock:  # see _admit_tool
                turn.staged.append(self._admit_tool(turn, principal, conv, m, offset, gated))
        self._admit_plain(turn, batch_msgs, batch)

    def _scan(self, new: list[RenderedMessage], channels: list[str]) -> list[tuple[GateReport, GateReport]]:
        """The gate's report of each message, and its report of the message alone. A run of adjacent
        messages that starts at untrusted content (a tool result, an assistant turn, tool definitions
        or call arguments) and goes on while the message before is untrusted is scored joined
        (`Gate.scan_joined`), so an instruction split across the boundary is caught on both sides,
        and a secret split across it is a secret in every message holding a byte of it (red team:
        a key cut into three results was allow, forget, allow, and the outer fragments stayed)."""
        reports: list[tuple[GateReport, GateReport]] = []
        run: list[RenderedMessage] = []
        for m, channel in zip(new, channels):
            if run and channels[len(reports) + len(run) - 1] in PRINCIPAL_CHANNELS:
                reports.extend(self._scan_run(run))
                run = []
            if not run and channel in PRINCIPAL_CHANNELS:
                reports.extend(self._scan_run([m]))
                continue
            run.append(m)
        reports.extend(self._scan_run(run))
        return reports

    def _scan_run(self, run: list[RenderedMessage]) -> list[tuple[GateReport, GateReport]]:
        alone = [self.p.gate.scan(m.content, tool=m.tool) for m in run]
        if len(run) < 2:
            return list(zip(alone, alone))
        joined = self.p.gate.scan_joined([m.content for m in run], own=alone)
        return list(zip(joined, alone))  # a joined report holds the part's own findings and more

    def _quarantined_hashes(self, live: LiveSession) -> list[str]:
        """The content hashes of the session's quarantined segments, exact and normalised
        (`normalised_sha256`): refused again on any channel."""
        with fails_as("ledger"):
            held = [s for s in self.p.ledger.segments(live.record.id) if s.state is SegmentState.QUARANTINED
                    or s.meta.get("decision", {}).get("action") == "quarantine"]  # also once superseded
        return sorted({h for s in held for h in (s.content_sha256, s.meta.get("norm_sha256")) if h})

    def _admit_principal(self, principal: Principal, live: LiveSession, m: RenderedMessage,
                         gated: "Gated") -> Staged | None:
        """The principal's own message as a plain row when the policy allows it as it is."""
        verdict = Verdict.of(gated.report, None, None)
        with fails_as("policy"):
            decision = self.p.policy.decide(self._decision_input(principal, live, m, verdict, gated))
            decision = refuse_withheld(self.p.ledger.crossings, principal.tenant or "",
                                       pasted_digests(m.content, m.content_sha256, m.norm_sha256), decision)
        if decision.action != "allow":
            return None
        self.p.metrics.gate_verdicts.labels(verdict.label).inc()
        meta = {"gate": verdict.summary(), "decision": decision.to_dict(), "channel": gated.channel}
        return Staged(NewSegment(role=m.role, tool=None, content=m.content, n_tokens=len(m.tokens),
                                 data_class="secret" if gated.report.secret >= 0.5 else "normal", meta=meta))

    def _admit_plain(self, turn: Turn, batch: list[RenderedMessage], rows: list[Staged]) -> None:
        """Allowed principal messages enter as they are: one prefill for the batch, one ledger row each."""
        if not batch:
            return
        live = turn.live
        tokens = [t for m in batch for t in m.tokens]
        with fails_as("kernel"):
            if not len(live.cache) and batch[0].role == "system":  # an empty cache means an empty conversation
                tokens = tokens[self._warm_start(live, batch[0].tokens):]
            if tokens:
                self._extend(live, tokens, turn.abandoned)
        turn.staged.extend(rows)

    def _warm_start(self, live: LiveSession, system: tuple[int, ...]) -> int:
        """Begin an empty session from the salted cache of its system prompt, or seed that cache.

        Returns how many tokens the cache now holds (the system prompt's)."""
        key = PrefixCache.key(live.record.salt_scope or "", system)
        cached = self.prefixes.get(key)
        if cached is not None:
            self._compute(cached.reserve, live.cache.capacity)  # the room the turn reserved moves with it
            live.cache.wipe()
            live.cache = cached
        else:
            self._compute(live.cache.extend, system)
            self.prefixes.put(key, live.cache)
        return len(system)

    def _admit_tool(self, turn: Turn, principal: Principal, conv: Conversation, m: RenderedMessage,
                    offset: int, gated: "Gated") -> Staged:
        """gate -> stage (the probe reads the staged states) -> policy -> keep, or roll back to a stub.

        The gate ran before, outside the model lock (`_scan`). The caller holds the model lock
        for the rest of the admission. On a CPU host the model's
        compute saturates every core, so pipeline work run beside another session's forward pass
        only slows both; run between forward passes it costs its own time, ~2 ms.
        """
        live, own = turn.live, Stopwatch()  # own: the gateway's work, model compute excluded
        report = gated.report
        probe_score = self._stage_scored(live, conv, m, own)
        with own:
            verdict = Verdict.of(report, probe_score, self.p.probe, gated.probe_blind)
            with fails_as("policy"):
                decision = self.p.policy.decide(self._decision_input(principal, live, m, verdict, gated))
                screened = self._screen(principal, live, m, report, decision, gated)
                decision = screened.decision
        reason = verdict.stub_reason(decision.reasons)
        tokens = self._decide(live, conv, m, decision.action, reason, screened)
        self.p.metrics.gate_verdicts.labels(verdict.label).inc()
        self.p.metrics.actions.labels(decision.action).inc()
        kept = self._kept_names(m.tool, gated.tool)
        tool = kept.get(m.tool or "", m.tool)
        action = Action(m.index - offset, None, tool, decision.action, decision.reasons, verdict.summary(),
                        channel=gated.channel)
        row, audit = self._admission_rows(principal, live, m, tool, tokens, verdict, screened, reason)
        row.meta["channel"] = gated.channel
        if gated.tool is not None:
            row.meta["tool_identity"] = _kept_identity(gated.tool, kept)
        action.overhead_ms = own.seconds * 1e3
        self.p.metrics.overhead_seconds.observe(own.seconds)
        log.info("tool.admitted", session=live.record.id, tool=tool, action=decision.action,
                 injection=round(verdict.injection, 4), secret=round(report.secret, 4),
                 overhead_ms=round(own.seconds * 1e3, 3))
        # reported are tool results, and what the gate changed on other channels
        reported = None if gated.channel != "tool" and decision.action == "allow" else action
        return Staged(row, reported, conv.stub(m.index, reason) if decision.action == "amortize" else (), audit)

    def _kept_names(self, name: str | None, identity: dict[str, Any] | None) -> dict[str, str]:
        """Each distinct tool name of a result (its own, its identity's) as the ledger, the response
        and the logs keep it. The client chooses tool names, so one can carry a secret: such a name
        is kept as a placeholder naming the rule, never raw (red team #13 F6). The policy still saw
        the name itself. One scan per distinct name."""
        ident = identity or {}
        names = {name, ident.get("name"), ident.get("claimed_name"), *ident.get("folded", ())} - {None, ""}
        kept: dict[str, str] = {}
        for n in names:
            hits = self.p.gate.scan_secrets(n)
            kept[n] = f"[REDACTED:{hits[0].rule_id}]" if hits else n
        return kept

    def _screen(self, principal: Principal, live: LiveSession, m: RenderedMessage, report: GateReport,
                decision: Any, gated: "Gated") -> Screened:
        """Refuse bytes the MCP proxy withheld from this tenant, then carry out a redact decision.

        The redacted bytes' re-scan is the byte gate's alone: the probe read the original's staged
        states, and an injection it flagged there already outranked the redaction (quarantine)."""
        decision = refuse_withheld(self.p.ledger.crossings, principal.tenant or "",
                                       pasted_digests(m.content, m.content_sha256, m.norm_sha256), decision)
        return apply_redact(self.p.gate, self.p.policy, m.content, report, decision,
                            lambda rescan, _n: self._decision_input(principal, live, m, Verdict.of(rescan, None, None), gated))

    @staticmethod
    def _admission_rows(principal: Principal, live: LiveSession, m: RenderedMessage, tool: str | None,
                        tokens: tuple[int, ...], verdict: Verdict, screened: Screened,
                        reason: str) -> tuple[NewSegment, dict[str, Any] | None]:
        """The ledger row and (for quarantine and redact) the audit body of one admitted tool result.

        A redacted segment stores only the redacted bytes; its gate summary is the re-scan's (so
        retention classes it by what entered), the original's is kept beside it."""
        decision, red = screened.decision, screened.redaction
        quarantined = decision.action == "quarantine"
        redacted = red is not None and decision.action == "redact"
        data_class = "secret" if verdict.report.secret >= 0.5 and not redacted else "quarantined" \
            if quarantined else "normal"
        meta: dict[str, Any] = {"gate": verdict.summary(), "decision": decision.to_dict(), "stub_reason": reason}
        if quarantined:
            meta["norm_sha256"] = m.norm_sha256
            if withheld_at_boundary(decision):
                meta[CONTENT_RETIRED] = True
        if redacted:
            meta.update(gate=screened.rescan.summary(), gate_original=verdict.summary(),  # type: ignore[union-attr]
                        redaction=red.to_dict())  # type: ignore[union-attr]
        row = NewSegment(role=m.role, tool=tool, content=m.content, n_tokens=len(tokens),
                         state=SegmentState.QUARANTINED if quarantined else SegmentState.LIVE,
                         data_class=data_class, meta=meta, replacement=red.data if redacted else None)  # type: ignore[union-attr]
        if not (quarantined or redacted):
            return row, None
        body = audit_body("redact" if redacted else "quarantine", live.record, "", (0, 0), len(m.tokens),
                          m.content_sha256, verdict.summary(), decision.to_dict(), actor_of(principal), None)
        return row, ({**body, "redaction": red.to_dict()} if redacted else body)  # type: ignore[union-attr]

    def _stage_scored(self, live: LiveSession, conv: Conversation, m: RenderedMessage,
                      own: Stopwatch) -> float | None:
        """Stage the tool result; with a probe, score the residual states of its content tokens."""
        probe = self.p.probe
        with fails_as("kernel"):
            if probe is None:
                self._compute(live.cache.stage, m.tokens)
                return None
            _, states = self._compute(live.cache.stage_with_states, m.tokens, probe.layers)
        with own, fails_as("probe"):
            head, tail = conv.frame(m.index)
            content = {layer: s[head:len(m.tokens) - tail].float().numpy() for layer, s in states.items()}
            return probe.score(content)

    def _decide(self, live: LiveSession, conv: Conversation, m: RenderedMessage, action: str,
                reason: str, screened: Screened) -> tuple[int, ...]:
        """Keep the staged content, or put the stub or the redacted text in its place; returns
        what is in the cache now. The one place that maps a decision to what the cache holds.
        """
        with fails_as("kernel"):
            if action == "quarantine" or screened.redaction is not None and action == "redact":
                # the content leaves exactly as it came; a stub or its redaction takes its place
                tokens = conv.stub(m.index, reason) if action == "quarantine" else \
                    conv.chunk(m.index, screened.redaction.data.decode("utf-8", "replace"))  # type: ignore[union-attr]
                self._compute(live.cache.rollback)
                self._compute(live.cache.stage, tokens)
                self._compute(live.cache.commit)
                return tokens
            self._compute(live.cache.commit)
            return m.tokens

    def _decision_input(self, principal: Principal, live: LiveSession, m: RenderedMessage,
                        verdict: Verdict, gated: "Gated") -> dict[str, Any]:
        created = live.record.created_at
        created = created if created.tzinfo else created.replace(tzinfo=timezone.utc)
        return {
            "tenant": principal.tenant, "user": principal.user,
            "session": {"id": live.record.id, "age_s": (datetime.now(timezone.utc) - created).total_seconds(),
                        "tokens": len(live.cache) - len(m.tokens), "quarantined_hashes": gated.quarantined},
            "channel": gated.channel, "content_sha256": m.content_sha256, "content_norm_sha256": m.norm_sha256,
            "tool": gated.tool,
            "span": {"bytes": len(m.content), "tokens": len(m.tokens)},
            "gate": verdict.policy_input(),
        }

    def _write(self, turn: Turn) -> None:
        """The turn's ledger rows in one transaction, with the intents of what it owes."""
        with fails_as("ledger"):
            turn.write = self.p.ledger.write_turn(turn.session_id, keep=turn.keep, new=[s.row for s in turn.staged],
                                                  intents_of=lambda appended: turn_intents(turn.staged, appended))
        for s, seg in zip(turn.staged, turn.write.appended):
            if s.action is not None:
                s.action.segment_id = seg.id

    # ---- TurnOps: how a turn ends -------------------------------------------------------------

    def commit(self, turn: Turn) -> None:
        """Relay the turn's audit intent: its records, keyed, exactly once."""
        assert turn.write is not None
        audited = [s.action for s in turn.staged if s.audit is not None]
        for intent in turn.write.intents:
            if intent.kind == "audit":
                for action, index in zip(audited, self.erasure.relay(intent)):
                    if action is not None:
                        action.audit_index = index

    def drop_generation(self, turn: Turn) -> None:
        if turn.live.cache.staged:
            self._compute(turn.live.cache.rollback)

    def restore(self, turn: Turn) -> None:
        live = turn.live
        if turn.write is not None:
            try:
                self.p.ledger.undo_turn(turn.write)
                turn.write = None
            except Exception as exc:  # the next request re-syncs the cache from what the ledger holds
                log.error("turn.undo_failed", session=turn.session_id, error=f"{type(exc).__name__}: {exc}")
        try:
            if live.cache.staged:
                self._compute(live.cache.rollback)
            self._sync_cache(live, turn.before)
        except Exception as exc:  # an empty cache is always consistent: the next turn rebuilds it
            log.error("turn.cache_reset", session=turn.session_id, error=f"{type(exc).__name__}: {exc}")
            live.cache.wipe()
            live.cache = self.p.kernel.new_cache(0)

    def post_turn(self, turn: Turn) -> list[dict[str, Any]]:
        erasures = self.erasure.post_turn(turn)
        if self.p.check_invariants:
            self.p.ledger.check_invariants(turn.session_id, cache_len=len(turn.live.cache))
        return erasures
