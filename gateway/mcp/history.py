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
zero-width or combining characters does not push a piece out), glued and spaced (`History.tails`),
and at most `MAX_STREAMS` streams are kept (the least recently used dropped). Cost: two scans
of at most `TAIL + HEAD` visible characters per tail and reading (a result: one reading, one or
two tails; arguments: the strings joined and each of the first 8 alone, against the calls' and
the results' tails), each bounded by `CAP`: linear, but a scan's fixed cost (~0.3 ms) makes
this the larger part of the gate's time for small calls. A split phrase or key sits within a
few dozen characters of the seam. What is not joined: text more than `TAIL` visible characters
before the seam or `HEAD` after it (a long PEM key cut in its middle is found only where a
part holds a whole match); text the proxy did not let through (a refused call's arguments, a
quarantined result: a stub stood there); and text shown before the proxy last started (the tails
are kept in memory only).
"""
from __future__ import annotations

import threading
import unicodedata
from collections import OrderedDict
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
_SPACE = b" \t\r\n"
_SPACES = frozenset(bytes([c]) for c in _SPACE)
_MARK = ("Mn", "Me")  # combining marks

Stream = tuple[str, str, str | None]  # tenant, actor, chat or MCP session (None: the caller's only stream)


@dataclass(frozen=True)
class Reading:
    """The text of a document that is joined to the tail, and how a finding on it maps back to the
    document: `text` is the document's own first bytes (`whole=False`: offsets carry over), or its
    raw strings joined (`whole=True`: a finding covers the document whole; more is cut, never less)."""

    text: bytes
    size: int  # the document's length
    whole: bool

    def place(self, f: Finding) -> Finding:
        return replace(f, byte_start=0, byte_end=self.size) if self.whole else f


def _invisible(ch: str) -> bool:
    """A character a reader does not see: whitespace, format characters (zero-width ones, bidi
    controls), combining marks. Padding made of them would push a phrase out of a window counted in
    bytes (a red team's 200 zero-width spaces at the seam), so windows count what is left."""
    return ch.isspace() or _format(ch) or unicodedata.category(ch) in _MARK


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


def _cut(text: bytes, limit: int) -> bytes:
    """The bytes of `text` that hold its first `limit` visible characters (at most `CAP` bytes),
    ended at its last whitespace there when it has one (a token cut in its middle could read as
    a shorter one), else at a UTF-8 character start."""
    end = _visible_bytes(text[:CAP + 4].decode("utf-8", "ignore"), limit)
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
    start = len(text) - _visible_bytes(reversed(piece.decode("utf-8", "ignore")), TAIL)
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
    pgpass line 146 bytes in, the one changed verdict of 4,839 benign pairs)."""
    head = _cut(reading.text, HEAD)
    lead = _lead_format(head)  # zero-width padding at the seam: read past it
    head = head[lead:]
    tail = _seam_end(tail, glue=head[:1] not in _SPACES)
    if not tail or not head:
        return []
    cut_short = lead + len(head) < len(reading.text)
    mine = _secrets(gate, head) if reading.whole else _shifted(own, -lead)
    joined = scan_joined(gate, [tail, head], window=TAIL, own=[mine, mine])[1]
    known = {(f.rule_id, f.byte_start, f.byte_end) for f in mine.findings}
    return [reading.place(_shifted_finding(f, lead)) for f in joined.findings
            if (f.rule_id, f.byte_start, f.byte_end) not in known and f.layer != "learned" and f.byte_start <= NEAR
            and not (cut_short and f.byte_end >= len(head))]


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
        self._tails: OrderedDict[Stream, dict[str, tuple[bytes, bytes]]] = OrderedDict()  # least recently shown first
        self._lock = threading.Lock()
        self.max_streams = max_streams

    def tails(self, stream: Stream, phase: str) -> list[bytes]:
        """The phase's tail as shown, and (where two pieces met with no whitespace between them)
        with a space at each such meeting: "Now ignore" | "all previous" | "instructions ..." reads
        as a phrase only spaced, a key cut in three only glued (red team 17)."""
        with self._lock:
            glued, spaced = self._tails.get(stream, {}).get(phase, (b"", b""))
        return [glued] if glued == spaced else [glued, spaced]

    def joins(self, stream: Stream, phase: str) -> bool:
        """Whether anything shown before would be joined to the stream's next text of this phase
        (else its readings are not built: a result's text is not copied for nothing)."""
        with self._lock:
            tails = self._tails.get(stream, {})
        return any(tails.get(p, (b"",))[0] for p in (phase, "result"))

    def shown(self, stream: Stream, phase: str, text: bytes) -> None:
        """`text` went through to the agent (a result) or the upstream (arguments): the stream's
        tail is now the last `TAIL` visible characters of everything so shown."""
        if not text:
            return
        with self._lock:
            tails = self._tails.pop(stream, {})
            glued, spaced = tails.get(phase, (b"", b""))
            joint = b" " if spaced and spaced[-1:] not in _SPACES and text[:1] not in _SPACES else b""
            end = text[-(CAP + 4):]  # all a tail can hold of it: a long result is not copied whole
            tails[phase] = (_tail(glued + end), _tail(spaced + joint + end))
            self._tails[stream] = tails
            while len(self._tails) > self.max_streams:
                self._tails.popitem(last=False)

    def findings(self, gate: Gate, stream: Stream, phase: str, reading: Reading,
                 own: GateReport) -> list[Finding]:
        """What `reading` shows only joined to the stream's tail (`across`). A call's arguments are
        joined to its earlier calls' and to the results it was shown: a key whose first half an
        upstream showed leaves through the next call (red team 17)."""
        tails = self.tails(stream, phase) + (self.tails(stream, "result") if phase == "arguments" else [])
        found = [f for tail in dict.fromkeys(t for t in tails if t) for f in across(gate, tail, reading, own)]
        return list(dict.fromkeys(found))

