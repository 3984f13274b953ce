"""What an audit record may hold, its canonical bytes, and the witness rules. Pure: stdlib, rfc8785, orjson.

The log and the offline verifier both import this module (and ``rules``, the witness rules), so
"valid record" and "honest witness" mean the same thing on both sides. The leaf a record hashes to is RFC 9162's
SHA-256(0x00 || JCS(body)), where JCS is RFC 8785: every verifier hashes the same bytes.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import orjson
import rfc8785

from .errors import AuditError
from .rules import ERASURE_KINDS, _is_int, _is_object, _span, witness_errors

__all__ = [
    "AuditRecord",
    "ERASURE_KINDS",
    "KINDS",
    "body_errors",
    "canonical",
    "canonical_parsed",
    "canonical_record",
    "compact_sorted",
    "format_time",
    "parse_time",
    "rotation_message",
    "spelling_doubts",
    "validate",
    "witness_errors",
]

# redact and mcp-* record what was shown, not erasures; retention-retire deletes the stored bytes of a
# quarantined result, which never entered the KV cache (its stub did), so it has no never-saw witness;
# content-erase deletes the stored bytes of a segment no longer in any cache (superseded by a history
# rewrite): no kernel work, no witness.
KINDS = frozenset({"forget", "quarantine", "amortize", "retention-forget", "retention-retire", "policy-bundle",
                   "key-rotation", "redact", "mcp-call", "mcp-result", "content-erase", "kv-release"})

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")
_STR_FIELDS = ("tenant", "session", "segment_id", "actor")
_DICT_FIELDS = ("gate", "witness", "key", "copies")
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


# Where orjson's compact sorted spelling (``compact_sorted``) may differ from RFC 8785: a byte outside
# ASCII (RFC 8785 orders names by UTF-16 code units), an integral float (always ".0" then ",", "]"
# or "}": "1.0" vs "1"), an exponent (always "e-" or "e+": "1e-6" vs "0.000001", "1e+16" vs
# "10000000000000000"). Integers need no look: orjson refuses to spell one that RFC 8785 refuses
# (2**53 and up: OPT_STRICT_INTEGER) and spells the others alike. Each pattern starts with a byte
# ('.', '-', '+') that the regex engine scans for at a few GB/s, several times faster than a
# substring search or a translation; a '+' is rarer still, and memchr looks for it first. A hit
# inside a string costs only the RFC 8785 encoder.
_MAY_DIFFER = ((b".", re.compile(rb"\.0[,\]}]")), (b"-", re.compile(rb"-(?<=e-)")), (b"+", re.compile(rb"\+(?<=e\+)")))
_SPELLING = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER


def spelling_doubts(spelt: bytes) -> bool:
    """Whether ``spelt`` (``compact_sorted`` output, or a text made of such pieces and ASCII outside
    them) may differ from RFC 8785; where it may not, it is RFC 8785."""
    return not spelt.isascii() or any(first in spelt and p.search(spelt) for first, p in _MAY_DIFFER)


def canonical_parsed(body: Mapping[str, Any]) -> bytes:
    """``canonical(body)`` for a body that ``json.loads`` produced, several times faster.

    For such a body (str keys, JSON types only) that is all ASCII, the compact sorted spelling
    escapes strings and orders keys as RFC 8785 does; numbers are the only difference, and any
    number that could be spelt differently sends the body to the RFC 8785 encoder
    (``spelling_doubts``). A property test compares both on random JSON.
    """
    return _spelt(body, body)


def canonical_record(body: Mapping[str, Any]) -> bytes:
    """``canonical(body)`` for a body a caller built, several times faster for the usual one.

    A caller's body is not yet JSON: it may hold what orjson spells and RFC 8785 refuses (a
    datetime, a NaN, a str subclass), and scores like 0.0, which orjson spells ``0.0`` and RFC 8785
    ``0`` (a doubt that would send every gate summary to the slow encoder). ``_plain`` copies it
    with each integral float as the integer RFC 8785 spells for it, or finds something not plain
    JSON and leaves the whole body to the RFC 8785 encoder, which accepts or refuses it as ever.
    """
    plain = _plain(body)
    return canonical(body) if plain is _NOT_PLAIN else _spelt(body, plain)


def _spelt(body: Any, plain: Any) -> bytes:
    """``plain``'s compact sorted spelling where it is RFC 8785; else ``body``'s RFC 8785 bytes."""
    try:
        fast = compact_sorted(plain)
    except TypeError:  # orjson refuses it (an integer of 2**53 or more, a lone surrogate): RFC 8785 decides
        return canonical(body)
    return canonical(body) if spelling_doubts(fast) else fast


_NOT_PLAIN = object()
_INTEGRAL_MAX = 2.0**53  # past it an integral float is no exact JSON integer here: RFC 8785 spells it


def _plain(value: Any) -> Any:
    """``value`` as exact JSON types (dict with str keys, list, str, int, bool, None, finite float),
    integral floats below 2**53 as ints; ``_NOT_PLAIN`` if anything else is in it (a subclass
    included: only the exact types are known to spell alike)."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            return _NOT_PLAIN
        return int(value) if value.is_integer() and abs(value) < _INTEGRAL_MAX else value
    if kind is dict:
        out = {}
        for k, v in value.items():
            item = _plain(v)
            if type(k) is not str or item is _NOT_PLAIN:
                return _NOT_PLAIN
            out[k] = item
        return out
    if kind is list or kind is tuple:
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if any(i is _NOT_PLAIN for i in items) else items
    return _NOT_PLAIN


def compact_sorted(body: Mapping[str, Any]) -> bytes:
    """The body in compact JSON, names sorted, in UTF-8 (non-ASCII raw, control characters escaped):
    orjson's spelling, several times faster than ``json.dumps``.

    Raises TypeError (``orjson.JSONEncodeError``) where orjson refuses: an integer of 2**53 or more
    (RFC 8785 refuses it too), a lone surrogate, a name that is not a string, a type JSON lacks.
    Differs from RFC 8785 only where ``spelling_doubts`` looks (property tests compare them on nasty JSON).
    """
    return orjson.dumps(body, option=_SPELLING)


def _has_content(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "content" in value or any(_has_content(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_content(v) for v in value)
    return False


def _type_errors(body: Mapping[str, Any]) -> list[str]:
    errors = []
    for name in _STR_FIELDS:
        if name in body and not isinstance(body[name], str):
            errors.append(f"'{name}' must be a string")
    for name in _DICT_FIELDS:
        if name in body and not _is_object(body[name]):
            errors.append(f"'{name}' must be an object")
    if "span" in body and _span(body["span"]) is None:
        errors.append("'span' must be [start, end] token positions with 0 <= start <= end")
    count = body.get("token_count", 0)
    if not (_is_int(count) and count >= 0):
        errors.append("'token_count' must be a non-negative integer")
    if "content_sha256" in body and not (isinstance(body["content_sha256"], str) and _SHA256_HEX.fullmatch(body["content_sha256"])):
        errors.append("'content_sha256' must be 64 lowercase hex digits")
    if "time" in body and not (isinstance(body["time"], str) and _TIME.fullmatch(body["time"])):
        errors.append("'time' must be UTC as YYYY-MM-DDTHH:MM:SS.ffffffZ")
    if "decision" in body:
        d = body["decision"]
        if not (_is_object(d) and isinstance(d.get("action"), str)):
            errors.append("'decision' must be an object with a string 'action'")
        elif not isinstance(d.get("reasons", []), list) or not isinstance(d.get("bundle_hash", ""), str):
            errors.append("'decision.reasons' must be a list and 'decision.bundle_hash' a string")
    return errors


def body_errors(body: Mapping[str, Any], entry: bytes | None = None) -> list[str]:
    """What is wrong with a record body's kind, content and field types; empty if valid.

    ``entry``, the body's canonical bytes if known, spares the search for a 'content' name when
    they do not hold one. The witness is judged separately (``witness_errors``), so a verifier
    can name which check failed.
    """
    if not isinstance(body.get("kind"), str) or body["kind"] not in KINDS:  # a list or an object is no kind (nor hashable)
        return [f"kind {body.get('kind')!r} is not one of {sorted(KINDS)}"]
    maybe_content = entry is None or b'"content"' in entry
    errors = ["records never hold content; put its sha256 in 'content_sha256'"] if maybe_content and _has_content(body) else []
    if body["kind"] == "key-rotation":
        key = body.get("key")
        if not isinstance(key, Mapping) or not all(isinstance(key.get(f), str) for f in (*ROTATION_FIELDS, "signature")):
            errors.append(f"a key-rotation record needs its 'key' object of strings {[*ROTATION_FIELDS, 'signature']}")
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
    entry = canonical_record({**body, "time": format_time(time)})
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
