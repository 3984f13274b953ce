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
and both. Each byte of a reading knows the raw span it came from, so a finding reports the raw
span (a whole base64 run when the secret was inside one: that run is what a redaction must cut).
Linear in the input: one regex pass and one decode per run per level, a fixed number of levels.
"""
from __future__ import annotations

import base64
import binascii
import html
import re
import urllib.parse
from collections.abc import Callable
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
    data = reading.data
    pieces: list[bytes] = []
    first: list[np.ndarray] = []
    last: list[np.ndarray] = []
    at, changed = 0, False
    for m in pattern.finditer(data):
        out = replace(m)
        if out is None:
            continue
        s, e = m.span()
        pieces += [data[at:s], out]
        first += [np.arange(at, s, dtype=np.int64), np.full(len(out), s, dtype=np.int64)]
        last += [np.arange(at, s, dtype=np.int64), np.full(len(out), e - 1, dtype=np.int64)]
        at, changed = e, True
    if not changed:
        return None
    pieces.append(data[at:])
    first.append(np.arange(at, len(data), dtype=np.int64))
    last.append(np.arange(at, len(data), dtype=np.int64))
    a, b = np.concatenate(first), np.concatenate(last)
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


def _unhex(m: re.Match[bytes]) -> bytes | None:
    """A hex run decoded, when it decodes to printable text (a digest or a key's own hex does not)."""
    raw = bytes.fromhex(m.group().decode("ascii"))
    return raw if _printable(raw) else None


def _printable(raw: bytes) -> bool:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(text) and sum(ch.isprintable() or ch in "\r\n\t" for ch in text) >= 0.95 * len(text)


def _decoded(m: re.Match[bytes]) -> bytes | None:
    """The run base64-decoded (standard or URL-safe) when it decodes to printable text."""
    body = m.group().rstrip(b"=")
    if len(body) % 4 == 1:
        return None
    padded = body + b"=" * (-len(body) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded) if b"-" in body or b"_" in body else base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if _printable(raw) else None


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


def readings(data: bytes) -> list[Reading]:
    """Every escape-free and base64-decoded reading of `data` that differs from it: the escape
    levels, the base64 levels of the escape-free text, and that last reading with its own escapes undone."""
    plain = _levels(Reading.identity(data), _ESCAPE, _unescape, ESCAPE_LEVELS, cue=b"\\")
    base = plain[-1] if plain else Reading.identity(data)
    unquoted = _levels(base, _PERCENT, _unpercent, 2, cue=b"%")  # twice: %2541 is %41 is A
    unentity = _levels(base, _ENTITIES, _unentity, 1, cue=b"&")
    unhexed = _levels(base, _HEX, _unhex, 1)
    decoded = _levels(base, _BASE64, _decoded, BASE64_LEVELS)
    again = _levels(decoded[-1], _ESCAPE, _unescape, ESCAPE_LEVELS, cue=b"\\") if decoded else []
    return plain + unquoted + unentity + unhexed + decoded + again
