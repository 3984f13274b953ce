"""Decode arbitrary bytes once, keeping an exact map back to the original byte offsets.

Every layer reports byte offsets into the bytes the tool returned, because the gateway maps
findings to token spans of exactly those bytes. Invalid UTF-8 is replaced byte-for-byte by
``?`` in ``clean`` (so offsets are unchanged and Hyperscan's UTF-8 mode sees valid input) and
by U+FFFD in ``text`` (one character per invalid byte, so the char→byte map stays exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_ESCAPES = {cp: "\ufffd" for cp in range(0xDC80, 0xDD00)}


@dataclass(frozen=True)
class Decoded:
    """The views of one tool result that the layers scan."""

    raw: bytes
    clean: bytes  # same length as raw, valid UTF-8
    text: str
    invalid: tuple[tuple[int, int], ...]  # byte ranges [start, end) of invalid UTF-8 runs
    char_to_byte: np.ndarray = field(repr=False)  # len(text) + 1 entries

    def byte_offset(self, char_index: int) -> int:
        """Byte offset in ``raw`` of the character at ``char_index`` (len(text) maps to len(raw))."""
        return int(self.char_to_byte[char_index])


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def _utf8_lengths(cps: np.ndarray) -> np.ndarray:
    lengths = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    lengths[(cps >= 0xDC80) & (cps <= 0xDCFF)] = 1  # surrogateescape: one invalid byte each
    return lengths


def _runs(positions: np.ndarray) -> tuple[tuple[int, int], ...]:
    if positions.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    groups = np.split(positions, breaks)
    return tuple((int(g[0]), int(g[-1]) + 1) for g in groups)


def decode(data: bytes) -> Decoded:
    """Decode ``data`` without ever raising; see the module docstring for the offset contract."""
    escaped = data.decode("utf-8", "surrogateescape")
    cps = _codepoints(escaped)
    starts = np.zeros(len(escaped) + 1, dtype=np.int64)
    np.cumsum(_utf8_lengths(cps), out=starts[1:])
    bad = (cps >= 0xDC80) & (cps <= 0xDCFF)
    if not bad.any():
        return Decoded(data, data, escaped, (), starts)
    positions = starts[:-1][bad]
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    buf[positions] = 0x3F
    return Decoded(data, buf.tobytes(), escaped.translate(_ESCAPES), _runs(positions), starts)
