"""One multi-pattern matcher for every regex layer: Hyperscan when importable, ``re`` otherwise.

Hyperscan scans all patterns in a single pass over the bytes, which is what lets the rules
layer keep up with tool results at >100 MB/s. It needs a scratch space per thread, so the
scratch lives in a ``threading.local``. Hyperscan is used as the single-pass screen (which
patterns occur at all); the few patterns it flags are then run with ``re`` for exact spans
and capture groups, which is cheap because real matches are rare in tool results.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

try:  # pragma: no cover - exercised on machines without the wheel
    import hyperscan

    HAVE_HYPERSCAN = True
except ImportError:  # pragma: no cover
    hyperscan = None
    HAVE_HYPERSCAN = False


@dataclass(frozen=True)
class Pattern:
    """A regex over bytes; ``utf8`` patterns may use non-ASCII literals and classes."""

    ident: int
    regex: str
    caseless: bool = False
    utf8: bool = False


def compile_python(pattern: Pattern) -> re.Pattern:
    """The ``re`` twin of a pattern: over ``str`` for UTF-8 patterns (Unicode case folding),
    over ``bytes`` otherwise (offsets are then byte offsets directly)."""
    flags = re.IGNORECASE if pattern.caseless else 0
    if pattern.utf8:
        return re.compile(pattern.regex, flags)
    return re.compile(pattern.regex.encode("utf-8"), flags)


class MultiMatcher:
    """Compile once, scan many times from any thread."""

    def __init__(self, patterns: list[Pattern], *, use_hyperscan: bool = True) -> None:
        self.patterns = {p.ident: p for p in patterns}
        self._python = {p.ident: compile_python(p) for p in patterns}
        self._local = threading.local()
        self._db = None
        if use_hyperscan and HAVE_HYPERSCAN and patterns:
            self._db = self._compile_hyperscan(patterns)

    @staticmethod
    def _flags(p: Pattern, prefilter: bool = False) -> int:
        flags = hyperscan.HS_FLAG_SINGLEMATCH | hyperscan.HS_FLAG_DOTALL
        if p.caseless:
            flags |= hyperscan.HS_FLAG_CASELESS
        if p.utf8:
            flags |= hyperscan.HS_FLAG_UTF8  # no UCP: it rejects \b; callers screen case-folded text
        if prefilter:
            flags |= hyperscan.HS_FLAG_PREFILTER
        return flags

    @staticmethod
    def _try_compile(patterns: list[Pattern], flags: list[int]):
        db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        db.compile(expressions=[p.regex.encode("utf-8") for p in patterns], ids=[p.ident for p in patterns],
                   elements=len(patterns), flags=flags)
        return db

    def _compile_hyperscan(self, patterns: list[Pattern]):
        """Exact mode where Hyperscan can; prefilter mode (a superset, confirmed by ``re``) where a
        pattern is too large for it, e.g. long bounded repeats."""
        try:
            return self._try_compile(patterns, [self._flags(p) for p in patterns])
        except hyperscan.error:
            pass
        flags = []
        for p in patterns:
            try:
                self._try_compile([p], [self._flags(p)])
                flags.append(self._flags(p))
            except hyperscan.error:
                flags.append(self._flags(p, prefilter=True))
        return self._try_compile(patterns, flags)

    @staticmethod
    def hyperscan_error(pattern: Pattern) -> str | None:
        """Why Hyperscan rejects ``pattern`` even as a prefilter (None when usable)."""
        if not HAVE_HYPERSCAN:
            return None
        try:
            MultiMatcher._try_compile([pattern], [MultiMatcher._flags(pattern, prefilter=True)])
        except hyperscan.error as exc:
            return str(exc)
        return None

    def _scratch(self):
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = hyperscan.Scratch(self._db)
            self._local.scratch = scratch
        return scratch

    def triggered(self, data: bytes, text: str | None = None) -> list[int]:
        """Ids of the patterns that may match ``data`` (one Hyperscan pass over all of them).

        ``text`` is ``data`` decoded; the ``re`` fallback needs it for UTF-8 patterns."""
        if self._db is None:
            return [i for i, rx in self._python.items()
                    if rx.search(text if self.patterns[i].utf8 and text is not None else data)]
        hits: list[int] = []
        self._db.scan(data, match_event_handler=lambda ident, *_: hits.append(ident), scratch=self._scratch())
        return sorted(set(hits))

    def scan(self, data: bytes, text: str | None = None) -> list[tuple[int, re.Match]]:
        """(pattern id, exact ``re`` match with groups) for every pattern Hyperscan flagged.

        Matches of UTF-8 patterns run over ``text`` and carry character offsets."""
        out = []
        for ident in self.triggered(data, text):
            target = text if self.patterns[ident].utf8 and text is not None else data
            out.extend((ident, m) for m in self._python[ident].finditer(target))
        return out
