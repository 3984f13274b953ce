"""Learned injection scorer: a hashed character n-gram logistic model, scored per window.

Why this model: it must run on every tool result on a 2-core CPU at >= 1 MB/s, so a
transformer over every byte is out. Character n-grams over case-folded bytes are language-
and format-agnostic (JSON, HTML, code, any script), and a linear model lets us score *every*
window of the document in one pass: each byte position contributes the summed weights of the
n-grams starting there, a cumulative sum gives any window's mean in O(1), and the document
score is the most injection-like window (mean over a fixed ``WINDOW`` positions). That keeps a short injected sentence inside a long
benign document from being diluted, and the best window is a byte span we can report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WEIGHTS_PATH = Path(__file__).parent / "weights" / "injection_ngram.npz"
NGRAMS = (3, 4, 5, 6, 8)
BITS = 20
WINDOW = 200  # byte positions per scored window
_PRIME = np.uint32(0x01000193)
_MIX = np.uint32(0x9E3779B1)


def _lut() -> np.ndarray:
    lut = np.arange(256, dtype=np.uint8)
    lut[ord("A") : ord("Z") + 1] += 32
    lut[ord("0") : ord("9") + 1] = ord("0")
    for ws in b"\t\n\r\x0b\x0c":
        lut[ws] = ord(" ")
    return lut


_LUT = _lut()


def ngram_ids(data: bytes, bits: int = BITS) -> np.ndarray:
    """Hashed n-gram ids, shape (len(NGRAMS), len(data)); id ``2**bits`` pads positions where
    the n-gram would run past the end (its weight is always 0)."""
    b = _LUT[np.frombuffer(data, dtype=np.uint8)].astype(np.uint32)
    n_pos = len(b)
    out = np.full((len(NGRAMS), n_pos), 1 << bits, dtype=np.int64)
    h = b.copy()
    with np.errstate(over="ignore"):
        for length in range(2, max(NGRAMS) + 1):
            h = h[:-1] * _PRIME + b[length - 1 :]
            if length in NGRAMS and h.size:
                row = NGRAMS.index(length)
                mixed = (h ^ np.uint32(length * 0x85EBCA6B & 0xFFFFFFFF)) * _MIX
                out[row, : h.size] = (mixed >> np.uint32(32 - bits)).astype(np.int64)
    return out


@dataclass(frozen=True)
class WindowScore:
    logit: float
    byte_start: int
    byte_end: int


def _char_aligned(data: bytes, start: int, end: int) -> tuple[int, int]:
    """Widen [start, end) to UTF-8 character boundaries so the span maps cleanly to tokens."""
    while start > 0 and 0x80 <= data[start] < 0xC0:
        start -= 1
    while end < len(data) and 0x80 <= data[end] < 0xC0:
        end += 1
    return start, end


class NgramScorer:
    """Holds the committed weights; pure numpy, thread-safe (read-only arrays)."""

    def __init__(self, weights: np.ndarray, bias: float, platt: tuple[float, float], bits: int = BITS,
                 window: int = WINDOW) -> None:
        self.weights = np.append(weights.astype(np.float32), np.float32(0.0))  # last = padding id
        self.bias = float(bias)
        self.platt_a, self.platt_b = platt
        self.bits = bits
        self.window = window

    @classmethod
    def load(cls, path: Path = WEIGHTS_PATH) -> NgramScorer:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            return cls(z["weights"], float(z["bias"]), tuple(meta["platt"]), meta["bits"], meta["window"])

    def contributions(self, data: bytes) -> np.ndarray:
        """Per-byte-position sum of the weights of the n-grams starting there."""
        ids = ngram_ids(data, self.bits)
        return self.weights[ids].sum(axis=0, dtype=np.float64)

    def best_window(self, data: bytes) -> WindowScore:
        """Raw (uncalibrated) logit of the most injection-like window, and its byte span."""
        if not data:
            return WindowScore(self.bias, 0, 0)
        contrib = self.contributions(data)
        width = min(self.window, contrib.size)
        csum = np.concatenate(([0.0], np.cumsum(contrib)))
        # Always divide by the full window: a text shorter than a window carries less evidence,
        # rather than having its few n-grams blown up to a whole window's worth.
        means = (csum[width:] - csum[:-width]) / self.window
        start = int(np.argmax(means))
        return WindowScore(float(means[start] + self.bias), *_char_aligned(data, start, start + width))

    def probability(self, logit: float) -> float:
        """Platt-calibrated document-level probability from the best window's logit."""
        return float(1.0 / (1.0 + np.exp(-(self.platt_a * logit + self.platt_b))))
