"""The witness rules: when a record's witness supports its kind. Pure: stdlib only.

One rule set, imported by the writer (``AuditLog.append``, through ``records.validate``) and by
the offline verifier, so "the log accepted it" and "the auditor accepts it" cannot drift apart.

Why these rules. An erasure record (``forget``, ``retention-forget``, and any kind added to
:data:`ERASURE_KINDS` later) claims the edited cache is bit-identical to a cache that never saw the
span. The kernel's never-saw witness (``kvkernel.witness.ForgetWitness``) measures exactly that, so
the claim stands only if the witness shows all three of max|ΔK|, max|ΔV| and max|Δlogits| exactly
0 (one missing measurement proves nothing about it), equal digests, ``equal`` and ``argmax_equal``
true, and names the erased span among its spans: a witness copied from another erasure does not
cover this one. An ``amortize`` (a Leyline splice) is *not* an erasure: its witness must say so
(``never_saw: false``), carry the measured divergence from never-saw, and name the spliced span;
it is never accepted as an erasure proof. Other kinds carry no witness.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

__all__ = ["DIVERGENCE", "ERASURE_KINDS", "MAX_DELTAS", "witness_errors"]

ERASURE_KINDS = frozenset({"forget", "retention-forget"})
MAX_DELTAS = ("max_abs_dk", "max_abs_dv", "max_abs_dlogits")  # K, V, logits: all three, always
_MISSING = object()
DIVERGENCE = ("kl_mean", "kl_max", "argmax_agreement", "max_abs_dlogits")  # kvkernel.witness.divergence()


def _is_int(v: Any) -> TypeGuard[int]:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))  # the first test settles parsed JSON


def _is_object(v: Any) -> TypeGuard[Mapping[str, Any]]:
    return type(v) is dict or isinstance(v, Mapping)  # the first test settles parsed JSON (an ABC check costs more)


def _is_number(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))  # isfinite(10**400) would raise


def _span(v: Any) -> tuple[int, int] | None:
    if (type(v) is list or isinstance(v, tuple)) and len(v) == 2:
        start, end = v
        if (type(start) is int or _is_int(start)) and (type(end) is int or _is_int(end)) and 0 <= start <= end:
            return start, end
    return None


def _spans(v: Any) -> list[tuple[int, int]] | None:
    """Sorted, non-overlapping, non-empty [start, end) spans, or None."""
    if not isinstance(v, (list, tuple)) or not v:
        return None
    spans, last = [], 0
    for item in v:
        span = _span(item)
        if span is None or span[0] == span[1] or span[0] < last:
            return None
        spans.append(span)
        last = span[1]
    return spans


def _erasure_errors(kind: str, w: Mapping[str, Any], body: Mapping[str, Any]) -> list[str]:
    errors = []
    if "kind" not in w:
        errors.append("witness kind missing: an erasure carries a never-saw witness")
    elif w["kind"] != "never-saw":
        errors.append(f"witness kind {w['kind']!r} is not a never-saw witness")
    for name in MAX_DELTAS:
        delta = w.get(name, _MISSING)
        if delta is _MISSING:
            errors.append(f"{name} missing: K, V and logits must all be measured")
        elif delta != 0 or not _is_number(delta):
            errors.append(f"{name} = {delta!r}, expected exactly 0")
    edited, reference = w.get("digest_edited"), w.get("digest_reference")
    if not isinstance(edited, str) or not edited:
        errors.append("digest_edited missing")
    elif edited != reference:
        errors.append(f"digest_edited {edited} != digest_reference {reference}")
    if w.get("equal") is not True:
        errors.append(f"equal = {w.get('equal')!r}, expected true")
    if w.get("argmax_equal") is not True:  # the kernel always measures it: absent proves nothing
        errors.append(f"argmax_equal = {w.get('argmax_equal')!r}, expected true")
    if w.get("never_saw", True) is not True:  # only amortize witnesses carry it (false)
        errors.append(f"never_saw = {w['never_saw']!r}, expected true")
    tokens = w.get("tokens")
    if not (_is_int(tokens) and tokens >= 0):
        errors.append("tokens (the surviving token count) must be a non-negative integer")
    spans = _spans(w.get("spans"))
    if spans is None:
        errors.append("spans must be sorted, non-overlapping, non-empty [start, end) pairs")
        return errors
    record_span = _span(body.get("span"))
    if record_span is None:
        errors.append(f"a {kind} record names the span it erased")
    elif record_span[0] < record_span[1] and record_span not in spans:
        errors.append(f"span {list(record_span)} is not among the witness's spans {[list(s) for s in spans]} (a witness of another erasure)")
    count = body.get("token_count")
    if record_span and _is_int(count) and count != record_span[1] - record_span[0]:
        errors.append(f"token_count {count} does not match span {list(record_span)}")
    if _is_int(tokens) and spans[-1][1] > tokens + sum(b - a for a, b in spans):
        errors.append(f"spans end at {spans[-1][1]}, past the {tokens} surviving + erased tokens")
    return errors


def _amortize_errors(w: Mapping[str, Any], body: Mapping[str, Any]) -> list[str]:
    errors = [] if w.get("never_saw") is False else ["never_saw must be false: amortize is not an erasure"]
    if w.get("kind", "amortize") != "amortize":
        errors.append(f"witness kind {w.get('kind')!r} is not an amortize witness")
    for name in DIVERGENCE:
        if not (_is_number(w.get(name)) and w[name] >= 0):
            errors.append(f"{name} missing or not a non-negative number: the measured divergence is required")
    if _is_number(w.get("argmax_agreement")) and w["argmax_agreement"] > 1:
        errors.append(f"argmax_agreement = {w['argmax_agreement']!r}, a fraction must be at most 1")
    span, record_span = _span(w.get("span")), _span(body.get("span"))
    if span is None or span != record_span:
        errors.append(f"witness span {w.get('span')!r} is not the record's span {body.get('span')!r}")
    return errors


def witness_errors(body: Mapping[str, Any]) -> list[str]:
    """Why a record's witness does not support its kind; empty when it does (see the module docstring)."""
    kind, w = body.get("kind"), body.get("witness")
    if isinstance(kind, str) and (kind in ERASURE_KINDS or kind == "amortize"):
        if not _is_object(w):
            return [f"a {kind} record needs the kernel's witness object"]
        return _erasure_errors(kind, w, body) if kind in ERASURE_KINDS else _amortize_errors(w, body)
    return [] if w is None else [f"a {kind} record carries no witness (only erasures and amortize do)"]
