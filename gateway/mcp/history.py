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
at most `JOIN_WINDOW` bytes a stream, and at most `MAX_STREAMS` streams are kept (the least
recently used dropped). Cost: at most two scans of `JOIN_WINDOW + HEAD` bytes a document.
What is not joined: text more than `JOIN_WINDOW` bytes before the seam or `HEAD` bytes after it
(a long PEM key cut in its middle is found only where a part holds a whole match), and text the
proxy did not let through (a refused call's arguments, a quarantined result: a stub stood there),
and text shown before the proxy last started (the tails are kept in memory only).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from gate import Finding, Gate, GateReport
from gate.joined import JOIN_WINDOW, scan_joined

HEAD = 2048  # bytes of a new document joined to the tail
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
    start = max(0, len(text) - JOIN_WINDOW)
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
    may be the cut's, not the text's."""
    head = _cut(reading.text, HEAD)
    if not tail or not head:
        return []
    cut_short = len(head) < len(reading.text)
    joined = scan_joined(gate, [tail, head], own=[own, own if not reading.whole else gate.scan(head)])[1]
    known = set(own.findings)
    return [reading.place(f) for f in joined.findings
            if f not in known and f.layer != "learned" and not (cut_short and f.byte_end >= len(head))]


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
        tail is now the last `JOIN_WINDOW` bytes of everything so shown."""
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

