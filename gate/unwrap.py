"""Readings that undo the encodings a credential travels in, for the secret rules.

A key is rarely printed as its provider wrote it. A file read by a tool and returned as a JSON
string has every newline and quote escaped (`\\n`, `\\"`); JSON inside JSON escapes them twice
(`\\\\n`); a Kubernetes Secret, a Docker `auth` or a Basic header carries it base64-encoded,
sometimes twice (`.dockerconfigjson` holds an `auth` of its own). A blind test set written for
issue 15 lost a fifth of its credentials to such carriers: the rules anchor on newlines, quotes,
key names and prefixes that only the decoded text shows.

`readings(data)` gives the text with backslash escapes undone (up to `ESCAPE_LEVELS` levels),
with runs of percent-escapes decoded (a token in a query string or a form body), HTML character
references and hex runs decoded (a red team's arguments carried tokens so), with base64 runs decoded in place where they decode to text (up to `BASE64_LEVELS` levels, so
`password: c2VjcmV0...` reads `password: secret...` and the key name still gives the context),
and both; with base64 wrapped in lines read joined, gzip (every member) and zlib inside base64
or hex inflated (to one budget a document, `INFLATE_RATIO` times its size),
base32 runs decoded where they decode to text, and a token spelled out a character at a time
(`A K I A ...`) read joined. Each byte of a reading knows the raw span it came from, so a finding reports the raw
span (a whole base64 run when the secret was inside one: that run is what a redaction must cut).
Linear in the input: one regex pass and one decode per run per level, a fixed number of levels.
"""
from __future__ import annotations

import base64
import binascii
import functools
import html
import re
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

ESCAPE_LEVELS = 3
BASE64_LEVELS = 2  # base64 inside base64 (`.dockerconfigjson` -> `auth`), no deeper
MIN_BASE64 = 16  # the shortest run decoded: 12 bytes, room for `user:password` and most tokens
_ESCAPE = re.compile(rb'\\(?:u[0-9a-fA-F]{4}|[nrtbf"\'\\/])')
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"b": b"\b", b"f": b"\f", b'"': b'"', b"'": b"'", b"\\": b"\\",
           b"/": b"/"}
_PERCENT = re.compile(rb"(?:%[0-9A-Fa-f]{2})+")
_ENTITIES = re.compile(rb"(?:&(?:#[0-9]{1,7}|#[xX][0-9A-Fa-f]{1,6}|[A-Za-z]{2,8});)+")  # HTML/XML character references
_HEX = re.compile(rb"(?<![0-9A-Fa-f])(?:[0-9A-Fa-f]{2}){16,}(?![0-9A-Fa-f])")  # 16 bytes or more
_PLUS = re.compile(rb"[^\s&=?+]{1,64}(?:\+[^\s&=?+]{1,64}){2,}")  # three or more words joined by +
_BASE32 = re.compile(rb"(?<![A-Za-z0-9+/=])(?:[A-Z2-7]{8}){2,}(?:[A-Z2-7]{2,7}={0,6})?(?![A-Za-z0-9+/=])")  # RFC 4648 base32
# A token spelled out a character at a time, the same separator between every two (one or two
# spaces, a tab, a line break, a dot, dash or comma, a JSON or Python list's `", "`), or in groups of
# two or four (`AKIA PTGZ 6JFE ...`); a run may open after and close before a quote or bracket. Past
# the run's last character the separator itself closes it, so a failed close backtracks one step.
_OPEN, _CLOSE = rb"(?:(?<![!-~])|(?<=[\"'`(\[{<>=:]))", rb"(?:(?![!-~])|(?=[\"'`)\]}<>,;:.\-]))"
_SPACED = re.compile(_OPEN + rb"""[!-~](?P<sep> {1,2}|\t|\r?\n|[.,\-]|, |"[ \t]?,[ \t]?"|'[ \t]?,[ \t]?')"""
                     rb"(?:[!-~](?P=sep)){11,2048}[!-~]" + _CLOSE)
_GROUPED = re.compile(_OPEN + rb"(?:[A-Za-z0-9+/=_]{2}(?P<s2>[ \-])(?:[A-Za-z0-9+/=_]{2}(?P=s2)){5,1024}[A-Za-z0-9+/=_]{2}"
                      rb"(?:(?P=s2)(?P<t2>[A-Za-z0-9+/=_]))?"
                      rb"|[A-Za-z0-9+/=_]{4}(?P<s4>[ \-])(?:[A-Za-z0-9+/=_]{4}(?P=s4)){2,512}[A-Za-z0-9+/=_]{4}"
                      rb"(?:(?P=s4)(?P<t4>[A-Za-z0-9+/=_]{1,3}))?)(?![A-Za-z0-9+/=_])")
# gzip or zlib inside base64 or hex is inflated to a budget for the whole document, 4 x its size
# and at least 64 KB: a bomb stops there, and the readings stay linear
INFLATE_RATIO, MIN_INFLATE = 4, 1 << 16
_LINE_BREAKS = re.compile(rb"\s|\\n")  # what joins `_BASE64_LINES`'s lines
_BASE64_LINES = re.compile(rb"(?<![A-Za-z0-9+/=])(?:[A-Za-z0-9+/]{16,76}(?:\r?\n|\\n)[ \t]{0,8}){2,4096}[A-Za-z0-9+/]{0,76}={0,2}")
_FOLD = re.compile(rb"\r\n[ \t]")  # a folded line (RFC 5545 iCalendar, RFC 5322 headers): unfolded by deleting it
GUTTER_LINES = 3
_GUTTER = re.compile("(?m)^[ \t]{0,8}[0-9]{1,6}(?:\u2192|\t|[ \t]{1,3}\\|[ \t]?|:[ \t])".encode())
_RULE_LINE = re.compile(rb"(?m)^[ \t]{0,8}[|+]?[ \t]{0,3}:?-{3}[-+|: \t]{0,2000}\r?$")  # a table's rule: |---|---| or ----+----
# a column that names a secret's digest, part or metadata, not the secret (`sha256_of_token`, `key_last4`)
_NOT_SECRET = re.compile(rb"(?i)hash|sha[0-9]|digest|fingerprint|last_?[0-9]|prefix|suffix|hint|mask|_ids?$|name|type|ur[li]|count|len|expir|created|updated|_at$|ttl|scope|public")
_TOKEN_BYTES = {bytes([c]) for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_+/="}
_SECRET_NAME = re.compile(rb"(?i)passw|passphrase|pwd|secret|token|api[_\-.]?key|apikey|private[_\-.]?key|_key$|credential|_pat$")
_BASE64 = re.compile(rb"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{%d,}={0,2}" % MIN_BASE64)


@dataclass(frozen=True)
class Reading:
    """Bytes to scan; byte i came from the raw bytes [starts[i], ends[i])."""

    data: bytes
    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def identity(cls, data: bytes) -> "Reading":
        at = np.arange(len(data), dtype=np.int64)
        return cls(data, at, at + 1)

    def raw_span(self, start: int, end: int) -> tuple[int, int]:
        """The raw span of this reading's bytes [start, end) (end > start)."""
        return int(self.starts[start]), int(self.ends[end - 1])


Replace = Callable[[re.Match[bytes]], bytes | None]  # a match's replacement; None: keep it


def _rewrite(reading: Reading, pattern: re.Pattern[bytes], replace: Replace) -> Reading | None:
    """`reading` with each match of `pattern` replaced (each byte of a replacement comes from the
    whole match); None when nothing was replaced."""
    edits = ((m.start(), m.end(), replace(m)) for m in pattern.finditer(reading.data))
    return _edited(reading, ((s, e, out) for s, e, out in edits if out is not None))


def _edited(reading: Reading, edits: Iterable[tuple[int, int, bytes]]) -> Reading | None:
    """`reading` with each span [s, e) replaced by its bytes (in order, not overlapping; each byte
    of a replacement comes from the whole span); None when there was no edit. The byte map is
    built segment by segment with `np.repeat`, not an array a match: a JSON string of a thousand
    escapes costs a thousand list appends."""
    data = reading.data
    pieces: list[bytes] = []
    lens: list[int] = []  # each output segment: its length, the raw span its first and last bytes map to,
    first: list[int] = []  # and whether it is kept (byte i maps to first + i) or a replacement (all
    last: list[int] = []  # its bytes map to the edited span)
    kept: list[int] = []
    at, changed = 0, False
    for s, e, out in edits:
        pieces += [data[at:s], out]
        lens += [s - at, len(out)]
        first += [at, s]
        last += [at, e - 1]
        kept += [1, 0]
        at, changed = e, True
    if not changed:
        return None
    pieces.append(data[at:])
    lens.append(len(data) - at)
    first.append(at)
    last.append(at)
    kept.append(1)
    n = np.asarray(lens, dtype=np.int64)
    within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    step = within * np.repeat(np.asarray(kept, dtype=np.int64), n)
    a = np.repeat(np.asarray(first, dtype=np.int64), n) + step
    b = np.repeat(np.asarray(last, dtype=np.int64), n) + step
    return Reading(b"".join(pieces), reading.starts[a], reading.ends[b])


def _unescape(m: re.Match[bytes]) -> bytes | None:
    token = m.group()[1:]
    if token[:1] != b"u":
        return _SIMPLE[token]
    cp = int(token[1:], 16)
    return None if 0xD800 <= cp <= 0xDFFF else chr(cp).encode("utf-8")


def _unpercent(m: re.Match[bytes]) -> bytes | None:
    """A run of percent-escapes decoded, when it decodes to UTF-8 text."""
    raw = urllib.parse.unquote_to_bytes(m.group())
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return raw


def _unentity(m: re.Match[bytes]) -> bytes | None:
    out = html.unescape(m.group().decode("ascii")).encode("utf-8", "surrogatepass")
    return None if out == m.group() else out


class Inflater:
    """Inflates the gzip (every member) and zlib streams a document carries, to one budget."""

    def __init__(self, data: bytes) -> None:
        self.left = max(MIN_INFLATE, INFLATE_RATIO * len(data))

    def __call__(self, raw: bytes) -> bytes:
        """`raw` inflated when it is gzip or zlib (at most the budget left), else `raw` itself."""
        if raw[:2] == b"\x1f\x8b":
            wbits = 31
        elif len(raw) > 2 and raw[0] == 0x78 and (raw[0] << 8 | raw[1]) % 31 == 0:
            wbits = 15
        else:
            return raw
        out = []
        while raw and self.left > 0:
            inflate = zlib.decompressobj(wbits=wbits)
            try:
                got = inflate.decompress(raw, self.left)
            except zlib.error:
                break
            out.append(got)
            self.left -= len(got)
            raw = inflate.unused_data if inflate.eof and wbits == 31 else b""  # the next gzip member
        return b"".join(out)


def _unhex(inflate: Inflater, m: re.Match[bytes]) -> bytes | None:
    """A hex run decoded (and inflated), when it decodes to printable text (a digest or a key's own hex does not)."""
    raw = inflate(bytes.fromhex(m.group().decode("ascii")))
    return raw if _printable(raw) else None


def _printable(raw: bytes) -> bool:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(text) and sum(ch.isprintable() or ch in "\r\n\t" for ch in text) >= 0.95 * len(text)


def _decoded(inflate: Inflater, m: re.Match[bytes]) -> bytes | None:
    """The run base64-decoded (standard or URL-safe; lines `base64` wrapped joined) and inflated,
    when it decodes to printable text."""
    body = _LINE_BREAKS.sub(b"", m.group()).rstrip(b"=")
    if len(body) % 4 == 1:
        return None
    padded = body + b"=" * (-len(body) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded) if b"-" in body or b"_" in body else base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        return None
    raw = inflate(raw)  # gzip or zlib inside the base64 (`H4sI...`, `eJ...`): a token compressed past the rules
    return raw if _printable(raw) else None


def _unbase32(m: re.Match[bytes]) -> bytes | None:
    """A base32 run (TOTP seeds, some exports) decoded, when it decodes to printable text."""
    body = m.group().rstrip(b"=")
    if len(body) % 8 in (1, 3, 6):
        return None
    try:
        raw = base64.b32decode(body + b"=" * (-len(body) % 8))
    except (binascii.Error, ValueError):
        return None
    return raw if _printable(raw) else None


def _unspaced(m: re.Match[bytes]) -> bytes | None:
    """A spelled-out token joined: its separator taken out from between every two characters."""
    return m.group().replace(m.group("sep"), b"")


def _ungrouped(m: re.Match[bytes]) -> bytes | None:
    """A token in groups joined, when a digit shows it is no run of short words (`of to in at`).
    A shorter last group is the token's tail only when it holds a digit or a capital: `OXRL end`
    ends the token at `OXRL`, and the word stays a word."""
    sep, tail = (m.group("s2"), m.group("t2")) if m.group("s2") else (m.group("s4"), m.group("t4"))
    body = m.group()
    if tail is not None and tail.islower():
        body = body[:-len(tail) - len(sep)]
    joined = body.replace(sep, b"")
    return joined + m.group()[len(body):] if any(0x30 <= c <= 0x39 for c in joined) else None


def _levels(reading: Reading, pattern: re.Pattern[bytes], replace: Replace, levels: int,
            cue: bytes | None = None) -> list[Reading]:
    """Each of up to `levels` rewrites in a row (a rule may need an inner level: the base64 `auth`
    inside a decoded `.dockerconfigjson` is that rule's own input), until one changes nothing."""
    out: list[Reading] = []
    for _ in range(levels):
        if cue is not None and cue not in reading.data:
            break
        nxt = _rewrite(reading, pattern, replace)
        if nxt is None:
            break
        out.append(nxt)
        reading = nxt
    return out


def _gutterless(reading: Reading) -> list[Reading]:
    """A numbered listing (`cat -n`, an editor's `12→`, a code search's `12 | `) without its line
    numbers, when at least `GUTTER_LINES` lines carry one: a key block's lines are contiguous again."""
    if len(_GUTTER.findall(reading.data, 0, 1 << 16)) < GUTTER_LINES:
        return []
    out = _rewrite(reading, _GUTTER, lambda m: b"")
    return [out] if out is not None else []


def _cells(line: bytes, at: int) -> list[tuple[int, int]]:
    """The spans (in the document, `at` being the line's offset) of a table row's cells, spaces
    trimmed; a leading and a trailing pipe open and close the row."""
    bounds = [-1] + [i for i, ch in enumerate(line) if ch == 0x7C] + [len(line)]
    spans = []
    for a, b in zip(bounds, bounds[1:]):
        cell = line[a + 1:b]
        lead = len(cell) - len(cell.lstrip())
        spans.append((at + a + 1 + lead, at + a + 1 + lead + len(cell.strip())))
    if line.strip().startswith(b"|"):
        spans = spans[1:]
    if line.strip().endswith(b"|"):
        spans = spans[:-1]
    return spans


def _table_edits(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """Each cell of a pipe table (psql, mysql, Markdown) under a header that names a secret,
    rewritten `header=cell`: a token in a `users` table's `api_token` column reads as assigned."""
    lines, at = [], 0
    for line in data.split(b"\n"):
        lines.append((at, line.rstrip(b"\r")))
        at += len(line) + 1
    header: list[bytes] | None = None
    for i, (at, line) in enumerate(lines):
        if _RULE_LINE.fullmatch(line):
            if header is None and i > 0 and b"|" in lines[i - 1][1]:
                prev_at, prev = lines[i - 1]
                header = [prev[s - prev_at:e - prev_at] for s, e in _cells(prev, prev_at)]
            continue
        if header is None or b"|" not in line:
            header = None
            continue
        cells = _cells(line, at)
        if len(cells) == len(header):
            for name, (s, e) in zip(header, cells):
                if e > s and _SECRET_NAME.search(name) and not _NOT_SECRET.search(name):
                    yield s, e, name + b"=" + data[s:e]


def _tables(reading: Reading) -> list[Reading]:
    if b"|" not in reading.data or not _RULE_LINE.search(reading.data):
        return []
    out = _edited(reading, _table_edits(reading.data))
    return [out] if out is not None else []


def _wrap_edits(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """Each newline a terminal or a pager put inside a quoted token (`"KEY=sk-proj` then
    `-bn…"` on the next line): the line left a double quote open and the break falls between
    token characters. JSON cannot hold a raw newline in a string, so such a break is a wrap."""
    at, open_quote = 0, 0
    for line in data.split(b"\n")[:-1]:
        at += len(line) + 1
        open_quote ^= line.count(b'"') % 2  # a wrapped line's quotes count with the line it continues
        if open_quote and line[-1:].isalnum() and data[at:at + 1] in _TOKEN_BYTES:
            yield at - 1, at, b""


def _unwrapped(reading: Reading) -> list[Reading]:
    out = _edited(reading, _wrap_edits(reading.data)) if b'"' in reading.data else None
    return [out] if out is not None else []


@functools.lru_cache(maxsize=1)
def _text(data: bytes) -> tuple[Reading, list[Reading]]:
    """The escape-free reading (or `data` itself) and the readings that undo escapes a browser, a
    JSON parser or a URL decoder undoes: the escape levels, percent-escapes, character references.
    Kept for the last document: `Gate.scan` asks for them twice (the secret rules' `readings`, the
    injection rules' `text_readings`), and a JSON result's escapes are most of that work."""
    plain = _levels(Reading.identity(data), _ESCAPE, _unescape, ESCAPE_LEVELS, cue=b"\\")
    base = plain[-1] if plain else Reading.identity(data)
    unquoted = _levels(base, _PERCENT, _unpercent, 2, cue=b"%")  # twice: %2541 is %41 is A
    unentity = _levels(base, _ENTITIES, _unentity, 1, cue=b"&")
    return base, plain + unquoted + unentity


def text_readings(data: bytes) -> list[Reading]:
    """What a reader sees of escaped text, for the injection rules: an instruction in HTML
    character references, percent-escapes or `\\u` escapes reads as the page, the URL or the JSON
    value shows it (red team 14)."""
    base, text = _text(data)
    return text + _levels(base, _PLUS, lambda m: urllib.parse.unquote_to_bytes(m.group().replace(b"+", b" ")), 1,
                          cue=b"+")  # a form-encoded query: words joined by +


def readings(data: bytes) -> list[Reading]:
    """Every escape-free and base64-decoded reading of `data` that differs from it: the escape
    levels, the base64 levels of the escape-free text, and that last reading with its own escapes undone."""
    base, text = _text(data)
    inflate = Inflater(data)
    unhexed = _levels(base, _HEX, functools.partial(_unhex, inflate), 1)
    decoded = _levels(base, _BASE64, functools.partial(_decoded, inflate), BASE64_LEVELS)
    wrapped = _levels(base, _BASE64_LINES, functools.partial(_decoded, inflate), 1, cue=b"\n")
    again = _levels(decoded[-1], _ESCAPE, _unescape, ESCAPE_LEVELS, cue=b"\\") if decoded else []
    unfolded = _levels(base, _FOLD, lambda m: b"", 1, cue=b"\r\n")
    unbase32 = _levels(base, _BASE32, _unbase32, 1)
    unspaced = _levels(base, _SPACED, _unspaced, 1) + _levels(base, _GROUPED, _ungrouped, 1)
    return text + unhexed + decoded + wrapped + again + unfolded + unbase32 + unspaced + _gutterless(base) + _tables(base) \
        + _unwrapped(base)
