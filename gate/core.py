"""The Gate: decode once, run the secrets, heuristic and learned layers, combine the scores."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import structlog

from ._text import Decoded, View, decode, detection_view, unicode_tables
from .findings import Finding, GateReport
from .heuristics import HeuristicScanner, load_injection_rules
from .joined import JOIN_WINDOW, scan_joined
from .learned import WEIGHTS_PATH, NgramScorer
from .dbcache import CompileCache
from .engine import require_hyperscan
from .errors import GateError
from .unwrap import readings, text_readings, word_readings
from .secrets import Allowlist, SecretRule, SecretScanner, load_gitleaks, load_rules

log = structlog.get_logger(__name__)

EXCERPT_BYTES = 120
MAX_ENCODING_FINDINGS = 16


class Gate:
    """Scores one tool result for prompt injection and secrets. Build once; ``scan`` is thread-safe."""

    def __init__(self, *, gitleaks_config: Path | None = None, learned: bool = True,
                 cache: CompileCache | None = None) -> None:
        """``cache``: where compiled rule databases are kept (default: the directory
        ``LETHE_GATE_CACHE_DIR`` names; see gate/dbcache.py)."""
        require_hyperscan()
        rules, allowlist = load_rules()
        if gitleaks_config is not None:
            extra, extra_allow = load_gitleaks(Path(gitleaks_config))
            rules += [_with_global_allowlist(r, extra_allow) for r in extra]
            log.info("gitleaks_rules_loaded", path=str(gitleaks_config), rules=len(extra))
        self.secret_rules = rules
        self.secrets = SecretScanner(rules, allowlist, cache=cache)
        scorer = None
        if learned:
            if not WEIGHTS_PATH.exists():
                raise GateError(f"{WEIGHTS_PATH} missing; run `python -m gate.train.train_injection` or pass learned=False")
            scorer = NgramScorer.load(WEIGHTS_PATH)
        self.heuristics = HeuristicScanner(load_injection_rules(), scorer, cache=cache)
        unicode_tables()  # built once here (~0.3 s), not on the first request

    def scan(self, data: bytes, *, content_type: str | None = None, tool: str | None = None,
             learned: bool = True) -> GateReport:
        """Never raises on input: any bytes (str is encoded as UTF-8) give a report. `learned=False`:
        the rules and heuristics alone, without the learned window (a quarter of the work), for a
        caller that reads a text no one sent as such (history.py's joins of two results)."""
        t0 = time.perf_counter_ns()
        doc = _decoded(data)
        findings = _encoding_findings(doc)
        view = detection_view(doc)  # normalised text for detection; findings keep raw offsets
        secrets = self._secrets(doc, view)
        spans = [(f.byte_start, f.byte_end) for f in secrets]
        findings += secrets
        findings += self.heuristics.scan(doc, view, lambda b0, b1: _excerpt(doc, b0, b1, spans), learned=learned)
        findings += self._escaped_injection(doc, spans)
        findings.sort(key=_reading_order)
        report = GateReport(
            injection=_noisy_or(f for f in findings if f.kind == "injection"),
            secret=max((f.score for f in secrets), default=0.0),
            findings=tuple(findings),
            bytes_scanned=len(doc.raw),
            elapsed_us=(time.perf_counter_ns() - t0) // 1000,
            normalised=bool(view.readings),
        )
        return report

    def scan_secrets(self, data: bytes | str) -> list[Finding]:
        """Only the secret findings that `scan` reports for these bytes, without the injection
        layers (about half the work): for a caller that looks for credentials alone, such as the MCP
        guard's second look at a key cut across two parts."""
        doc = _decoded(data)
        return sorted(self._secrets(doc, detection_view(doc)), key=_reading_order)

    def _secrets(self, doc: Decoded, view: View) -> list[Finding]:
        secrets = self.secrets.scan(doc.clean)
        for reading in view.readings:  # a token split by zero-width characters, a combining mark or a
            # no-break space, or spelled in fullwidth, is still one; its span covers what split it
            seen = {(f.rule_id, f.byte_start, f.byte_end) for f in secrets}
            moved = (replace(f, byte_start=reading.raw_offset(f.byte_start), byte_end=reading.raw_offset(f.byte_end))
                     for f in self.secrets.scan(reading.clean))
            secrets += [f for f in moved if (f.rule_id, f.byte_start, f.byte_end) not in seen]
        for unwrapped in readings(doc.clean):  # escaped (a file in a JSON string) or base64-encoded
            seen = {(f.rule_id, f.byte_start, f.byte_end) for f in secrets}
            for f in self.secrets.scan(unwrapped.data):
                s, e = unwrapped.raw_span(f.byte_start, f.byte_end)
                if (f.rule_id, s, e) not in seen:
                    seen.add((f.rule_id, s, e))
                    secrets.append(replace(f, byte_start=s, byte_end=e))
        return secrets

    def _escaped_injection(self, doc: Decoded, spans: list[tuple[int, int]]) -> list[Finding]:
        """The injection rules' findings on the readings with escapes undone (`text_readings`),
        at the raw spans they came from. Rules only: the learned window and its calibration stay
        as trained, on the text as it arrived."""
        out: list[Finding] = []
        escaped = [(r, True) for r in text_readings(doc.clean)]
        for unwrapped, detectors in escaped + [(r, False) for r in word_readings(doc.clean)]:
            inner = _decoded(unwrapped.data)
            for f in self.heuristics.scan(inner, detection_view(inner), lambda b0, b1: "", learned=False,
                                          detectors=detectors):
                if f.kind == "injection" and f.byte_end > f.byte_start:
                    s, e = unwrapped.raw_span(f.byte_start, f.byte_end)
                    out.append(replace(f, byte_start=s, byte_end=e, excerpt=_excerpt(doc, s, e, spans)))
        return out

    def scan_joined(self, parts: Sequence[bytes], *, window: int = JOIN_WINDOW,
                    own: Sequence[GateReport] | None = None, learned: bool = True) -> tuple[GateReport, ...]:
        """Adjacent untrusted parts scored alone and joined (see gate/joined.py for the window)."""
        return scan_joined(self, parts, window=window, own=own, learned=learned)


def _decoded(data: bytes | str) -> Decoded:
    """Any bytes as `scan` takes them (a str as UTF-8, lone surrogates kept)."""
    return decode(bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data))


def _reading_order(f: Finding) -> tuple[int, int, str]:
    return f.byte_start, f.byte_end, f.rule_id


def _with_global_allowlist(rule: SecretRule, allow: Allowlist) -> SecretRule:
    """gitleaks' global allowlist applies to its own rules only, not to the project's."""
    merged = Allowlist(rule.allowlist.regexes + allow.regexes, rule.allowlist.stopwords + allow.stopwords)
    return replace(rule, allowlist=merged)


def _noisy_or(findings) -> float:
    """P(injection) if each rule's evidence were independent; per rule only its strongest hit counts,
    so one phrase repeated 50 times is not 50 pieces of evidence."""
    best: dict[str, float] = {}
    for f in findings:
        best[f.rule_id] = max(best.get(f.rule_id, 0.0), f.score)
    p_clean = 1.0
    for score in best.values():
        p_clean *= 1.0 - min(max(score, 0.0), 1.0)
    return 1.0 - p_clean


def _encoding_findings(doc: Decoded) -> list[Finding]:
    runs = doc.invalid
    out = [Finding("encoding", "invalid-utf8", "rules", s, e, 1.0, f"{e - s} invalid byte(s) replaced")
           for s, e in runs[:MAX_ENCODING_FINDINGS].tolist()]
    if len(runs) > MAX_ENCODING_FINDINGS:
        s, e = int(runs[MAX_ENCODING_FINDINGS, 0]), int(runs[-1, 1])
        more = len(doc.invalid) - MAX_ENCODING_FINDINGS
        out.append(Finding("encoding", "invalid-utf8", "rules", s, e, 1.0, f"{more} more invalid runs"))
    return out


def _excerpt(doc: Decoded, b0: int, b1: int, secret_spans: list[tuple[int, int]]) -> str:
    """Readable excerpt of [b0, b1) with any overlapping secret replaced, so excerpts are log-safe."""
    end = min(b1, b0 + EXCERPT_BYTES)
    chunk = bytearray(doc.clean[b0:end])
    for s, e in secret_spans:
        lo, hi = max(s, b0), min(e, end)
        if lo < hi:
            chunk[lo - b0 : hi - b0] = b"\x00" * (hi - lo)
    text = re.sub("\x00+", "[SECRET]", chunk.decode("utf-8", "ignore"))
    return text + ("…" if end < b1 else "")


_default: Gate | None = None
_default_lock = threading.Lock()


def default_gate() -> Gate:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Gate()
    return _default


def scan(data: bytes, *, content_type: str | None = None, tool: str | None = None) -> GateReport:
    """Scan with the lazily built module-level Gate (thread-safe)."""
    return default_gate().scan(data, content_type=content_type, tool=tool)
