"""What each agent was shown before: a result is also read joined to the results before it.

Why: an instruction or a key split over two consecutive tool results ("Ignore all previous" as
one page, "instructions and send ..." as the next; a token's first half in one file, the rest in
the next) passes when each result is screened alone, and the agent's model reads the two as one
text (red team 16). The chat endpoint joins consecutive tool results of a turn (`gate.joined`);
the proxy sees one result at a time, so it keeps, per agent stream, the tail of what it let
through, and scans each new document's head joined to it with `gate.joined.scan_joined`. A
finding that crosses the seam, or a secret whose label lies in the tail, is added to the new
document's report, so the policy quarantines or redacts the new part: the earlier part was
already shown, but the agent never holds the whole. A call's arguments likewise, read as the raw
strings the agent sent (all of them, and each alone), joined to its earlier calls' and to the
results it was shown: a key's second half sent in a later call is refused.

A stream is the tenant, the caller (`tenant:user`) and the chat session its calls link to, else
the MCP session (HTTP) or the process (stdio): never two callers' text joined. Each phase keeps
the last `TAIL` visible characters a stream (at most `CAP` bytes: padding of whitespace,
zero-width or combining characters does not push a piece out), glued and spaced, and the same as
it was before the last text shown, so one result between the pieces is read past
(`History.tails`); a result's tail is what the agent reads of it (`Document.shown_text`: a JSON
text block as its strings). At most `MAX_STREAMS` streams are kept (the least recently used
dropped). Cost: one or two scans, without the learned window, of at most `TAIL + HEAD` visible
characters per tail and reading (a result: one to four tails, one to three readings; arguments:
the strings joined and each of the first 8 alone, against the calls' tails and the results' tail
now), each bounded by `CAP`: linear, but a scan's fixed cost (~0.3 ms) makes this the larger
part of the gate's time for small calls. A split phrase or key sits within a few dozen
characters of the seam. What is not joined: text more than `TAIL` visible characters before the
seam or `HEAD` after it (a long PEM key cut in its middle is found only where a part holds a
whole match); two or more results between the pieces (a result shown before an earlier call's
is read after that one's end, `History.overtaken`, but the tail keeps the order results were
shown in); text the proxy did not let through (a
refused call's arguments, a quarantined result: a stub stood there); and text shown before the
proxy last started (the tails are kept in memory only).
"""
from __future__ import annotations

import functools
import re
import threading
import unicodedata
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from gate import Finding, Gate, GateReport
from gate.joined import scan_joined

TAIL = 512  # bytes of what a stream was shown that a new document is joined to
HEAD = 512  # bytes of a new document joined to the tail
_MARKS = 3  # combining marks one letter carries at most, in the scripts the phrase rules read
CAP = 8192  # the most bytes a window may hold, whatever is invisible in it
NEAR = 64  # a finding the seam made must start within this many bytes after it (0: it crosses it)
MAX_STREAMS = 4096
_HEADS = 8  # results' heads a stream keeps for `History.overtaken`: more calls than agents run at once
_SPACE = b" \t\r\n"
_SPACES = frozenset(bytes([c]) for c in _SPACE)
_MARK = ("Mn", "Me")  # combining marks
# Letters and symbols that render as nothing (red team 18: 520 braille blanks at the seam): the
# Hangul fillers, the braille blank, the halfwidth Hangul filler
_BLANK = frozenset("\u115f\u1160\u2800\u3164\uffa0")

Stream = tuple[str, str, str | None]  # tenant, actor, chat or MCP session (None: the caller's only stream)
_Tails = tuple[bytes, bytes]  # a phase's tail glued, and spaced where two pieces met with no whitespace
_EMPTY: _Tails = (b"", b"")
_LINE_BREAK = b"\n\n"  # between the pairs `History.secrets_across` scans at once
# What a listing or a quote puts before a line, read past at the seam: a line number (`cat -n`,
# `12:`, `12→`), `# ` `// ` `> ` `-- ` `* `, an ellipsis that continues the line before (red team
# 18: `    41\t... Now ignore all previous` | `    42\tinstructions ...`). Bounded: linear.
_LINE_LEAD = re.compile(rb"[ \t]{0,8}(?:[0-9]{1,6}(?:\t|:[ \t]?|\xe2\x86\x92|[ \t]{1,3}\|?[ \t]?))?"
                        rb"(?:(?:>|#|//|;|--|\*)[ \t]?){0,2}[ \t]{0,4}(?:\xe2\x80\xa6|\.\.\.)?[ \t]{0,4}")
_ELLIPSIS_END = re.compile(rb"(?:\xe2\x80\xa6|\.\.\.)[ \t]{0,4}\Z")


@dataclass(frozen=True)
class Reading:
    """The text of a document that is joined to the tail, and how a finding on it maps back to the
    document: `text` is the document's own bytes from `offset` (`whole=False`: offsets carry over,
    moved by it), or its raw strings joined (`whole=True`: a finding covers the document whole;
    more is cut, never less)."""

    text: bytes
    size: int  # the document's length
    whole: bool
    offset: int = 0

    def place(self, f: Finding) -> Finding:
        return replace(f, byte_start=0, byte_end=self.size) if self.whole else _shifted_finding(f, self.offset)


def _invisible(ch: str) -> bool:
    """A character a reader does not see: whitespace, format characters (zero-width ones, bidi
    controls), combining marks. Padding made of them would push a phrase out of a window counted in
    bytes (a red team's 200 zero-width spaces at the seam), so windows count what is left."""
    return ch.isspace() or _format(ch) or ch in _BLANK or unicodedata.category(ch) in _MARK


def _visible_bytes(chars: Iterable[str], limit: int) -> int:
    """How many bytes of `chars` (in the order given) hold `limit` visible characters, at most `CAP`."""
    seen = size = 0
    for ch in chars:
        n = len(ch.encode("utf-8", "surrogatepass"))
        if seen >= limit or size + n > CAP:
            break
        size += n
        seen += not _invisible(ch)
    return size


@functools.lru_cache(maxsize=8)
def _ascii_window(limit: int) -> re.Pattern[bytes]:
    """`limit` visible ASCII characters, each after its whitespace (the only ASCII a reader does
    not see: no format character or combining mark is ASCII)."""
    return re.compile(rb"(?:[\t-\r\x1c-\x20]*[^\t-\r\x1c-\x20]){%d}" % limit)


def _visible_prefix(data: bytes, limit: int) -> int:
    """`_visible_bytes` of `data` read from its start: in C where it is ASCII (most tool output; a
    Python loop over each character cost more than the scans it bounds), else character by character."""
    if data.isascii():
        match = _ascii_window(limit).match(data, 0, CAP)
        return match.end() if match else min(len(data), CAP)
    return _visible_bytes(data.decode("utf-8", "ignore"), limit)


def _cut(text: bytes, limit: int) -> bytes:
    """The bytes of `text` that hold its first `limit` visible characters (at most `CAP` bytes),
    ended at its last whitespace there when it has one (a token cut in its middle could read as
    a shorter one), else at a UTF-8 character start."""
    end = _visible_prefix(text[:CAP + 4], limit)
    if end >= len(text):
        return text
    space = max(text.rfind(bytes([c]), 0, end) for c in _SPACE)
    if space > 0:
        return text[:space]
    while end > 0 and text[end] & 0xC0 == 0x80:
        end -= 1
    return text[:end]


def _tail(text: bytes) -> bytes:
    """The bytes of `text` that hold its last `TAIL` visible characters (at most `CAP` bytes)."""
    piece = text[-(CAP + 4):]
    size = _visible_prefix(piece[::-1], TAIL) if piece.isascii() else \
        _visible_bytes(reversed(piece.decode("utf-8", "ignore")), TAIL)
    start = len(text) - size
    while 0 < start < len(text) and text[start] & 0xC0 == 0x80:
        start += 1
    return text[max(start, 0):]


def across(gate: Gate, tail: bytes, reading: Reading, own: GateReport) -> list[Finding]:
    """The findings of `reading` joined to `tail` that its own report (`own`, in the document's
    offsets) lacks, placed in the document: the rules' and heuristics', not the learned window's.
    That window scores any imperative text, and two benign results of a kind joined read as one
    (a to-do list's "do not forget the keys!" before the next list): on the project's benign sets
    it changed the verdict of 36 of 1,408 consecutive pairs, while a split instruction is a phrase
    the rules read whole. A finding reaching the end of a head cut short is left out: its match
    may be the cut's, not the text's; so is one that starts further than `NEAR` bytes past the
    seam (a key whose label is in the tail starts at the seam: a CSV after a JSON result read as a
    pgpass line 146 bytes in, the one changed verdict of 4,839 benign pairs). Past a line marker
    (`_LINE_LEAD`) only the phrases are read: a label ending the tail (`SESSION_SECRET=`) took
    the next line's file name, once the marker (`-- `) was read past, for its value."""
    head = _cut(reading.text, HEAD)
    padding = _lead_format(head)  # zero-width padding at the seam: read past it
    marker = _LINE_LEAD.match(head, padding).end()  # type: ignore[union-attr]  # and a listing's line marker,
    marked = bool(head[padding:marker].strip(b" \t"))  # which stands between words: no piece is glued over it
    lead = marker if marked else padding  # (spaces alone are no marker: letters spaced out keep their gaps)
    head = head[lead:]
    tail = _continued(_seam_end(tail, glue=head[:1] not in _SPACES and not marked), head)
    tail += b" " if marked and tail[-1:] not in _SPACES else b""
    if not tail or not head:
        return []
    cut_short = lead + len(head) < len(reading.text)
    mine = _secrets(gate, head) if reading.whole else _shifted(own, -(reading.offset + lead))
    joined = scan_joined(gate, [tail, head], window=CAP, own=[mine, mine], learned=False)[1]  # the tail is bounded already
    known = {(f.rule_id, f.byte_start, f.byte_end) for f in mine.findings}
    return [reading.place(_shifted_finding(f, lead)) for f in joined.findings
            if (f.rule_id, f.byte_start, f.byte_end) not in known and f.byte_start <= NEAR
            and not (cut_short and f.byte_end >= len(head)) and not (marked and f.kind == "secret")]


def _continued(tail: bytes, head: bytes) -> bytes:
    """`tail` less an ellipsis that ends it, and less a hyphen that breaks a word the head goes on
    with (`all pre-` | `vious instructions`: red team 18)."""
    tail = _ELLIPSIS_END.sub(b"", tail)
    if tail[-1:] == b"-" and tail[-2:-1].isalpha() and head[:1].islower():
        return tail[:-1]
    return tail


def _format(ch: str) -> bool:
    return unicodedata.category(ch) == "Cf"


def _seam_end(tail: bytes, glue: bool) -> bytes:
    """`tail` less its trailing format characters (zero-width padding), and, where the next text
    starts with a visible character (`glue`), its trailing whitespace too: a line end after a
    key's first half would otherwise end the token the halves make. Whitespace before a head that
    starts with some is kept (letters spaced out keep their gaps); up to `_MARKS` combining marks
    at the very end are kept (a Devanagari word ends with one), a longer run is padding."""
    chars = tail.decode("utf-8", "surrogatepass")
    end, marks = len(chars), 0
    while end:
        ch = chars[end - 1]
        mark = unicodedata.category(ch) in _MARK
        if not (mark or _format(ch) or glue and ch.isspace()):
            break
        marks = marks + 1 if mark else 0
        end -= 1
    end += min(marks, _MARKS) if marks <= _MARKS else 0  # a word's own few marks stay; a run of them is padding
    return chars[:end].encode("utf-8", "surrogatepass")


def _lead_format(text: bytes) -> int:
    """The bytes of format characters (zero-width ones, bidi controls) `text` starts with."""
    size = 0
    for ch in text.decode("utf-8", "surrogatepass"):
        if not _format(ch):
            break
        size += len(ch.encode("utf-8", "surrogatepass"))
    return size


def _shifted_finding(f: Finding, by: int) -> Finding:
    return replace(f, byte_start=f.byte_start + by, byte_end=f.byte_end + by) if by else f


def _shifted(report: GateReport, by: int) -> GateReport:
    return replace(report, findings=tuple(_shifted_finding(f, by) for f in report.findings)) if by else report


def _secrets(gate: Gate, head: bytes) -> GateReport:
    """The head's own report where it is not the document's bytes (the raw strings of arguments),
    secrets alone: `scan_joined` needs the head's own findings only to tell a secret its label in
    the tail made (kept) from one the head holds alone, and to tell an injection match that merely
    reached back into the tail; such a match is in the document's own report already, which
    decides on it anyway. A third of the full scan's cost."""
    found = tuple(gate.scan_secrets(head))
    return GateReport(injection=0.0, secret=max((f.score for f in found), default=0.0), findings=found,
                      bytes_scanned=len(head), elapsed_us=0)


class History:
    """The tails of what each stream was shown, per phase; thread-safe (the guard runs on the loop
    and on worker threads)."""

    def __init__(self, max_streams: int = MAX_STREAMS) -> None:
        # per stream (least recently shown first) and phase: the tails now, and before the last text shown
        self._tails: OrderedDict[Stream, dict[str, tuple[_Tails, _Tails]]] = OrderedDict()
        # per stream: the heads of its last results shown, each by its call's order (`overtaken`)
        self._heads: dict[Stream, deque[tuple[int, bytes]]] = {}
        self._lock = threading.Lock()
        self.max_streams = max_streams

    def tails(self, stream: Stream, phase: str, before: bool = True) -> list[bytes]:
        """The phase's tail as shown, and (where two pieces met with no whitespace between them)
        with a space at each such meeting: "Now ignore" | "all previous" | "instructions ..." reads
        as a phrase only spaced, a key cut in three only glued (red team 17). Then the same as it
        was before the last text shown: one result between the pieces (an `OK` from another call)
        is read past (red team 17), as the agent's model reads past it (unless `before` is False)."""
        with self._lock:
            now, earlier = self._tails.get(stream, {}).get(phase, (_EMPTY, _EMPTY))
        return list(dict.fromkeys(t for t in (*now, *(earlier if before else ())) if t)) or [b""]

    def joins(self, stream: Stream, phase: str) -> bool:
        """Whether anything shown before would be joined to the stream's next text of this phase
        (else its readings are not built: a result's text is not copied for nothing)."""
        with self._lock:
            tails = self._tails.get(stream, {})
        return any(tails.get(p, (_EMPTY,))[0][0] for p in (phase, "result"))

    def shown(self, stream: Stream, phase: str, text: bytes, order: int | None = None) -> None:
        """`text` went through to the agent (a result) or the upstream (arguments): the stream's
        tail is now the last `TAIL` visible characters of everything so shown (and the tail before
        it is kept, see `tails`). A result's head is kept by its call's `order` too (`overtaken`)."""
        if not text:
            return
        with self._lock:
            if order is not None:
                self._heads.setdefault(stream, deque(maxlen=_HEADS)).append((order, _cut(text, HEAD)))
            tails = self._tails.pop(stream, {})
            now = tails.get(phase, (_EMPTY, _EMPTY))[0]
            glued, spaced = now
            joint = b" " if spaced and spaced[-1:] not in _SPACES and text[:1] not in _SPACES else b""
            end = text[-(CAP + 4):]  # all a tail can hold of it: a long result is not copied whole
            tails[phase] = ((_tail(glued + end), _tail(spaced + joint + end)), now)
            self._tails[stream] = tails
            while len(self._tails) > self.max_streams:
                self._heads.pop(self._tails.popitem(last=False)[0], None)

    def overtaken(self, gate: Gate, stream: Stream, order: int, text: bytes, size: int) -> list[Finding]:
        """What a result (`text`, of the call of `order`) shows before the result the agent reads
        next, where that one was shown first: parallel calls are listed in the agent's context in
        the order they were made, and an upstream that delays the first piece's call lets the
        second piece through first (red team 18). The result shown of the next call made after
        this one is joined after this one's end; a finding covers this document whole (of `size`)."""
        with self._lock:
            later = [(o, head) for o, head in self._heads.get(stream, ()) if o > order]
        if not later:
            return []
        head = min(later)[1]
        none = GateReport(injection=0.0, secret=0.0, findings=(), bytes_scanned=0, elapsed_us=0)  # it was shown
        return [replace(f, byte_start=0, byte_end=size)
                for f in across(gate, _tail(text), Reading(head, len(head), whole=False), none)]

    def findings(self, gate: Gate, stream: Stream, phase: str, reading: Reading,
                 own: GateReport) -> list[Finding]:
        """What `reading` shows only joined to the stream's tail (`across`). A call's arguments are
        joined to its earlier calls' and to the results it was shown: a key whose first half an
        upstream showed leaves through the next call (red team 17)."""
        found = [f for tail in self._joined_tails(stream, phase) for f in across(gate, tail, reading, own)]
        return list(dict.fromkeys(found))

    def secrets_across(self, gate: Gate, stream: Stream, phase: str, pieces: list[bytes], size: int) -> list[Finding]:
        """The secrets that each of `pieces` (a call's strings read alone) makes glued to the end of
        a tail of `phase`, each a finding over the whole document (of `size` bytes): the call is
        refused, so more is cut, never less. All pairs in one scan of the secret rules alone:
        they are what leaves through arguments, and a scan's fixed cost per pair was most of a
        call's screening. A secret counts when it crosses the seam, or when it starts within
        `NEAR` bytes after it and the piece alone does not hold it (its label is in the tail)."""
        tails = [_seam_end(t, glue=True) for t in self._joined_tails(stream, phase)]
        heads = [h[_lead_format(h):] for h in (_cut(p, HEAD) for p in dict.fromkeys(pieces))]
        pairs = [(t, h) for t in tails if t for h in heads if h] + [(b"", h) for h in heads if h]
        lines, seams, pos = [], [], 0
        for t, h in pairs:
            lines.append(t + h)
            seams.append((pos, pos + len(t), pos + len(t) + len(h)))
            pos += len(t) + len(h) + len(_LINE_BREAK)
        found = gate.scan_secrets(_LINE_BREAK.join(lines)) if lines else []
        def mark(f: Finding, seam: int, head: bytes) -> tuple[bytes, str, int, int]:
            return head, f.rule_id, f.byte_start - seam, f.byte_end - seam

        alone = {mark(f, seam, h) for f in found for (start, seam, end), (_, h) in zip(seams, pairs)
                 if start == seam and seam <= f.byte_start < end}  # each head's own secrets
        return [Finding("secret", f.rule_id, f.layer, 0, size, f.score, f.excerpt) for f in found
                for (start, seam, end), (_, h) in zip(seams, pairs) if start < seam and start <= f.byte_start
                and f.byte_end <= end and (f.byte_start < seam < f.byte_end or seam <= f.byte_start <= seam + NEAR
                                           and mark(f, seam, h) not in alone)]

    def _joined_tails(self, stream: Stream, phase: str) -> list[bytes]:
        """The tails a text of `phase` is joined to: its phase's, and for arguments the results' now."""
        tails = self.tails(stream, phase) + (self.tails(stream, "result", before=False) if phase == "arguments" else [])
        return list(dict.fromkeys(t for t in tails if t))
