"""Report types: what the gateway, the audit log and the CLI consume."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    """One piece of evidence, located by byte offsets into the original tool result.

    ``excerpt`` is always safe to log: secret values are masked before a Finding is built.
    """

    kind: str  # "secret" | "injection" | "encoding"
    rule_id: str
    layer: str  # "rules" | "heuristic" | "learned"
    byte_start: int
    byte_end: int
    score: float
    excerpt: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GateReport:
    injection: float
    secret: float
    findings: tuple[Finding, ...]
    bytes_scanned: int
    elapsed_us: int
    # The gate also read a normalised text (gate._text.detection_view) that differs from the bytes:
    # its evidence may be in a reading a model's own view of the text never had.
    normalised: bool = False

    def to_dict(self) -> dict:
        out = asdict(self)
        out["findings"] = [f.to_dict() for f in self.findings]
        return out

    def summary(self, top: int = 5) -> dict:
        """Small and audit-safe: scores, counts per kind and the strongest rule ids, no excerpts."""
        ranked = sorted(self.findings, key=lambda f: -f.score)
        rule_ids = list(dict.fromkeys(f.rule_id for f in ranked))[:top]
        return {
            "injection": round(self.injection, 4),
            "secret": round(self.secret, 4),
            "counts": dict(Counter(f.kind for f in self.findings)),
            "top_rules": rule_ids,
            "bytes_scanned": self.bytes_scanned,
        }
