"""Redaction: replace the byte ranges of chosen findings by typed placeholders. Pure.

The gate reports findings as byte offsets into the bytes the tool returned; redaction cuts
exactly those ranges out and writes ``[REDACTED:<rule>]`` in their place, so the rest of the
result reaches the model unchanged. Overlapping or touching ranges are merged (the placeholder
names the first rule), so no byte of any chosen finding survives. The caller re-scans the
redacted bytes before admitting them: a placeholder is plain ASCII that no secret rule matches,
but a secret the gate did not locate is still there, and only the re-scan can say so.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .findings import Finding

_UNSAFE = re.compile(r"[^a-z0-9_]+")
# Cuts a record lists by offset; past this, the rest are counted and digested. A red team's result
# of thousands of keys made its records tens of times larger than itself.
LISTED_CUTS = 256


def placeholder(rule_id: str) -> bytes:
    """``[REDACTED:aws_access_key_id]`` for rule ``aws-access-key-id`` (lowercase, ``_`` separated)."""
    name = _UNSAFE.sub("_", rule_id.lower()).strip("_") or "secret"
    return f"[REDACTED:{name}]".encode()


@dataclass(frozen=True)
class Cut:
    """One replaced range of the original: offsets into the original bytes, never its content."""

    kind: str
    rule_id: str
    byte_start: int
    byte_end: int

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "rule_id": self.rule_id, "start": self.byte_start, "end": self.byte_end}


@dataclass(frozen=True)
class Redaction:
    """The redacted bytes and what was cut; ``original_sha256`` identifies the input for the audit log."""

    data: bytes
    cuts: tuple[Cut, ...]
    original_sha256: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def to_dict(self) -> dict[str, object]:
        """Audit-safe: hashes, kinds and offsets only, of a bounded size: the first `LISTED_CUTS`
        cuts, and past them the total and the SHA-256 of every cut's dict as compact sorted JSON,
        one list (an auditor holding the original recomputes the cuts and checks that digest)."""
        listed: dict[str, object] = {"original_sha256": self.original_sha256, "redacted_sha256": self.sha256,
                                     "cuts": [c.to_dict() for c in self.cuts[:LISTED_CUTS]]}
        if len(self.cuts) > LISTED_CUTS:
            every = json.dumps([c.to_dict() for c in self.cuts], sort_keys=True, separators=(",", ":"))
            listed.update(cuts_total=len(self.cuts), cuts_sha256=hashlib.sha256(every.encode()).hexdigest())
        return listed


def _merged(findings: Iterable[Finding], kinds: frozenset[str], size: int) -> list[Cut]:
    cuts: list[Cut] = []
    for f in sorted((f for f in findings if f.kind in kinds), key=lambda f: (f.byte_start, f.byte_end)):
        start, end = max(0, f.byte_start), min(size, f.byte_end)
        if end <= start:
            continue
        if cuts and start <= cuts[-1].byte_end:  # one cut; it is named after its most specific rule
            last = cuts[-1]
            named = f if _generic(last.rule_id) and not _generic(f.rule_id) else last
            cuts[-1] = Cut(named.kind, named.rule_id, last.byte_start, max(last.byte_end, end))
        else:
            cuts.append(Cut(f.kind, f.rule_id, start, end))
    return cuts


def _generic(rule_id: str) -> bool:
    """Generic rules (a keyword and an entropy check) name no format; a format rule says more."""
    return rule_id.startswith("generic")


def redact(data: bytes, findings: Iterable[Finding], kinds: Iterable[str]) -> Redaction:
    """Replace every finding whose kind is in ``kinds`` by its placeholder.

    ``findings`` must come from scanning exactly ``data`` (their offsets index it).
    """
    cuts = _merged(findings, frozenset(kinds), len(data))
    out, pos = bytearray(), 0
    for cut in cuts:
        out += data[pos:cut.byte_start]
        out += placeholder(cut.rule_id)
        pos = cut.byte_end
    out += data[pos:]
    return Redaction(bytes(out), tuple(cuts), hashlib.sha256(data).hexdigest())
