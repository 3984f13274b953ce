"""Injection heuristics: phrase and template rules plus detectors for hidden or encoded text.

Pattern rules are cheap and precise; detectors look for places where instructions hide
(invisible Unicode, HTML a human never sees, base64/hex) and then ask the same question of
the hidden content as of visible text: does it read like an instruction to the model?
"""

from __future__ import annotations

import base64
import binascii
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ._text import Decoded
from .engine import MultiMatcher, Pattern
from .errors import GateError
from .findings import Finding
from .learned import NgramScorer

RULES_PATH = Path(__file__).parent / "rules" / "injection.toml"
HIDDEN_CONTENT_MIN = 0.5  # content score above which hidden text counts as an injection

# Hyperscan screens (over bytes) that decide whether a detector needs to run at all.
_SCREENS = {
    "hidden-unicode-tags": r"\xF3\xA0[\x80\x81]",
    "hidden-zero-width": r"\xE2\x80[\x8B-\x8D]|\xE2\x81[\xA0-\xA4]",
    "hidden-bidi": r"\xE2\x80[\xAA-\xAE]|\xE2\x81[\xA6-\xA9]",
    "hidden-html": r"<!--|display\s*:\s*none|visibility\s*:\s*hidden|font-size\s*:\s*0|opacity\s*:\s*0|\balt\s*=|\btitle\s*=|aria-label\s*=",
    "encoded-payload": r"[A-Za-z0-9+/_\-]{40}|[0-9A-Fa-f]{40}",
    "learned-window": r"\A",  # not screened: the learned layer always runs
}

_TAGS = re.compile("[\U000E0000-\U000E007F]+")
_TAG_FLAG = re.compile("\U0001F3F4[\U000E0020-\U000E007E]+\U000E007F")
_ZERO_WIDTH = re.compile("[\u200b-\u200d\u2060-\u2064]")
_BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")
_HTML_REGIONS = [
    re.compile(r"<!--(.*?)-->", re.S),
    re.compile(r"<(\w+)\b[^>]*?style\s*=\s*[\"'][^\"']*(?:display\s*:\s*none|visibility\s*:\s*hidden|font-size\s*:\s*0|opacity\s*:\s*0)"
               r"[^>]*>(.*?)</\1\s*>", re.S | re.I),
    re.compile(r"\b(?:alt|title|aria-label)\s*=\s*\"([^\"]{20,2000})\"|\b(?:alt|title|aria-label)\s*=\s*'([^']{20,2000})'", re.I),
]
_BASE64 = re.compile(r"[A-Za-z0-9+/_\-]{24,}={0,2}")
_HEX = re.compile(r"\b(?:[0-9A-Fa-f]{2}){20,}\b")


@dataclass(frozen=True)
class InjectionRule:
    id: str
    description: str
    score: float
    regex: str | None  # None for detectors implemented below
    utf8: bool
    examples: tuple[str, ...]
    counterexamples: tuple[str, ...]


def load_injection_rules(path: Path = RULES_PATH) -> list[InjectionRule]:
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    rules = [InjectionRule(r["id"], r.get("description", ""), r["score"], r.get("regex"), r.get("utf8", False),
                           tuple(r.get("examples", [])), tuple(r.get("counterexamples", [])))
             for r in doc.get("rules", []) + doc.get("detectors", [])]
    missing = [r.id for r in rules if r.regex is None and r.id not in _SCREENS]
    if missing:
        raise GateError(f"{path}: detectors {missing} have no implementation in gate/heuristics.py")
    return rules


Excerpt = Callable[[int, int], str]


class HeuristicScanner:
    """Runs the pattern rules (one Hyperscan pass) and the detectors they screen in."""

    def __init__(self, rules: list[InjectionRule], scorer: NgramScorer | None) -> None:
        self.rules = rules
        self.scorer = scorer
        self._patterns = [Pattern(i, r.regex if r.regex else _SCREENS[r.id], caseless=True, utf8=bool(r.regex))
                          for i, r in enumerate(rules)]
        self.matcher = MultiMatcher(self._patterns)
        self._phrase = MultiMatcher([p for p in self._patterns if rules[p.ident].regex])

    def scan(self, doc: Decoded, excerpt: Excerpt) -> list[Finding]:
        findings: list[Finding] = []
        for ident in self.matcher.triggered(doc.clean, doc.text):
            rule = self.rules[ident]
            if rule.regex:
                rx = self.matcher._python[ident]
                for m in rx.finditer(doc.text):
                    b0, b1 = doc.byte_offset(m.start()), doc.byte_offset(m.end())
                    findings.append(Finding("injection", rule.id, "rules", b0, b1, rule.score, excerpt(b0, b1)))
            else:
                findings.extend(getattr(self, "_" + rule.id.replace("-", "_"))(doc, rule, excerpt))
        return findings

    # ----------------------------------------------------------------- content scoring

    def content_score(self, text: str) -> float:
        """How instruction-like a piece of (possibly hidden) text is: phrase rules or learned."""
        data = text.encode("utf-8", "replace")
        phrase = max((self.rules[i].score for i in self._phrase.triggered(data, text)
                      if self._phrase._python[i].search(text)), default=0.0)
        learned = self.scorer.probability(self.scorer.best_window(data).logit) if self.scorer and data else 0.0
        return max(phrase, learned)

    # ----------------------------------------------------------------- detectors

    def _learned_window(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        if self.scorer is None or not doc.clean:
            return
        best = self.scorer.best_window(doc.clean)
        p = self.scorer.probability(best.logit)
        if p >= 0.5:
            yield Finding("injection", rule.id, "learned", best.byte_start, best.byte_end, p,
                          excerpt(best.byte_start, best.byte_end))

    def _hidden_unicode_tags(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        flags = {m.span() for m in _TAG_FLAG.finditer(doc.text)}
        for m in _TAGS.finditer(doc.text):
            if any(s <= m.start() and m.end() <= e for s, e in flags) or len(m.group()) < 2:
                continue
            hidden = "".join(chr(ord(c) - 0xE0000) for c in m.group())
            b0, b1 = doc.byte_offset(m.start()), doc.byte_offset(m.end())
            yield Finding("injection", rule.id, "heuristic", b0, b1, rule.score, f"hidden ASCII: {hidden[:80]!r}")

    def _hidden_zero_width(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        hits = [m.start() for m in _ZERO_WIDTH.finditer(doc.text)]
        in_word = [i for i in hits if 0 < i < len(doc.text) - 1 and doc.text[i - 1].isalnum() and doc.text[i + 1].isalnum()]
        runs = any(b - a == 1 for a, b in zip(hits, hits[1:]))
        if not (runs or len(in_word) >= 3):
            return
        b0, b1 = doc.byte_offset(hits[0]), doc.byte_offset(hits[-1] + 1)
        stripped = _ZERO_WIDTH.sub("", doc.text[hits[0] : hits[-1] + 1][:4000])
        score = max(rule.score, self.content_score(stripped) if len(in_word) >= 3 else 0.0)
        yield Finding("injection", rule.id, "heuristic", b0, b1, score, f"{len(hits)} zero-width chars: {excerpt(b0, b1)}")

    def _hidden_bidi(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        hits = [m.start() for m in _BIDI.finditer(doc.text)]
        if hits:
            b0, b1 = doc.byte_offset(hits[0]), doc.byte_offset(hits[-1] + 1)
            yield Finding("injection", rule.id, "heuristic", b0, b1, rule.score, f"{len(hits)} bidi controls")

    def _hidden_html(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        for rx in _HTML_REGIONS:
            for m in rx.finditer(doc.text):
                group = next(i for i in range(rx.groups, 0, -1) if m.group(i) is not None)
                content = m.group(group)
                score = self.content_score(content[:4000])
                if score >= HIDDEN_CONTENT_MIN:
                    b0, b1 = doc.byte_offset(m.start(group)), doc.byte_offset(m.end(group))
                    yield Finding("injection", rule.id, "heuristic", b0, b1, min(0.99, max(score, rule.score)), excerpt(b0, b1))

    def _encoded_payload(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        candidates = [(m, _b64(m.group())) for m in _BASE64.finditer(doc.text)]
        candidates += [(m, _hex(m.group())) for m in _HEX.finditer(doc.text)]
        for m, decoded in candidates[:200]:
            if decoded is None:
                continue
            score = self.content_score(decoded)
            if score >= HIDDEN_CONTENT_MIN:
                b0, b1 = doc.byte_offset(m.start()), doc.byte_offset(m.end())
                yield Finding("injection", rule.id, "heuristic", b0, b1, min(0.99, max(score, rule.score)),
                              f"decodes to: {decoded[:80]!r}")


def _texty(raw: bytes) -> str | None:
    """Decoded payloads only matter if they are readable text with words."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    if len(text) < 16 or printable < 0.95 * len(text) or text.count(" ") < 3:
        return None
    return text


def _b64(blob: str) -> str | None:
    try:
        body = blob.rstrip("=").replace("+", "-").replace("/", "_")
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        return None
    return _texty(raw)


def _hex(blob: str) -> str | None:
    try:
        return _texty(bytes.fromhex(blob))
    except ValueError:
        return None
