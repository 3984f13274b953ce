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
(`A K I A ...`) read joined; with HTML tags and ANSI escapes removed, pieces of a string joined as
a program or a shell joins them, a token cut into labels of one length joined, numbers read as the
bytes they spell, a hex dump read as its bytes, and a CSV column that names a secret read as
assigned (red team 16). `word_readings` gives, for the injection phrase rules, the text without
markup, without Markdown emphasis, and with an identifier's joiners, CamelCase and spaced-out
letters read as words. Each reading's regex is screened by Hyperscan first (`_screen`): a document
with no run for it costs one automaton pass, not a Python `re` pass, and a bounded pattern's `re`
reads only the windows where the screen says a match may end (`matches`). Each byte of a reading knows the raw span it came from, so a finding reports the raw
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

import re._parser as sre_parse

import numpy as np

from .engine import MultiMatcher, Pattern, merge_spans

ESCAPE_LEVELS = 3
BASE64_LEVELS = 2  # base64 inside base64 (`.dockerconfigjson` -> `auth`), no deeper
MIN_BASE64 = 16  # the shortest run decoded: 12 bytes, room for `user:password` and most tokens
_ESCAPE = re.compile(rb'\\(?:u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[0-3][0-7]{2}|[nrtbf"\'\\/_*`#])')  # JSON's, C's \x and octal, Markdown's
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"b": b"\b", b"f": b"\f", b'"': b'"', b"'": b"'", b"\\": b"\\",
           b"/": b"/", b"_": b"_", b"*": b"*", b"`": b"`", b"#": b"#"}
_PERCENT = re.compile(rb"(?:%[0-9A-Fa-f]{2})+")
_ENTITIES = re.compile(rb"(?:&(?:#[0-9]{1,7}|#[xX][0-9A-Fa-f]{1,6}|[A-Za-z]{2,8});)+")  # HTML/XML character references
_HEX = re.compile(rb"(?<![0-9A-Fa-f])(?:[0-9A-Fa-f]{2}){16,}(?![0-9A-Fa-f])")  # 16 bytes or more
# three or more words joined by +, from a word's start (else every position of a long run without
# a + was a start, each tried 64 ways: 0.7 s over 256 KB of `![`)
_PLUS = re.compile(rb"(?<![^\s&=?+])[^\s&=?+]{1,64}(?:\+[^\s&=?+]{1,64}){2,}")
_BASE32 = re.compile(rb"(?<![A-Za-z0-9+/=])(?:[A-Z2-7]{8}){2,}(?:[A-Z2-7]{2,7}={0,6})?(?![A-Za-z0-9+/=])")  # RFC 4648 base32
# A token spelled out a character at a time, the same separator between every two (one or two
# spaces, a tab, a line break, a dot, dash or comma, a JSON or Python list's `", "`), or in groups of
# two or four (`AKIA PTGZ 6JFE ...`); a run may open after and close before a quote or bracket. Past
# the run's last character the separator itself closes it, so a failed close backtracks one step.
_OPEN, _CLOSE = rb"(?:(?<![!-~])|(?<=[\"'`(\[{<>=:]))", rb"(?:(?![!-~])|(?=[\"'`)\]}<>,;:.\-]))"
_SPACED = re.compile(_OPEN + rb"""[!-~](?P<sep> {1,2}|\t|\r?\n|[.,\-]|, |"[ \t]?,[ \t]?"|'[ \t]?,[ \t]?')"""
                     rb"(?:[!-~](?P=sep)){11,2048}[!-~]" + _CLOSE)
# Its screen (see `_screen`): the same runs with the separator repeated by its own pattern rather
# than by a backreference, which Hyperscan only approximates (too loosely: it flagged most JSON)
_SPACED_SCREEN = b"|".join(rb"[!-~](?:" + sep + rb")(?:[!-~](?:" + sep + rb")){11,}[!-~]" for sep in (
    rb" {1,2}", rb"\t", rb"\r?\n", rb"[.,\-]", rb", ", rb'"[ \t]?,[ \t]?"', rb"'[ \t]?,[ \t]?'"))
_GROUPED = re.compile(_OPEN + rb"(?:[A-Za-z0-9+/=_]{2}(?P<s2>[ \-])(?:[A-Za-z0-9+/=_]{2}(?P=s2)){5,1024}[A-Za-z0-9+/=_]{2}"
                      rb"(?:(?P=s2)(?P<t2>[A-Za-z0-9+/=_]))?"
                      rb"|[A-Za-z0-9+/=_]{4}(?P<s4>[ \-])(?:[A-Za-z0-9+/=_]{4}(?P=s4)){2,512}[A-Za-z0-9+/=_]{4}"
                      rb"(?:(?P=s4)(?P<t4>[A-Za-z0-9+/=_]{1,3}))?)(?![A-Za-z0-9+/=_])")
# Markup a renderer or a terminal removes: HTML tags (inline ones read as nothing, so a token split
# by `<wbr>` or `</span><span>` is whole again; the rest as a space, so `previous<br>instructions`
# stays two words), HTML comments, and ANSI escape sequences (colours inside a token). Red team 16.
_INLINE_TAGS = frozenset(b"a abbr b bdi bdo big cite code data del dfn em font i ins kbd mark q s samp small span "
                         b"strike strong sub sup time tt u var wbr".split())
_MARKUP = re.compile(rb"</?([A-Za-z][A-Za-z0-9]{0,15})(?:[ \t\r\n/][^<>]{0,512})?>|<!--[^>]{0,512}?-->"
                     rb"|\x1b\[[0-?]{0,32}[ -/]{0,4}[@-~]|\x1b\][^\x07\x1b]{0,512}(?:\x07|\x1b\\)")
# Markdown emphasis and code spans around words (`**Ignore** all`, `_all_`, `` `all` ``), for the
# injection rules: the delimiters a rendered page does not show
_EMPHASIS = re.compile(rb"(?:^|(?<=[\s(\[\"']))[*_`~]{1,3}(?=[^\s*_`~])|(?<=[^\s*_`~])[*_`~]{1,3}(?=[\s.,;:!?)\]\"']|$)")
# (its screen consumes the characters its lookarounds only look at: a superset, and exact enough
# that `price_eur` or `__init__` do not send every JSON document through `re`)
_EMPHASIS_SCREEN = rb"(?:^|[\s(\[\"'])[*_`~]{1,3}[^\s*_`~]|[^\s*_`~][*_`~]{1,3}[\s.,;:!?)\]\"']"
# Words an identifier or a path joins (`ignore_all_previous_instructions`, `Ignore-All-...`,
# `IgnoreAllPreviousInstructions`, `D i s r e g a r d   a l l`), read as words by the injection
# rules (a tool's schema property named so is read by the model as a sentence)
_JOINED_WORDS = re.compile(rb"(?<![A-Za-z0-9_\-.,|/:])[A-Za-z]{1,32}(?:[_\-.,|/:][A-Za-z]{1,32}){2,64}(?![A-Za-z0-9])")
_CAMEL_WORDS = re.compile(rb"(?<![A-Za-z0-9])[A-Z]?[a-z]{1,32}(?:[A-Z][a-z]{1,32}){2,64}(?![A-Za-z0-9])")
_LETTER_SPACED = re.compile(rb"(?<![!-~])[A-Za-z](?: [A-Za-z]){2,32}(?:(?:   | \| | / )[A-Za-z](?: [A-Za-z]){0,32}){1,32}(?![!-~])")
# Pieces of one string a program or a shell joins: `"ab" + "cd"` (Java, JS), `"ab"\n "cd"` (Python,
# C), `'ab' . 'cd'` (PHP), `'ab' || 'cd'` (SQL), a shell's `\` line continuation
_TOKEN = rb"[A-Za-z0-9+/=_\-]"
_CONCAT = re.compile(rb"(?<=" + _TOKEN + rb")(?:[\"']\s{0,32}(?:\+|\.|\|\||&)?\s{0,32}[\"']|\\\r?\n[ \t]{0,32})(?=" + _TOKEN + rb")")
# A token cut into labels of one length (DNS exfiltration `ghp_ByFT.79tBfVle.gFuF...`, a URL path
# `/ab12c/de34f/...`), 3 to 16 characters each, the last one as short as it likes; a digit required
_LABEL = rb"[A-Za-z0-9_+=]"
_LABELS = re.compile(rb"(?<![A-Za-z0-9_+=])" + _LABEL + rb"{1,16}(?P<sep>[./:])" + _LABEL + rb"{1,16}(?:(?P=sep)" + _LABEL
                     + rb"{1,16}){1,64}(?!" + _LABEL + rb")")
_LABELS_SCREEN = _LABEL + rb"{1,16}[./:]" + _LABEL + rb"{1,16}(?:[./:]" + _LABEL + rb"{1,16}){1,64}"
# Bytes written as numbers: a JSON or C array, `String.fromCharCode(...)`, `0x67 0x68 ...`
_BYTE_LIST = re.compile(rb"(?<![\w.])(?:(?:0[xX][0-9a-fA-F]{1,2}|[0-9]{1,3})(?:[ \t]*,[ \t]*|[ \t]+)){11,4096}"
                        rb"(?:0[xX][0-9a-fA-F]{1,2}|[0-9]{1,3})(?![\w.])")
# A hex dump (`xxd`, `hexdump -C`, `od -A x -t x1z`): its hex columns, two lines or more, read as the bytes
_DUMP_LINE = rb"[0-9a-fA-F]{6,8}:? {1,2}[0-9a-fA-F]{2}[^\n]{0,120}"
_HEXDUMP = re.compile(rb"(?:^|(?<=\n))(?:" + _DUMP_LINE + rb"\n)+" + _DUMP_LINE)
_HEXDUMP_LINE = re.compile(rb"[0-9a-fA-F]{6,8}:?((?: {1,2}[0-9a-fA-F]{4}| {1,2}[0-9a-fA-F]{2}(?![0-9a-fA-F])){1,16})")
# Its screen: the same groups with the separator matched by its class, not a backreference
_GROUP = rb"[A-Za-z0-9+/=_]"
_GROUPED_SCREEN = _GROUP + rb"{2}[ \-](?:" + _GROUP + rb"{2}[ \-]){5,}" + _GROUP + rb"{2}(?:[ \-]" + _GROUP + rb")?|" \
    + _GROUP + rb"{4}[ \-](?:" + _GROUP + rb"{4}[ \-]){2,}" + _GROUP + rb"{4}(?:[ \-]" + _GROUP + rb"{1,3})?"
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


# A reading's `re` pass reads only windows before its screen's match ends when its matches are
# bounded (`_screen`): a 256 KB result with one short run for it costs one window, not the text.
MAX_WIDTH, MARGIN, MAX_ENDS = 1 << 15, 16, 4096


@functools.cache
def _screen(pattern: re.Pattern[bytes]) -> MultiMatcher | None:
    """A Hyperscan screen for `pattern` (exact where Hyperscan can compile it, else in prefilter
    mode, a superset: backreferences, lookarounds; or the explicit superset given below): one
    automaton pass tells whether `re` could match at all, and where its matches could end, so a
    reading the document has no run for costs microseconds, not `re`'s milliseconds per 5 KB (most
    documents hold no base64, hex, base32 or spelled-out run). A pattern whose matches are at most
    `MAX_WIDTH` bytes is screened with every end reported (`window`). Only plain and
    case-insensitive patterns are screened; `test_unwrap` holds each screen to be a superset of
    its pattern, and the windowed reading equal to the whole-text one, with Hypothesis."""
    if pattern.flags & ~(re.IGNORECASE | re.ASCII):
        return None
    regex = {id(_SPACED): _SPACED_SCREEN, id(_GROUPED): _GROUPED_SCREEN, id(_LABELS): _LABELS_SCREEN,
             id(_EMPHASIS): _EMPHASIS_SCREEN}.get(id(pattern), pattern.pattern)
    widest = sre_parse.parse(pattern.pattern).getwidth()[1]
    window = widest + 2 * MARGIN if widest <= MAX_WIDTH else 0
    return MultiMatcher([Pattern(0, regex.decode("utf-8"), caseless=bool(pattern.flags & re.IGNORECASE), window=window)])


def may_match(pattern: re.Pattern[bytes], data: bytes) -> bool:
    """False only when `pattern` has no match in `data` (its screen found none)."""
    screen = _screen(pattern)
    return screen is None or bool(screen.triggered(data))


def matches(pattern: re.Pattern[bytes], data: bytes) -> Iterator[re.Match[bytes]]:
    """`pattern.finditer(data)`, reading only the windows where its screen says a match may end
    (each match lies within its end's window: the window is the pattern's widest match and a
    margin for the screen's context and the lookarounds); the whole text when the screen cannot
    bound it or reports more than `MAX_ENDS` ends."""
    screen = _screen(pattern)
    if screen is None:
        return pattern.finditer(data)
    window = screen.patterns[0].window
    ends = screen.ends(data, MAX_ENDS) if window else ({0: [0]} if screen.triggered(data) else {})
    if ends is None or (window == 0 and ends):
        return pattern.finditer(data)
    n = len(data)
    spans = merge_spans((max(0, e - window), min(n, e + MARGIN)) for e in ends.get(0, ()))
    # A window's end reads as the text's end to `$`: a match that ends there is one only at the
    # real end (a real match ends well before its window's end: the margin is past its screen's end)
    return (m for lo, hi in spans for m in pattern.finditer(data, lo, hi) if hi == n or m.end() < hi)


def _rewrite(reading: Reading, pattern: re.Pattern[bytes], replace: Replace) -> Reading | None:
    """`reading` with each match of `pattern` replaced (each byte of a replacement comes from the
    whole match); None when nothing was replaced."""
    edits = ((m.start(), m.end(), replace(m)) for m in matches(pattern, reading.data))
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
    if token[:1] == b"x":
        return bytes([int(token[1:], 16)])
    if token[:1].isdigit():
        return bytes([int(token, 8)])
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


_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"))  # soft hyphen, zero-width, BOM


def _unentity(m: re.Match[bytes]) -> bytes | None:
    """The references decoded; those of invisible characters (`&shy;`, `&#8203;`) to nothing, as a
    browser shows them (red team 16b: a token split by them read as two)."""
    out = html.unescape(m.group().decode("ascii")).translate(_INVISIBLE).encode("utf-8", "surrogatepass")
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


def _unmarked(m: re.Match[bytes]) -> bytes:
    tag = m.group(1)
    return b" " if tag is not None and tag.lower() not in _INLINE_TAGS else b""


def _words(m: re.Match[bytes]) -> bytes:
    return re.sub(rb"[_\-.,|/:]", b" ", m.group())


def _camel_words(m: re.Match[bytes]) -> bytes:
    return re.sub(rb"(?<=[a-z])(?=[A-Z])", b" ", m.group())


def _letters(m: re.Match[bytes]) -> bytes:
    return re.sub(rb"   | \| | / ", b"\0", m.group()).replace(b" ", b"").replace(b"\0", b" ")


def _labels(tail: bool, m: re.Match[bytes]) -> bytes | None:
    """The longest run of two or more labels of one length (3 to 16) joined, with the label after
    it when shorter (`tail`; else it stays apart: it may be the next name, `.evil.example`, rather
    than the token's end); None when there is no such run or it holds no digit."""
    sep = m.group("sep")
    parts = m.group().split(sep)
    best = (0, 0)
    i = 0
    while i < len(parts):
        j = i + 1
        while j < len(parts) and len(parts[j]) == len(parts[i]):
            j += 1
        if len(parts[i]) >= 3 and j - i >= 2 and j - i > best[1] - best[0]:
            best = (i, j)
        i = j
    lo, hi = best
    if hi - lo < 2:
        return None
    if tail:  # else the same reading as without: none to scan twice
        if not (hi < len(parts) and len(parts[hi]) < len(parts[lo])):
            return None
        hi += 1
    joined = b"".join(parts[lo:hi])
    if not any(0x30 <= c <= 0x39 for c in joined):
        return None
    return sep.join(parts[:lo] + [joined] + parts[hi:])


def _relabelled(reading: Reading) -> list[Reading]:
    """The labels read joined, without and with a shorter last label (one pass of the pattern)."""
    found = list(matches(_LABELS, reading.data))
    out = []
    for tail in (False, True):
        edits = ((m.start(), m.end(), _labels(tail, m)) for m in found)
        joined = _edited(reading, ((s, e, b) for s, e, b in edits if b is not None))
        out += [joined] if joined is not None else []
    return out


def _bytes_of(m: re.Match[bytes]) -> bytes | None:
    """The numbers as bytes, when every one is printable ASCII (a list of measurements is not text)."""
    values = [int(v, 16) if v[:2].lower() == b"0x" else int(v) for v in re.findall(rb"0[xX][0-9a-fA-F]{1,2}|[0-9]{1,3}", m.group())]
    return bytes(values) if all(0x20 <= v <= 0x7E for v in values) else None


def _undumped(m: re.Match[bytes]) -> bytes | None:
    """A hex dump's bytes: each line's hex columns (up to 16 bytes a line), its offsets and its
    ASCII column dropped."""
    out = []
    for line in m.group().split(b"\n"):
        cols = _HEXDUMP_LINE.match(line)
        if cols is None:
            continue
        digits = cols.group(1).replace(b" ", b"")
        out.append(binascii.unhexlify(digits[:32]))
    return b"".join(out) or None


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
    out = None
    if b"|" in reading.data and _RULE_LINE.search(reading.data):
        out = _edited(reading, _table_edits(reading.data))
    csv = _edited(reading, _csv_edits(reading.data)) if may_match(_SECRET_NAME, reading.data) else None
    return [r for r in (out, csv) if r is not None]


_CSV_NAME = re.compile(rb'[ \t]*"?[A-Za-z_][A-Za-z0-9_ .\-]{0,40}"?[ \t]*\r?')


def _csv_cells(line: bytes, at: int, sep: int) -> list[tuple[int, int]]:
    """The spans of a delimited row's cells (in the document), spaces and one pair of quotes trimmed."""
    spans, start = [], at
    for cell in line.split(bytes([sep])):
        lead = len(cell) - len(cell.lstrip())
        inner = cell.strip()
        q = 1 if len(inner) >= 2 and inner[:1] == inner[-1:] and inner[:1] in (b'"', b"'") else 0
        spans.append((start + lead + q, start + lead + len(inner) - q))
        start += len(cell) + 1
    return spans


def _csv_edits(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """Each cell of a CSV/TSV table under a header cell that names a secret, rewritten
    `header=cell` (a `users.csv` with a `password` column; red team 16), as `_table_edits` does
    for pipe tables. A header is a row of 2+ name-like cells; its rows have as many cells."""
    header: list[bytes] | None = None
    sep = 0
    at = 0
    for line in data.split(b"\n"):
        row_at, at = at, at + len(line) + 1
        if header is not None:
            cells = _csv_cells(line.rstrip(b"\r"), row_at, sep)
            if len(cells) == len(header):
                for name, (s, e) in zip(header, cells):
                    if e > s and _SECRET_NAME.search(name) and not _NOT_SECRET.search(name):
                        yield s, e, name + b"=" + data[s:e] + b" "  # the space ends the value, as a comma does not
                continue
            header = None
        for sep in (0x2C, 0x3B, 0x09):  # , ; tab
            names = line.rstrip(b"\r").split(bytes([sep]))
            if len(names) > 1 and all(_CSV_NAME.fullmatch(n) for n in names) \
                    and any(_SECRET_NAME.search(n) for n in names):
                header = [n.strip().strip(b'"') for n in names]
                break


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
    value shows it (red team 14); words joined by + in a form-encoded query."""
    base, text = _text(data)
    return text + _levels(base, _PLUS, lambda m: urllib.parse.unquote_to_bytes(m.group().replace(b"+", b" ")), 1,
                          cue=b"+")


def word_readings(data: bytes) -> list[Reading]:
    """The text as words, for the injection phrase rules alone (red team 16): without markup,
    without Markdown emphasis, and with an identifier's joiners, CamelCase and spaced-out letters
    read as words. They only drop or space out characters, so they hold nothing hidden that the
    text itself does not: the detectors of hidden content need not read them again."""
    base = _text(data)[0]
    return _levels(base, _MARKUP, _unmarked, 1) + _levels(base, _EMPHASIS, lambda m: b"", 1) \
        + _levels(base, _JOINED_WORDS, _words, 1) + _levels(base, _CAMEL_WORDS, _camel_words, 1) \
        + _levels(base, _LETTER_SPACED, _letters, 1)


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
    relabelled = _relabelled(base)
    rejoined = _levels(base, _MARKUP, _unmarked, 1) + _levels(base, _CONCAT, lambda m: b"", 1) \
        + _levels(base, _BYTE_LIST, _bytes_of, 1) + _levels(base, _HEXDUMP, _undumped, 1)
    return text + unhexed + decoded + wrapped + again + unfolded + unbase32 + unspaced + relabelled + rejoined \
        + _gutterless(base) + _tables(base) + _unwrapped(base)
