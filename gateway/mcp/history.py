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
strings the agent sent: a key's second half sent in a later call is refused.

A stream is the tenant, the caller (`tenant:user`) and the chat session its calls link to, else
the MCP session (HTTP) or the process (stdio): never two callers' text joined. Each phase keeps
at most `TAIL` bytes a stream, and at most `MAX_STREAMS` streams are kept (the least recently
used dropped). Cost: at most two scans of `TAIL + HEAD` bytes a document (three for arguments),
where a scan's fixed cost dominates (with the chat endpoint's 1 KB window and a 2 KB head, the
joined scans cost ~4 ms of CPU a call in `lethe bench mcp`'s in-process loop). A split phrase or
key sits within a few dozen bytes of the seam. What is not joined: text more than `TAIL` bytes
before the seam or `HEAD` bytes after it (a long PEM key cut in its middle is found only where a
part holds a whole match); text the proxy did not let through (a refused call's arguments, a
quarantined result: a stub stood there); and text shown before the proxy last started (the tails
are kept in memory only).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from gate import Finding, Gate, GateReport
from gate.joined import scan_joined

TAIL = 512  # bytes of what a stream was shown that a new document is joined to
HEAD = 512  # bytes of a new document joined to the tail
NEAR = 64  # a finding the seam made must start within this many bytes after it (0: it crosses it)
MAX_STREAMS = 4096
_SPACE = b" \t\r\n"

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


def _cut(text: bytes, limit: int) -> bytes:
    """The first `limit` bytes of `text`, ended at its last whitespace there when it has one (a
    token cut in its middle could read as a shorter one), else at a UTF-8 character start."""
    if len(text) <= limit:
        return text
    space = max(text.rfind(bytes([c]), 0, limit) for c in _SPACE)
    if space > 0:
        return text[:space]
    while limit > 0 and text[limit] & 0xC0 == 0x80:
        limit -= 1
    return text[:limit]


def _tail(text: bytes) -> bytes:
    start = max(0, len(text) - TAIL)
    while start < len(text) and text[start] & 0xC0 == 0x80:
        start += 1
    return text[start:]


def across(gate: Gate, tail: bytes, reading: Reading, own: GateReport) -> list[Finding]:
    """The findings of `reading` joined to `tail` that its own report (`own`, in the document's
    offsets) lacks, placed in the document: the rules' and heuristics', not the learned window's.
    That window scores any imperative text, and two benign results of a kind joined read as one
    (a to-do list's "do not forget the keys!" before the next list): on the project's benign sets
    it changed the verdict of 36 of 1,408 consecutive pairs, while a split instruction is a phrase
    the rules read whole. A finding reaching the end of a head cut short is left out: its match
    may be the cut's, not the text's; so is one that starts further than `NEAR` bytes past the seam
(a key whose label is in the tail starts at the seam: a CSV after a JSON result read as a
pgpass line 146 bytes in, the one changed verdict of 4,839 benign pairs)."""
    head = _cut(reading.text, HEAD)
    if not tail or not head:
        return []
    cut_short = len(head) < len(reading.text)
    joined = scan_joined(gate, [tail, head], window=TAIL, own=[own, own if not reading.whole else _secrets(gate, head)])[1]
    known = {(f.rule_id, f.byte_start, f.byte_end) for f in own.findings}
    return [reading.place(f) for f in joined.findings
            if (f.rule_id, f.byte_start, f.byte_end) not in known and f.layer != "learned" and f.byte_start <= NEAR
            and not (cut_short and f.byte_end >= len(head))]


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
        self._tails: OrderedDict[Stream, dict[str, bytes]] = OrderedDict()  # least recently shown first
        self._lock = threading.Lock()
        self.max_streams = max_streams

    def tail(self, stream: Stream, phase: str) -> bytes:
        with self._lock:
            return self._tails.get(stream, {}).get(phase, b"")

    def shown(self, stream: Stream, phase: str, text: bytes) -> None:
        """`text` went through to the agent (a result) or the upstream (arguments): the stream's
        tail is now the last `TAIL` bytes of everything so shown."""
        if not text:
            return
        with self._lock:
            tails = self._tails.pop(stream, {})
            tails[phase] = _tail(tails.get(phase, b"") + text)
            self._tails[stream] = tails
            while len(self._tails) > self.max_streams:
                self._tails.popitem(last=False)

    def findings(self, gate: Gate, stream: Stream, phase: str, reading: Reading,
                 own: GateReport) -> list[Finding]:
        """What `reading` shows only joined to the stream's tail (`across`)."""
        return across(gate, self.tail(stream, phase), reading, own)

