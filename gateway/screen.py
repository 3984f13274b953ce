"""What the chat pipeline and the MCP proxy both do once the policy has answered.

`redact`: the policy names the finding kinds to cut; `gate.redact` cuts them, the redacted bytes
are scanned again and put to the policy again, and only a clean second answer (allow) admits
them. Anything else (a secret the gate could not locate, an injection that survives, a policy
error) turns the redaction into a quarantine: redaction never admits unscanned bytes.

`withheld`: bytes a boundary (the MCP proxy) quarantined for a tenant are refused when they come
back through another door (a chat tool message), whatever the policy would say about them now.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gate import Finding, Gate, GateReport, Redaction, redact
from ledger import CrossingLog
from policies import Decision, PolicyEngine

from .chat import normalised_sha256


@dataclass(frozen=True)
class Screened:
    """The final decision; with a redaction, the bytes to admit and the re-scan that cleared them."""

    decision: Decision
    redaction: Redaction | None = None
    rescan: GateReport | None = None


def policy_findings(findings: Iterable[Finding]) -> list[dict[str, Any]]:
    """The findings as a decision input lists them: one entry per (kind, rule_id, layer), with its
    highest score and how many there were, in order of first appearance. A result of 3,000 keys
    listed one by one exhausted the policy engine's instruction budget, and its redaction became
    a quarantine by policy error; the rules ask which kinds and rules fired, not where."""
    grouped: dict[tuple[str, str, str], dict[str, Any]] = {}
    for f in findings:
        entry = grouped.setdefault((f.kind, f.rule_id, f.layer),
                                   {"kind": f.kind, "rule_id": f.rule_id, "layer": f.layer, "score": f.score, "count": 0})
        entry["score"] = max(entry["score"], f.score)
        entry["count"] += 1
    return list(grouped.values())


def gate_input(report: GateReport, injection: float | None = None) -> dict[str, Any]:
    """The `gate` object of a decision input: scores and finding kinds, no offsets or excerpts."""
    return {"injection": report.injection if injection is None else injection, "secret": report.secret,
            "findings": policy_findings(report.findings)}


Cutter = Callable[[bytes, GateReport, tuple[str, ...]], Redaction]


def _cut(data: bytes, report: GateReport, kinds: tuple[str, ...]) -> Redaction:
    return redact(data, report.findings, kinds)


def apply_redact(gate: Gate, policy: PolicyEngine, data: bytes, report: GateReport, decision: Decision,
                 ask: Callable[[GateReport, int], dict[str, Any]], cut: Cutter = _cut) -> Screened:
    """Carry out a `redact` decision on `data` (whose scan is `report`); other decisions pass through.

    `ask(rescan, n_bytes)` builds the policy input for the redacted bytes; `cut` redacts (the MCP
    proxy cuts a document of several parts part by part).
    """
    if decision.action != "redact":
        return Screened(decision)
    redaction = cut(data, report, decision.redact_kinds)
    rescan = gate.scan(redaction.data)
    second = policy.decide(ask(rescan, len(redaction.data)))
    if redaction.cuts and second.action == "allow":
        reasons = (*decision.reasons, f"redact_rescan: {len(redaction.cuts)} range(s) cut, re-scan allowed")
        return Screened(Decision("redact", reasons, decision.bundle_hash, decision.redact_kinds, decision.non_text),
                        redaction, rescan)
    why = "nothing to cut at the findings' offsets" if not redaction.cuts else f"re-scan gave {second.action}"
    reasons = (*decision.reasons, f"redact_rescan: {why}, so quarantine", *second.reasons)
    return Screened(Decision("quarantine", reasons, decision.bundle_hash, (), decision.non_text), redaction, rescan)


def pasted_digests(raw: bytes, exact: str, normalised: str) -> list[str]:
    """The digests a pasted tool message is matched against what a boundary withheld: its bytes'
    exact and normalised digests, and where it is JSON (an agent framework pasting an MCP result
    or its content list serialised, red team 13), those of the text blocks it carries, each and
    joined, normalised (so key order, spacing and escaping of the serialisation do not matter)."""
    digests = [exact, normalised]
    if raw[:1] not in (b"{", b"[") or len(raw) > 8_000_000:
        return digests
    try:
        texts = list(_text_fields(json.loads(raw)))
    except (ValueError, RecursionError):
        return digests
    if texts:
        encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
        digests += [normalised_sha256(b"\n".join(encoded))] + [normalised_sha256(t) for t in encoded]
    return digests


def _text_fields(value: Any) -> Iterator[str]:
    """Every string under a `text` key, in order (MCP text blocks and text resources)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "text" and isinstance(v, str):
                yield v
            else:
                yield from _text_fields(v)
    elif isinstance(value, list):
        for v in value:
            yield from _text_fields(v)


WITHHELD = "withheld_at_boundary"


def withheld_at_boundary(decision: Decision) -> bool:
    """Whether `refuse_withheld` quarantined these bytes: the boundary kept only their digests, and
    so does the chat ledger (its segment is born with its content retired, no blob stored)."""
    return bool(decision.reasons) and decision.reasons[0].startswith(WITHHELD + ":")


def refuse_withheld(crossings: CrossingLog, tenant: str, digests: Iterable[str], decision: Decision) -> Decision:
    """Quarantine bytes a boundary already withheld from this tenant, whatever `decision` says:
    `digests` are the bytes' exact and normalised (`chat.normalised_sha256`) SHA-256, as the
    boundary recorded both."""
    crossing = crossings.is_withheld(tenant, digests)
    if crossing is None:
        return decision
    reason = f"{WITHHELD}: crossing {crossing} quarantined these bytes at the MCP proxy"
    return Decision("quarantine", (reason, *decision.reasons), decision.bundle_hash, (), decision.non_text)
