"""What an audit record may hold, its canonical bytes, and the witness rules. Pure: stdlib + rfc8785.

The log and the offline verifier both import this module, so "valid record" and "honest witness"
mean the same thing on both sides. The leaf a record hashes to is RFC 9162's
SHA-256(0x00 || JCS(body)), where JCS is RFC 8785: every verifier hashes the same bytes.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import rfc8785

from .errors import AuditError

__all__ = [
    "AuditRecord",
    "ERASURE_KINDS",
    "KINDS",
    "body_errors",
    "canonical",
    "format_time",
    "parse_time",
    "rotation_message",
    "validate",
    "witness_errors",
]

KINDS = frozenset({"forget", "quarantine", "amortize", "retention-forget", "policy-bundle", "key-rotation",
                   "redact", "mcp-call", "mcp-result"})  # redact and mcp-* record what was shown, not erasures
ERASURE_KINDS = frozenset({"forget", "retention-forget", "quarantine"})  # amortize is explicitly not an erasure

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_STR_FIELDS = ("tenant", "session", "segment_id", "actor")
_DICT_FIELDS = ("gate", "witness", "key")
ROTATION_FIELDS = ("origin", "old_key_id", "old_key_name", "new_key_id", "new_key_name", "new_public_key")


def format_time(t: datetime) -> str:
    """UTC, microseconds, 'Z': one spelling, so the canonical bytes of a time never vary."""
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)


def canonical(body: Mapping[str, Any]) -> bytes:
    """RFC 8785 bytes of a record body."""
    try:
        return rfc8785.dumps(body)
    except rfc8785.CanonicalizationError as e:
        raise AuditError(f"audit record is not canonical JSON ({e}); use str, int (< 2**53), float, bool, list, dict") from e


def _has_content(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "content" in value or any(_has_content(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_content(v) for v in value)
    return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_errors(body: Mapping[str, Any]) -> list[str]:
    errors = [f"'{f}' must be a string" for f in _STR_FIELDS if f in body and not isinstance(body[f], str)]
    errors += [f"'{f}' must be an object" for f in _DICT_FIELDS if f in body and not isinstance(body[f], Mapping)]
    if "span" in body:
        span = body["span"]
        if not (isinstance(span, list | tuple) and len(span) == 2 and all(map(_is_int, span)) and 0 <= span[0] <= span[1]):
            errors.append("'span' must be [start, end] token positions with 0 <= start <= end")
    if "token_count" in body and not (_is_int(body["token_count"]) and body["token_count"] >= 0):
        errors.append("'token_count' must be a non-negative integer")
    if "content_sha256" in body and not (isinstance(body["content_sha256"], str) and _SHA256_HEX.fullmatch(body["content_sha256"])):
        errors.append("'content_sha256' must be 64 lowercase hex digits")
    if "decision" in body:
        d = body["decision"]
        if not (isinstance(d, Mapping) and isinstance(d.get("action"), str)):
            errors.append("'decision' must be an object with a string 'action'")
        elif not isinstance(d.get("reasons", []), list) or not isinstance(d.get("bundle_hash", ""), str):
            errors.append("'decision.reasons' must be a list and 'decision.bundle_hash' a string")
    return errors


def witness_errors(body: Mapping[str, Any]) -> list[str]:
    """Why a record's witness does not support its kind; empty when it does.

    A ``forget`` claims the edited cache is bit-identical to one that never saw the span, so its
    witness must show every max|Δ| exactly 0 and equal digests. An ``amortize`` is honest only if
    it says it is not an erasure (``never_saw`` false) and carries its measured divergence.
    """
    kind, w = body.get("kind"), body.get("witness")
    if kind not in ("forget", "amortize"):
        return []
    if not isinstance(w, Mapping):
        return [f"a {kind} record needs the kernel's witness object"]
    if kind == "amortize":
        errors = [] if w.get("never_saw") is False else ["amortize witness must say never_saw: false (it is not an erasure)"]
        return errors + ([] if "divergence" in w else ["amortize witness must carry its measured divergence"])
    deltas = {k: v for k, v in w.items() if k.startswith("max_abs_")}
    errors = [] if deltas else ["forget witness has no max_abs_* measurement"]
    errors += [f"{k} = {v!r}, expected exactly 0" for k, v in sorted(deltas.items()) if not (_is_int(v) or isinstance(v, float)) or v != 0]
    if not isinstance(w.get("digest_edited"), str) or not w.get("digest_edited"):
        errors.append("forget witness has no digest_edited")
    elif w.get("digest_edited") != w.get("digest_reference"):
        errors.append(f"digest_edited {w.get('digest_edited')} != digest_reference {w.get('digest_reference')}")
    errors += [f"{flag} = {w[flag]!r}, expected true" for flag in ("equal", "never_saw") if flag in w and w[flag] is not True]
    return errors


def body_errors(body: Mapping[str, Any]) -> list[str]:
    """What is wrong with a record body's kind, content and field types; empty if valid.

    The witness is judged separately (``witness_errors``), so a verifier can name which check failed.
    """
    if body.get("kind") not in KINDS:
        return [f"kind {body.get('kind')!r} is not one of {sorted(KINDS)}"]
    errors = ["records never hold content; put its sha256 in 'content_sha256'"] if _has_content(body) else []
    if body["kind"] == "key-rotation" and not isinstance(body.get("key"), Mapping):
        errors.append("a key-rotation record needs its 'key' object")
    return errors + _type_errors(body)


def rotation_message(key: Mapping[str, Any]) -> bytes:
    """The bytes the old key signs to hand over to the new one (a key-rotation record's 'key')."""
    return b"lethe audit key rotation\n" + canonical({f: key.get(f) for f in ROTATION_FIELDS})


def validate(body: Mapping[str, Any], time: datetime) -> tuple[dict[str, Any], bytes]:
    """Check a caller's record body, stamp the log's time, return (body, canonical bytes).

    The returned body is parsed back from the canonical bytes, so it is exactly what was hashed.
    """
    if not isinstance(body, Mapping):
        raise AuditError("an audit record is a JSON object")
    if "time" in body:
        raise AuditError("'time' is set by the log; leave it out of the record")
    errors = body_errors(body) or witness_errors(body)
    if errors:
        raise AuditError(f"invalid {body.get('kind')} audit record: " + "; ".join(errors))
    entry = canonical({**body, "time": format_time(time)})
    return json.loads(entry), entry


@dataclass(frozen=True)
class AuditRecord:
    """One log entry. ``leaf_hash`` (hex) is SHA-256(0x00 || JCS(body))."""

    index: int
    time: datetime
    body: dict[str, Any]
    leaf_hash: str

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "time": format_time(self.time), "leaf_hash": self.leaf_hash, "body": self.body}
