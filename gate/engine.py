"""One multi-pattern matcher for every regex layer: Hyperscan when importable, ``re`` otherwise.

Hyperscan scans all patterns in a single pass over the bytes, which is what lets the rules
layer keep up with tool results at >100 MB/s. It needs a scratch space per thread, so the
scratch lives in a ``threading.local``. Hyperscan is used as the single-pass screen (which
patterns occur at all); the few patterns it flags are then run with ``re`` for exact spans
and capture groups, which is cheap because real matches are rare in tool results.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
import re
import threading
from dataclasses import dataclass

from .dbcache import CompileCache, CompileFailed, compile_cache, key_of
from .errors import GateError

try:  # pragma: no cover - exercised on machines without the wheel
    import hyperscan

    HAVE_HYPERSCAN = True
    HYPERSCAN_ERROR = ""
except ImportError as exc:  # pragma: no cover
    hyperscan = None  # type: ignore[assignment]
    HAVE_HYPERSCAN = False
    HYPERSCAN_ERROR = str(exc)


_HYPERSCAN_VERSION = importlib.metadata.version("hyperscan") if HAVE_HYPERSCAN else ""  # its wheel bundles the library


# Every scan reads the data and one newline after it. Hyperscan 5.4 (the wheel's) missed a match
# that ends exactly at the end of a 17-34 byte buffer on an AMD Zen 5 (AVX-512; `\\"` after 15
# bytes, a short literal's tail scan), while a byte after it made the match found. A newline
# keeps `$` (end, or before a final newline) and `\b` as they were at the end; matches that reach
# into it are clamped to the data, and `re` confirms every match on the data itself.
# `tests/gate/test_engine_tail.py` places every rule's examples at the end of buffers of every
# length up to 96 bytes on the machine the tests run on.
PAD = b"\n"


def require_hyperscan() -> None:
    """The gate's time bound rests on Hyperscan (automata, linear in the input): without it the
    rules would run on a backtracking engine over attacker text, so the gate refuses to start."""
    if not HAVE_HYPERSCAN:
        raise GateError(f"hyperscan cannot be imported ({HYPERSCAN_ERROR}); the gate's time bound needs it: "
                        "install the wheel (`pip install hyperscan`, x86-64 Linux/macOS) in the gateway's environment")


@dataclass(frozen=True)
class Pattern:
    """A regex over bytes; ``utf8`` patterns may use non-ASCII literals and classes."""

    ident: int
    regex: str
    caseless: bool = False
    utf8: bool = False
    window: int = 0  # > 0: no match is longer; confirm only the bytes before each Hyperscan match end


def compile_python(pattern: Pattern) -> re.Pattern:
    """The ``re`` twin of a pattern: over ``str`` for UTF-8 patterns (Unicode case folding),
    over ``bytes`` otherwise (offsets are then byte offsets directly)."""
    flags = re.IGNORECASE if pattern.caseless else 0
    if pattern.utf8:
        return re.compile(pattern.regex, flags)
    return re.compile(pattern.regex.encode("utf-8"), flags)


def _compile(patterns: list[Pattern], flags: list[int], cache: CompileCache):
    """One block-mode database of ``patterns`` with ``flags``, from ``cache`` when it holds it;
    ``hyperscan.error`` when Hyperscan refuses them (a refusal is cached too)."""
    expressions = [p.regex.encode("utf-8") for p in patterns]
    ids = [p.ident for p in patterns]

    def build():
        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        try:
            db.compile(expressions=expressions, ids=ids, elements=len(patterns), flags=flags)
        except hyperscan.error as exc:
            raise CompileFailed(str(exc)) from exc
        return db

    key = key_of(_HYPERSCAN_VERSION, hyperscan.HS_MODE_BLOCK, expressions, ids, flags)
    try:
        return cache.get(key, build, hyperscan.dumpb, lambda b: hyperscan.loadb(b, hyperscan.HS_MODE_BLOCK))
    except CompileFailed as exc:
        raise hyperscan.error(str(exc)) from None


class MultiMatcher:
    """Compile once, scan many times from any thread."""

    def __init__(self, patterns: list[Pattern], *, cache: CompileCache | None = None) -> None:
        require_hyperscan()
        self.patterns = {p.ident: p for p in patterns}
        self._python = {p.ident: compile_python(p) for p in patterns}
        self._local = threading.local()
        self._cache = cache or compile_cache()
        self._db = self._compile_hyperscan(patterns) if patterns else None

    @staticmethod
    def _flags(p: Pattern, prefilter: bool = False) -> int:
        flags = hyperscan.HS_FLAG_DOTALL | (0 if p.window else hyperscan.HS_FLAG_SINGLEMATCH)
        if p.caseless:
            flags |= hyperscan.HS_FLAG_CASELESS
        if p.utf8:
            flags |= hyperscan.HS_FLAG_UTF8  # no UCP: it rejects \b; callers screen case-folded text
        if prefilter:
            flags |= hyperscan.HS_FLAG_PREFILTER
        return flags

    def _compile_hyperscan(self, patterns: list[Pattern]):
        """Exact mode where Hyperscan can; prefilter mode (a superset, confirmed by ``re``) where a
        pattern is too large for it, e.g. long bounded repeats."""
        try:
            return _compile(patterns, [self._flags(p) for p in patterns], self._cache)
        except hyperscan.error:
            pass
        flags = []
        for p in patterns:
            try:
                _compile([p], [self._flags(p)], self._cache)
                flags.append(self._flags(p))
            except hyperscan.error:
                flags.append(self._flags(p, prefilter=True))
        return _compile(patterns, flags, self._cache)

    @staticmethod
    def hyperscan_error(pattern: Pattern) -> str | None:
        """Why Hyperscan rejects ``pattern`` even as a prefilter (None when usable)."""
        require_hyperscan()
        try:
            _compile([pattern], [MultiMatcher._flags(pattern, prefilter=True)], compile_cache())
        except hyperscan.error as exc:
            return str(exc)
        return None

    def _scratch(self):
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = hyperscan.Scratch(self._db)
            self._local.scratch = scratch
        return scratch

    def triggered(self, data: bytes) -> list[int]:
        """Ids of the patterns that may match ``data`` (one Hyperscan pass over all of them)."""
        return sorted(self._ends(data))

    def ends(self, data: bytes, limit: int) -> dict[int, list[int]] | None:
        """`_ends`, or None once more than `limit` ends were reported (the caller then reads the
        whole text: a callback a report would cost more than the windows save)."""
        try:
            return self._ends(data, limit)
        except hyperscan.ScanTerminated:
            return None

    def _ends(self, data: bytes, limit: int = 0) -> dict[int, list[int]]:
        """Pattern id -> Hyperscan match end offsets (every end for windowed patterns, else one);
        `limit` > 0 stops the scan (ScanTerminated) past that many reports."""
        if self._db is None:  # no patterns
            return {}
        hits: dict[int, list[int]] = {}
        n, seen = len(data), [0]

        def on_match(ident: int, _start: int, end: int, *_: object) -> bool:
            hits.setdefault(ident, []).append(min(end, n))
            seen[0] += 1
            return 0 < limit < seen[0]

        self._db.scan(data + PAD, match_event_handler=on_match, scratch=self._scratch())
        return hits

    def scan(self, data: bytes, text: str | None = None) -> list[tuple[int, re.Match]]:
        """(pattern id, exact ``re`` match with groups) for every pattern Hyperscan flagged.

        Matches of UTF-8 patterns run over ``text`` and carry character offsets. A windowed
        pattern (bounded match length, e.g. ``key = value`` rules that flag most source files)
        is confirmed only in the ``window`` bytes before each Hyperscan match end, so its ``re``
        work is proportional to its matches, not to the document."""
        out: list[tuple[int, re.Match[bytes]]] = []
        for ident, ends in sorted(self._ends(data).items()):
            p, rx = self.patterns[ident], self._python[ident]
            target = text if p.utf8 and text is not None else data
            if not p.window or not ends or target is not data:
                out.extend((ident, m) for m in rx.finditer(target))
                continue
            seen: set[tuple[int, int]] = set()
            for lo, hi in merge_spans((max(0, e - p.window), e) for e in ends):
                for m in rx.finditer(data, lo, hi):
                    if m.span() not in seen:
                        seen.add(m.span())
                        out.append((ident, m))
        return out


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching [lo, hi) spans merged, in order (the windows a confirmation reads)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


class SpanMatcher:
    """Match positions with a hard bound on work: one Hyperscan database per pattern, scanned only
    for patterns a screen flagged, stopped after ``limit`` reports.

    Hyperscan runs in time linear in the data whatever the pattern, so a crafted input costs at
    most ``len(data)`` automaton steps plus ``limit`` Python callbacks per flagged pattern; no
    backtracking engine runs over the data. Patterns compile in start-of-match mode where
    Hyperscan can (``has_start``): reports are then exact (start, end) spans; otherwise reports
    carry the end only and the caller confirms in a bounded window before it.
    """

    def __init__(self, patterns: list[Pattern], *, limit: int = 64, cache: CompileCache | None = None) -> None:
        self.limit = limit
        self._dbs = {}
        self.has_start: dict[int, bool] = {}
        require_hyperscan()
        for p in patterns:
            base = MultiMatcher._flags(p) & ~hyperscan.HS_FLAG_SINGLEMATCH
            for flags, som in ((base | hyperscan.HS_FLAG_SOM_LEFTMOST, True), (base, False)):
                try:
                    self._dbs[p.ident] = _compile([p], [flags], cache or compile_cache())
                except hyperscan.error:
                    continue
                self.has_start[p.ident] = som
                break
        self._python = {p.ident: compile_python(p) for p in patterns}
        self._local = threading.local()

    def _scratch(self, ident: int):
        scratches = self._local.__dict__.setdefault("scratch", {})
        if ident not in scratches:
            scratches[ident] = hyperscan.Scratch(self._dbs[ident])
        return scratches[ident]

    def reports(self, ident: int, data: bytes) -> list[tuple[int, int]]:
        """The first ``limit`` (start, end) reports of pattern ``ident`` in end order; start is -1
        when the pattern has no start-of-match mode."""
        if ident not in self._dbs:  # no Hyperscan: ``re`` (not time-bounded; see gate/README.md)
            return self._python_spans(ident, data)
        hits: list[tuple[int, int]] = []
        n = len(data)

        def on_match(_id: int, start: int, end: int, _flags: int, _ctx: object) -> bool:
            hits.append((min(start, n) if self.has_start[ident] else -1, min(end, n)))
            return len(hits) >= self.limit

        try:
            self._dbs[ident].scan(data + PAD, match_event_handler=on_match, scratch=self._scratch(ident))
        except hyperscan.ScanTerminated:
            pass
        return hits

    def spans(self, ident: int, data: bytes) -> list[tuple[int, int]]:
        """Non-overlapping (start, end) spans of a start-of-match pattern (longest per start, merged)."""
        return _merge_spans(self.reports(ident, data))

    def _python_spans(self, ident: int, data: bytes) -> list[tuple[int, int]]:
        rx = self._python[ident]
        if isinstance(rx.pattern, bytes):
            return [m.span() for _, m in zip(range(self.limit), rx.finditer(data))]
        text = data.decode("utf-8", "replace")
        nbytes = lambda i: len(text[:i].encode("utf-8"))  # noqa: E731 - at most `limit` calls
        return [(nbytes(m.start()), nbytes(m.end())) for _, m in zip(range(self.limit), rx.finditer(text))]


def _merge_spans(hits: list[tuple[int, int]]) -> list[tuple[int, int]]:
    longest: dict[int, int] = {}
    for start, end in hits:
        longest[start] = max(end, longest.get(start, end))
    out: list[tuple[int, int]] = []
    for start in sorted(longest):
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], longest[start]))
        else:
            out.append((start, longest[start]))
    return out
