"""Injection heuristics: phrase and template rules plus detectors for hidden or encoded text.

Pattern rules are cheap and precise; detectors look for places where instructions hide
(invisible Unicode, HTML a human never sees, base64/hex) and then ask the same question of
the hidden content as of visible text: does it read like an instruction to the model?
"""

from __future__ import annotations

import base64
import binascii
import itertools
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._text import Decoded, View, decode, detection_view, unicode_boundaries, word_chars
from .dbcache import CompileCache
from .engine import MultiMatcher, Pattern, SpanMatcher
from .errors import GateError
from .findings import Finding
from .learned import NgramScorer

RULES_PATH = Path(__file__).parent / "rules" / "injection.toml"
HIDDEN_CONTENT_MIN = 0.5  # content score above which hidden text counts as an injection
HIDDEN_SCORED = 64  # hidden regions scored one by one; the rest are scored once, together
ENCODED_CANDIDATES = 200  # base64 runs (and hex runs) decoded per result
HIDDEN_FINDINGS = 16  # hidden-character runs reported one by one; any further ones as one finding
HIDDEN_CHARS = 4000  # characters of one hidden region that are scored
TAG_LOOKBACK = 512  # characters searched back from hiding CSS for the element's opening "<"
ATTR_VALUE_MAX = 2000  # longest alt/title/aria-label value read

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
# Linear-time pieces of the hidden-HTML detector: every regex below has bounded repeats and a
# literal start, and the code that joins them (str.find, bisect) never rescans text.
_HIDING_CSS = re.compile(r"(?:display\s{0,8}:\s{0,8}none|visibility\s{0,8}:\s{0,8}hidden|font-size\s{0,8}:\s{0,8}0"
                         r"|opacity\s{0,8}:\s{0,8}0)", re.I)
_TAG_NAME = re.compile(r"<(\w{1,32})")
# Linear: a value scan stops at the next quote of its kind, and that quote opens the next
# candidate of the same kind, so the scans of one kind cover disjoint text (<= 2 passes each).
_ATTR = re.compile(r"\b(?:alt|title|aria-label)\s{0,8}=\s{0,8}(?:\"([^\"]{20,%d})\"|'([^']{20,%d})')" % (ATTR_VALUE_MAX, ATTR_VALUE_MAX), re.I)
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

    def __init__(self, rules: list[InjectionRule], scorer: NgramScorer | None, *,
                 cache: CompileCache | None = None) -> None:
        self.rules = rules
        self.scorer = scorer
        self._patterns = [Pattern(i, unicode_boundaries(r.regex) if r.regex else _SCREENS[r.id], caseless=True,
                                  utf8=bool(r.regex))
                          for i, r in enumerate(rules)]
        self.matcher = MultiMatcher(self._patterns, cache=cache)
        phrases = [p for p in self._patterns if rules[p.ident].regex]
        self._phrase = MultiMatcher(phrases, cache=cache)
        self._spans = SpanMatcher(phrases, cache=cache)

    # Detectors that look for the hidden characters themselves read the decoded text; everything
    # else reads the normalised view (gate._text.detection_view), offsets mapped back to raw bytes.
    _ON_RAW = frozenset({"hidden-unicode-tags", "hidden-zero-width", "hidden-bidi"})

    # The second reading (View.alt: combining marks dropped, invisible separators deleted) is read
    # by the phrase rules and the learned window: the detectors for hidden text already read the
    # raw text or the view, and a second pass of theirs would find the same regions again.
    _ON_ALT = frozenset({"learned-window"})

    def scan(self, doc: Decoded, view: View, excerpt: Excerpt, *, learned: bool = True,
             detectors: bool = True) -> list[Finding]:
        """Every rule's and detector's findings; `learned=False`: without the learned window (a
        reading of the text: its score is calibrated on text as it arrives); `detectors=False`:
        the phrase rules alone."""
        findings: list[Finding] = []
        triggered = set(self.matcher.triggered(view.clean))
        if view.changed:
            triggered |= {i for i in self.matcher.triggered(doc.clean) if self.rules[i].id in self._ON_RAW}
        if not learned:
            triggered = {i for i in triggered if self.rules[i].id not in self._ON_ALT}
        if not detectors:
            triggered = {i for i in triggered if self.rules[i].regex}
        for ident in sorted(triggered):
            rule = self.rules[ident]
            if rule.regex:
                findings.extend(self._phrase_findings(ident, view, excerpt))
            else:
                source = doc if rule.id in self._ON_RAW else view
                findings.extend(getattr(self, "_" + rule.id.replace("-", "_"))(source, rule, excerpt))
        if view.alt is not None:
            seen = set(findings)
            findings.extend(f for f in self._scan_alt(view.alt, excerpt, learned) if f not in seen)
        return findings

    def _scan_alt(self, alt: View, excerpt: Excerpt, learned: bool) -> Iterator[Finding]:
        """The phrase rules and the learned window on the second reading, where the evasions that
        one reading undoes (marks on every letter, a separator between every letter) read plainly."""
        for ident in sorted(set(self.matcher.triggered(alt.clean))):
            rule = self.rules[ident]
            if rule.regex:
                yield from self._phrase_findings(ident, alt, excerpt)
            elif learned and rule.id in self._ON_ALT:
                yield from getattr(self, "_" + rule.id.replace("-", "_"))(alt, rule, excerpt)

    def _phrase_findings(self, ident: int, view: View, excerpt: Excerpt) -> Iterator[Finding]:
        rule = self.rules[ident]
        for s, e in self._spans.spans(ident, view.clean):
            b0, b1 = view.raw_offset(s), view.raw_offset(e)
            yield Finding("injection", rule.id, "rules", b0, b1, rule.score, excerpt(b0, b1))

    # ----------------------------------------------------------------- content scoring

    def content_score(self, text: str) -> float:
        """How instruction-like a piece of (possibly hidden) text is: phrase rules or learned,
        both on its normalised view."""
        data = detection_view(decode(text.encode("utf-8", "replace"))).clean
        phrase = max((self.rules[i].score for i in self._phrase.triggered(data)
                      if self._spans.spans(i, data)), default=0.0)
        learned = self.scorer.probability(self.scorer.best_window(data).logit) if self.scorer and data else 0.0
        return max(phrase, learned)

    # ----------------------------------------------------------------- detectors

    def _learned_window(self, view: View, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        if self.scorer is None or not view.clean:
            return
        best = self.scorer.best_window(view.clean)
        p = self.scorer.probability(best.logit)
        if p >= 0.5:
            b0, b1 = view.raw_offset(best.byte_start), view.raw_offset(best.byte_end)
            yield Finding("injection", rule.id, "learned", b0, b1, p, excerpt(b0, b1))

    def _hidden_unicode_tags(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        flags = {m.span() for m in _TAG_FLAG.finditer(doc.text)}
        runs = [m for m in _TAGS.finditer(doc.text)
                if (m.start() - 1, m.end()) not in flags and m.end() - m.start() >= 2]  # not one emoji flag's tags
        for group in [[m] for m in runs[:HIDDEN_FINDINGS]] + ([runs[HIDDEN_FINDINGS:]] if runs[HIDDEN_FINDINGS:] else []):
            hidden = "".join(chr(ord(c) - 0xE0000) for c in group[0].group()[:80])
            b0, b1 = doc.byte_offset(group[0].start()), doc.byte_offset(group[-1].end())
            more = f" (+{len(group) - 1} more runs)" if len(group) > 1 else ""
            yield Finding("injection", rule.id, "heuristic", b0, b1, rule.score, f"hidden ASCII: {hidden!r}{more}")

    def _hidden_zero_width(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        cps = doc.cps
        hits = np.flatnonzero(((cps >= 0x200B) & (cps <= 0x200D)) | ((cps >= 0x2060) & (cps <= 0x2064)))
        if hits.size == 0:
            return
        alnum = word_chars(cps)
        inner = hits[(hits > 0) & (hits < cps.size - 1)]
        in_word = int(np.count_nonzero(alnum[inner - 1] & alnum[inner + 1]))
        runs = bool(np.any(np.diff(hits) == 1))
        if not (runs or in_word >= 3):
            return
        first, last = int(hits[0]), int(hits[-1])
        b0, b1 = doc.byte_offset(first), doc.byte_offset(last + 1)
        stripped = _ZERO_WIDTH.sub("", doc.text[first : last + 1][:HIDDEN_CHARS])
        score = max(rule.score, self.content_score(stripped) if in_word >= 3 else 0.0)
        yield Finding("injection", rule.id, "heuristic", b0, b1, score, f"{hits.size} zero-width chars: {excerpt(b0, b1)}")

    def _hidden_bidi(self, doc: Decoded, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        cps = doc.cps
        hits = np.flatnonzero(((cps >= 0x202A) & (cps <= 0x202E)) | ((cps >= 0x2066) & (cps <= 0x2069)))
        if hits.size:
            b0, b1 = doc.byte_offset(int(hits[0])), doc.byte_offset(int(hits[-1]) + 1)
            yield Finding("injection", rule.id, "heuristic", b0, b1, rule.score, f"{hits.size} bidi controls")

    def _hidden_html(self, view: View, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        """Instruction-like text in comments, CSS-hidden elements and alt/title/aria-label values.

        The first HIDDEN_SCORED regions are scored one by one; any further ones are scored once as
        one text (reported as one span), so 10 000 tiny comments cost one scoring, not 10 000."""
        regions = sorted(set(_comments(view.text)) | set(_css_hidden(view.text)) | set(_attribute_values(view.text)))
        groups = [[r] for r in regions[:HIDDEN_SCORED]]
        if len(regions) > HIDDEN_SCORED:
            groups.append(regions[HIDDEN_SCORED:])
        for group in groups:
            content = "\n".join(view.text[s:e][:HIDDEN_CHARS] for s, e in group)
            score = self.content_score(content)
            if score >= HIDDEN_CONTENT_MIN:
                b0, b1 = view.byte_offset(group[0][0]), view.byte_offset(group[-1][1])
                yield Finding("injection", rule.id, "heuristic", b0, b1, min(0.99, max(score, rule.score)), excerpt(b0, b1))

    def _encoded_payload(self, doc: View, rule: InjectionRule, excerpt: Excerpt) -> Iterator[Finding]:
        # The first ENCODED_CANDIDATES runs of each kind are decoded (each decode is linear in its run).
        candidates = [(m, _b64) for m in itertools.islice(_BASE64.finditer(doc.text), ENCODED_CANDIDATES)]
        candidates += [(m, _hex) for m in itertools.islice(_HEX.finditer(doc.text), ENCODED_CANDIDATES)]
        for m, decoder in candidates:
            decoded = decoder(m.group())
            if decoded is None:
                continue
            score = self.content_score(decoded)
            if score >= HIDDEN_CONTENT_MIN:
                b0, b1 = doc.byte_offset(m.start()), doc.byte_offset(m.end())
                yield Finding("injection", rule.id, "heuristic", b0, b1, min(0.99, max(score, rule.score)),
                              f"decodes to: {decoded[:80]!r}")


def _comments(text: str) -> Iterator[tuple[int, int]]:
    """Contents of <!-- ... --> (an unclosed comment runs to the end); each character read once."""
    pos = text.find("<!--")
    while pos >= 0:
        end = text.find("-->", pos + 4)
        yield pos + 4, len(text) if end < 0 else end
        if end < 0:
            return
        pos = text.find("<!--", end + 3)


def _css_hidden(text: str) -> Iterator[tuple[int, int]]:
    """Contents of elements whose opening tag hides them with CSS. The tag's "<" is searched at most
    TAG_LOOKBACK characters back; hiding CSS inside an element already reported is skipped."""
    done = 0
    for m in _HIDING_CSS.finditer(text):
        if m.start() < done:
            continue
        lt = text.rfind("<", max(0, m.start() - TAG_LOOKBACK), m.start())
        gt = text.find(">", m.end(), m.end() + TAG_LOOKBACK)
        name = _TAG_NAME.match(text, lt) if lt >= 0 else None
        if name is None or gt < 0 or ">" in text[lt : m.start()]:
            continue
        close = text.find("</" + name.group(1), gt + 1, gt + 1 + 4 * HIDDEN_CHARS)
        end = close if close >= 0 else min(len(text), gt + 1 + HIDDEN_CHARS)
        yield gt + 1, end
        done = end


def _attribute_values(text: str) -> Iterator[tuple[int, int]]:
    """alt/title/aria-label values of 20 to ATTR_VALUE_MAX characters."""
    for m in _ATTR.finditer(text):
        group = 1 if m.group(1) is not None else 2
        yield m.start(group), m.end(group)


def _texty(raw: bytes) -> str | None:
    """Decoded payloads only matter if they are readable text with words."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    sample = text[:HIDDEN_CHARS]  # judged on its start: a bounded cost per candidate
    printable = len(sample) if sample.isprintable() else sum(ch.isprintable() or ch in "\n\t" for ch in sample)
    if len(text) < 16 or printable < 0.95 * len(sample) or sample.count(" ") < 3:
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
