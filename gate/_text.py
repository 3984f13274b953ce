"""Decode arbitrary bytes once, keeping an exact map back to the original byte offsets.

Every layer reports byte offsets into the bytes the tool returned, because the gateway maps
findings to token spans of exactly those bytes. Invalid UTF-8 is replaced byte-for-byte by
``?`` in ``clean`` (so offsets are unchanged and Hyperscan's UTF-8 mode sees valid input) and
by U+FFFD in ``text`` (one character per invalid byte, so the char→byte map stays exact).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, field, replace

import numpy as np

@dataclass(frozen=True)
class Decoded:
    """The views of one tool result that the layers scan."""

    raw: bytes
    clean: bytes  # same length as raw, valid UTF-8
    text: str
    invalid: np.ndarray = field(repr=False)  # int64 [k, 2]: byte ranges [start, end) of invalid UTF-8 runs
    char_to_byte: np.ndarray = field(repr=False)  # len(text) + 1 entries

    def byte_offset(self, char_index: int) -> int:
        """Byte offset in ``raw`` of the character at ``char_index`` (len(text) maps to len(raw))."""
        return int(self.char_to_byte[char_index])

    @functools.cached_property
    def cps(self) -> np.ndarray:
        """``text`` as code points, with each invalid byte as "?" (as in ``clean``); computed once."""
        cps = codepoints(self.text).copy()
        if len(self.invalid):
            cps[(cps == 0xFFFD) & (np.diff(self.char_to_byte) == 1)] = 0x3F
        return cps


def codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def _utf8_lengths(cps: np.ndarray) -> np.ndarray:
    lengths = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    lengths[(cps >= 0xDC80) & (cps <= 0xDCFF)] = 1  # surrogateescape: one invalid byte each
    return lengths


def _runs(positions: np.ndarray) -> np.ndarray:
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = positions[np.concatenate(([0], breaks))]
    ends = positions[np.concatenate((breaks - 1, [positions.size - 1]))] + 1
    return np.stack([starts, ends], axis=1)


def decode(data: bytes) -> Decoded:
    """Decode ``data`` without ever raising; see the module docstring for the offset contract."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return _decode_invalid(data)
    starts = np.zeros(len(text) + 1, dtype=np.int64)
    np.cumsum(_utf8_lengths(codepoints(text)), out=starts[1:])
    return Decoded(data, data, text, np.zeros((0, 2), dtype=np.int64), starts)


def _valid_starts(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per byte: starts a well-formed UTF-8 sequence, and that sequence's length (vectorised).

    A byte starts one or not whatever came before it (a continuation byte never starts one), so
    the bytes no well-formed sequence covers are exactly those Python's decoder rejects one by
    one with ``surrogateescape``, and this costs numpy passes instead of a Python call per run."""
    n = b.size
    p = np.concatenate((b, np.zeros(3, dtype=np.uint8)))
    cont = [(p[k:k + n] & 0xC0) == 0x80 for k in (1, 2, 3)]
    b1 = p[1:1 + n]
    two = (b >= 0xC2) & (b <= 0xDF) & cont[0]
    three = (((b == 0xE0) & (b1 >= 0xA0)) | ((b >= 0xE1) & (b <= 0xEC)) | ((b == 0xED) & (b1 <= 0x9F))
             | (b >= 0xEE) & (b <= 0xEF)) & cont[0] & cont[1] & (b >= 0xE0) & (b <= 0xEF)
    four = (((b == 0xF0) & (b1 >= 0x90)) | ((b >= 0xF1) & (b <= 0xF3)) | ((b == 0xF4) & (b1 <= 0x8F))) \
        & cont[0] & cont[1] & cont[2]
    length = np.where(b < 0x80, 1, np.where(two, 2, np.where(three, 3, np.where(four, 4, 0))))
    return length > 0, length


def _decode_invalid(data: bytes) -> Decoded:
    """``decode`` of bytes with invalid UTF-8: each invalid byte is "?" in ``clean`` and U+FFFD in ``text``."""
    b = np.frombuffer(data, dtype=np.uint8)
    start, length = _valid_starts(b)
    covered = start.copy()
    for k in (1, 2, 3):  # the continuation bytes of each well-formed sequence
        covered[k:] |= length[:-k] > k
    bad = ~covered
    positions = np.flatnonzero(bad)
    buf = b.copy()
    buf[positions] = 0x3F
    clean = buf.tobytes()
    starts = np.append(np.flatnonzero(start | bad), b.size).astype(np.int64)
    cps = codepoints(clean.decode("utf-8")).copy()
    cps[bad[starts[:-1]]] = 0xFFFD
    text = cps.astype("<u4").tobytes().decode("utf-32-le")
    return Decoded(data, clean, text, _runs(positions), starts)


# --------------------------------------------------------------------------- detection view
#
# What the injection layers read: NFKC (per code point: fullwidth, ligatures, compatibility
# forms), with default-ignorable and format characters removed (soft hyphen, zero-width, bidi
# embeddings/overrides/isolates, variation selectors, the tag block, ...), invisible separators
# (SEPARATORS: Hangul fillers, braille blank, U+180E, no-break spaces, private-use characters)
# read as one space, so words written with them in place of spaces stay words, and, inside words
# that already contain a Latin letter, Cyrillic/Greek homoglyphs folded to the Latin letter they
# imitate. Words without a Latin letter stay as they are, so the multilingual rules still read
# Russian ("все" is all look-alikes but Russian); a word spelled only in look-alikes is not folded.
#
# Some text has a second reading, ``View.alt``: NFKD with every combining mark (Mn, Me) dropped
# ("I\u0301g\u0301nore" and "Ígnóre" read "Ignore"), and invisible separators deleted instead of
# spaced (one between every letter glues the word back; a no-break space inside a token joins it).
# It exists only where it differs from the view, and the phrase rules, the learned window and the
# secret rules scan it too: the two readings disagree exactly where an attacker chose one.
# Every character of either keeps the byte offset in ``raw`` of the character it came from:
# findings on a view report original offsets.

# Default_Ignorable_Code_Point (Unicode DerivedCoreProperties) plus every other format (Cf)
# character, computed per distinct code point below, and the control characters that render as
# nothing (NUL, backspace, ESC, DEL: one between every letter of a key hid it from every rule).
_IGNORABLE_RANGES = (
    (0x0000, 0x0008), (0x000E, 0x001F), (0x007F, 0x009F),  # C0 controls but tab, LF, VT, FF, CR; DEL, C1 (red team 14)
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
# Characters that render as blank space or nothing and are used in place of a space: the Hangul
# fillers (default-ignorable, but as a space they would glue words), braille pattern blank,
# U+180E, the no-break spaces; and the private-use areas (no standard rendering).
_SEPARATOR_RANGES = (
    (0x00A0, 0x00A0), (0x115F, 0x1160), (0x180E, 0x180E), (0x2007, 0x2007), (0x202F, 0x202F),
    (0x2800, 0x2800), (0x3164, 0x3164), (0xFFA0, 0xFFA0),
    (0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD),
)

# Letters of other scripts that render like a Latin letter in common fonts (lower and upper):
# Cyrillic, Greek, Armenian and Latin IPA letters.
HOMOGLYPHS = {
    **dict(zip("аВсдеЕһіІјЈКкМНоОрРсСТуХхЅѕԁԛԝӏАЬ", "aBcdeEhiIjJKkMHoOpPcCTyXxSsdqwlAb")),
    **dict(zip("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧοαικνρτυχεϲϹϳϒ", "ABEZHIKMNOPTYXoaikvptuxecCjY")),
    **dict(zip("օսհոց", "ouhng")),
    **dict(zip("ɑɡıȷɩ", "agiji")),
}
_FOLD = np.zeros(max(map(ord, HOMOGLYPHS)) + 1, dtype=np.uint32)  # code point -> Latin (0: none)
_FOLD[[ord(c) for c in HOMOGLYPHS]] = [ord(c) for c in HOMOGLYPHS.values()]


@dataclass(frozen=True)
class View:
    """The detection view of one tool result (see above): scan ``clean``/``text``, report via the maps."""

    clean: bytes  # ``text`` as UTF-8
    text: str
    char_to_byte: np.ndarray = field(repr=False)  # view char index -> byte offset in raw (len(text)+1)
    byte_to_raw: np.ndarray = field(repr=False)  # view byte offset -> byte offset in raw (len(clean)+1)
    changed: bool = False  # False: the view is the decoded text itself
    alt: View | None = None  # the second reading (marks dropped, separators deleted) where it differs

    def byte_offset(self, char_index: int) -> int:
        return int(self.char_to_byte[char_index])

    def raw_offset(self, view_byte: int) -> int:
        return int(self.byte_to_raw[view_byte])

    @property
    def readings(self) -> tuple[View, ...]:
        """The readings that differ from the decoded text, each to be scanned: the view, its alt."""
        return tuple(v for v in (self, self.alt) if v is not None and v.changed)


_CONTROLS = re.compile("[\x00-\x08\x0e-\x1f\x7f]")  # ASCII text that still needs a view: NUL, ESC, DEL...
_IGNORE, _ALPHA, _NFKC_CHANGES, _SEPARATOR, _MARKED, _COMBINING = 1, 2, 4, 8, 16, 32
_MARKS = frozenset({"Mn", "Me"})


def _marked(ch: str) -> bool:
    """A combining mark, or a character whose compatibility decomposition holds one (é, ǵ, で)."""
    return unicodedata.category(ch) in _MARKS or bool(unicodedata.decomposition(ch)) and any(
        unicodedata.category(c) in _MARKS for c in unicodedata.normalize("NFKD", ch))


@functools.cache
def unicode_tables() -> np.ndarray:
    """One flag byte per code point (ignorable, alphabetic, changed by NFKC, separator, marked,
    combining mark):
    built once (~0.3 s), so that the views cost numpy lookups per character and Python work only
    per distinct change."""
    flags = np.zeros(0x110000, dtype=np.uint8)
    for cp in range(0x80, 0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        flags[cp] = ((_IGNORE if unicodedata.category(ch) == "Cf" else 0) | (_ALPHA if ch.isalpha() else 0)
                     | (0 if unicodedata.is_normalized("NFKC", ch) else _NFKC_CHANGES)
                     | (_MARKED if _marked(ch) else 0)
                     | (_COMBINING if unicodedata.category(ch) in _MARKS else 0))
    for lo, hi in _IGNORABLE_RANGES:
        flags[lo : hi + 1] |= _IGNORE
    for lo, hi in _SEPARATOR_RANGES:
        flags[lo : hi + 1] |= _SEPARATOR
    return flags


def word_chars(cps: np.ndarray) -> np.ndarray:
    """Per code point: letter, digit or underscore (``str.isalnum`` plus "_", vectorised)."""
    ascii_word = ((cps | 0x20) >= 0x61) & ((cps | 0x20) <= 0x7A) | ((cps >= 0x30) & (cps <= 0x39)) | (cps == 0x5F)
    return ascii_word | ((unicode_tables()[cps] & _ALPHA) != 0)


def _image(cp: int, flags: np.ndarray, alt: bool) -> str:
    """What one code point reads as in the view (``alt``: in the second reading)."""
    if flags[cp] & _SEPARATOR:
        return "" if alt else " "
    if flags[cp] & _IGNORE:
        return ""
    ch = chr(cp)
    if alt and flags[cp] & _MARKED:
        ch = "".join(c for c in unicodedata.normalize("NFKD", ch) if unicodedata.category(c) not in _MARKS)
    return "".join(c for c in unicodedata.normalize("NFKC", ch) if not flags[ord(c)] & _IGNORE)


def _replacements(unique: np.ndarray, alt: bool) -> dict[int, str]:
    """The image of each distinct code point that changes in the view (``alt``: in the second reading)."""
    flags = unicode_tables()
    changing = _IGNORE | _NFKC_CHANGES | _SEPARATOR | (_MARKED if alt else 0)
    return {cp: _image(cp, flags, alt) for cp in unique[(flags[unique] & changing) != 0].tolist()}


def _fold_homoglyphs(cps: np.ndarray) -> np.ndarray:
    """Fold look-alikes in words that also contain a Latin letter."""
    target = _FOLD[np.minimum(cps, _FOLD.size - 1)] * (cps < _FOLD.size)
    conf = target != 0
    if not conf.any():
        return cps
    latin = ((cps | 0x20) >= 0x61) & ((cps | 0x20) <= 0x7A)
    word_id = np.cumsum(~(word_chars(cps) | conf))
    fold = conf & (np.bincount(word_id, weights=latin) > 0)[word_id]
    out = cps.copy()
    out[fold] = target[fold]
    return out


def _expand(cps: np.ndarray, table: dict[int, str]) -> tuple[np.ndarray, np.ndarray]:
    """Apply a code point -> string table with numpy gathers: (new code points, source index of each)."""
    keys = np.array(sorted(table), dtype=np.uint32)
    images = [codepoints(table[k]) for k in keys.tolist()]
    sizes = np.array([im.size for im in images], dtype=np.int64)
    flat = np.concatenate(images + [np.zeros(1, dtype=np.uint32)])
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    pos = np.minimum(np.searchsorted(keys, cps), keys.size - 1)
    hit = keys[pos] == cps
    lengths = np.where(hit, sizes[pos], 1)
    source = np.repeat(np.arange(cps.size), lengths)
    starts = np.cumsum(lengths) - lengths
    within = np.arange(source.size) - starts[source]
    out = np.where(hit[source], flat[np.where(hit[source], first[pos[source]] + within, flat.size - 1)], cps[source])
    return out.astype(np.uint32), source


def _reading(doc: Decoded, table: dict[int, str]) -> View | None:
    """``doc`` with ``table`` applied and homoglyphs folded (None: nothing changes)."""
    cps, char_to_byte = doc.cps, doc.char_to_byte  # invalid bytes as "?": one byte each in the view too
    if table:
        cps, source = _expand(cps, table)
        char_to_byte = np.append(doc.char_to_byte[:-1][source], doc.char_to_byte[-1])
    folded = _fold_homoglyphs(cps)
    if not table and folded is cps:
        return None
    text = folded.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")
    clean = text.encode("utf-8", "surrogatepass")
    byte_to_raw = np.append(np.repeat(char_to_byte[:-1], _utf8_lengths(folded)), char_to_byte[-1])
    return View(clean, text, char_to_byte, byte_to_raw, changed=True)


def detection_view(doc: Decoded) -> View:
    """The normalised text the injection layers scan, and its second reading where that differs,
    with maps back to ``doc.raw`` (linear time)."""
    identity = View(doc.clean, doc.text, doc.char_to_byte, np.arange(len(doc.clean) + 1, dtype=np.int64))
    if doc.text.isascii() and not _CONTROLS.search(doc.text):
        return identity
    unique = np.unique(doc.cps)
    view = _reading(doc, _replacements(unique, alt=False)) or identity
    return replace(view, alt=_reading(doc, _replacements(unique, alt=True))) if _needs_alt(unique) else view


def normalised(data: bytes) -> str:
    """The text the gate's detectors read for ``data`` (``detection_view``'s first reading): for
    callers outside the gate that must compare content as the gate sees it."""
    return detection_view(decode(data)).text


def _needs_alt(unique: np.ndarray) -> bool:
    """Whether the text holds a separator or a combining mark that is not ignorable: only those make
    the two readings differ in a way that hides a word or token. Precomposed accents alone (any
    French text) do not, so ordinary accented text costs one reading."""
    flags = unicode_tables()[unique]
    return bool(np.any((flags & _SEPARATOR) | ((flags & _COMBINING) & ~(flags & _IGNORE))))



# A word boundary that knows non-ASCII letters, for Hyperscan (whose \b is ASCII-only outside UCP
# mode, and UCP mode rejects \b): it consumes the neighbouring ASCII space, punctuation or control
# character (a Unicode letter class would cost the rule its start-of-match mode).
NOT_WORD = r"[\x00-\x2f\x3a-\x40\x5b-\x5e\x60\x7b-\x7f]"


def unicode_boundaries(regex: str) -> str:
    r"""``\b`` next to a non-ASCII letter ("\bтеперь", "é\b") never matches in Hyperscan's UTF-8
    mode (it sees no word character there); such a ``\b`` becomes a consuming boundary instead."""
    out, i = [], 0
    while i < len(regex):
        piece = regex[i:i + 2] if regex[i] == "\\" else regex[i]
        if piece == r"\b":
            after = regex[i + 3:i + 4] if regex[i + 2:i + 3] == "[" else regex[i + 2:i + 3]
            before = regex[i - 1:i]
            if after and not after.isascii():
                piece = f"(?:^|{NOT_WORD})"
            elif before and not before.isascii():
                piece = f"(?:$|{NOT_WORD})"
        out.append(piece)
        i += 2 if regex[i] == "\\" else 1
    return "".join(out)
