"""Hidden-state injection probe: a linear read-out of SmolLM2's residual stream over a tool result.

Why: the gateway prefills every tool result into the model anyway, so the model's own
representation of "this text is addressed to me and asks for something else" comes for free.
The n-gram layer sees surface strings; the residual stream sees what the model makes of them,
which is what an injection exploits.

Features are deliberately simple so they survive a different document length or format: the
states of a few middle layers are mean-pooled over sliding token windows (an injected sentence
inside a long benign document is not diluted), standardised, and scored by one logistic
regression; the document's score is its most injection-like window, Platt-calibrated so that
0.5 means 50%. Pure numpy: the runtime never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import GateError

PROBE_PATH = Path(__file__).parent / "weights" / "probe.npz"


def window_means(states: np.ndarray, window: int, stride: int) -> np.ndarray:
    """Mean of ``states`` ([n_tokens, d]) over windows of ``window`` tokens every ``stride`` tokens.

    The last window is aligned to the end so every token is covered; a text shorter than one
    window is a single window over all its tokens. Shared by training and runtime so both see
    exactly the same features.
    """
    n = states.shape[0]
    if n <= window:
        return states.mean(axis=0, dtype=np.float64)[None, :]
    starts = list(range(0, n - window + 1, stride))
    if starts[-1] != n - window:
        starts.append(n - window)
    csum = np.concatenate([np.zeros((1, states.shape[1])), np.cumsum(states, axis=0, dtype=np.float64)])
    idx = np.asarray(starts)
    return (csum[idx + window] - csum[idx]) / window


def window_features(hidden: Mapping[int, np.ndarray], layers: tuple[int, ...], window: int, stride: int) -> np.ndarray:
    """[n_windows, len(layers) * d]: each window's mean state, layers concatenated."""
    return np.concatenate([window_means(np.asarray(hidden[layer], dtype=np.float32), window, stride) for layer in layers], axis=1)


@dataclass(frozen=True, eq=False)
class InjectionProbe:
    """Committed probe weights; immutable numpy arrays, so one instance is safe across threads."""

    layers: tuple[int, ...]
    hidden_size: int
    window: int
    stride: int
    mean: np.ndarray  # feature standardisation (fitted on training windows)
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    platt: tuple[float, float]
    model_identity: str
    meta: dict

    @classmethod
    def load(cls, path: Path | None = None) -> InjectionProbe:
        """Load probe weights (default: the committed ``weights/probe.npz``)."""
        path = Path(path) if path is not None else PROBE_PATH
        if not path.is_file():
            raise GateError(f"probe weights {path} not found; run `python -m gate.train.train_probe`")
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: z[k].astype(np.float64) for k in ("mean", "scale", "coef")}
        return cls(layers=tuple(meta["layers"]), hidden_size=int(meta["hidden_size"]), window=int(meta["window"]),
                   stride=int(meta["stride"]), intercept=float(meta["intercept"]), platt=tuple(meta["platt"]),
                   model_identity=str(meta["model_identity"]), meta=meta, **arrays)

    def _check(self, hidden: Mapping[int, np.ndarray]) -> int:
        missing = [layer for layer in self.layers if layer not in hidden]
        if missing:
            raise GateError(f"probe needs hidden states of layers {list(self.layers)}; missing {missing}")
        lengths = set()
        for layer in self.layers:
            shape = np.shape(hidden[layer])
            if len(shape) != 2 or shape[1] != self.hidden_size:
                raise GateError(f"hidden states of layer {layer} have shape {shape}; the probe expects "
                                f"[n_tokens, {self.hidden_size}] from model {self.model_identity[:12]}…")
            lengths.add(shape[0])
        if len(lengths) != 1:
            raise GateError(f"layers disagree on the number of tokens: {sorted(lengths)}")
        return lengths.pop()

    def window_logits(self, hidden: Mapping[int, np.ndarray]) -> np.ndarray:
        """Raw logit of every window (start every ``stride`` tokens; see :func:`window_means`).

        The probe is linear and a window mean is linear, so each token is projected first and
        the scalar projections are window-averaged: the same logits as standardising
        :func:`window_features`, at one mat-vec per layer instead of a [windows, features] matrix.
        """
        w = (self.coef / self.scale).reshape(len(self.layers), self.hidden_size)
        proj = sum(np.asarray(hidden[layer], dtype=np.float32) @ w[i].astype(np.float32) for i, layer in enumerate(self.layers))
        bias = self.intercept - float((self.mean / self.scale) @ self.coef)
        return window_means(np.asarray(proj, dtype=np.float64)[:, None], self.window, self.stride)[:, 0] + bias

    def logit(self, hidden: Mapping[int, np.ndarray]) -> float:
        """Uncalibrated document logit: the most injection-like window."""
        if self._check(hidden) == 0:
            return -np.inf
        return float(self.window_logits(hidden).max())

    def score(self, hidden: Mapping[int, np.ndarray]) -> float:
        """Calibrated probability that the tool result carries an injection.

        ``hidden[layer]`` is float32 ``[n_tokens, hidden_size]``: the residual stream after
        decoder layer ``layer`` (0-based) for the tool result's tokens only, as prefilled after
        the preceding conversation. An empty tool result scores 0.
        """
        return self.calibrate(self.logit(hidden))

    def calibrate(self, z: float) -> float:
        """Platt-scaled probability of a document logit (an empty document's -inf gives 0)."""
        if z == -np.inf:
            return 0.0
        a, b = self.platt
        return _sigmoid(a * z + b)

    def combine(self, probe_score: float, gate_score: float) -> float:
        """Stack this probe's score with the gate's injection probability (n-gram + rules).

        A 2-feature logistic regression on the two scores' logits, fitted on dev by the training
        script; on held-out test it beats either score alone (see ``weights/probe.json``).
        """
        (w_probe, w_gate), b = self.meta["stack"]["coef"], self.meta["stack"]["intercept"]
        return _sigmoid(w_probe * _logit(probe_score) + w_gate * _logit(gate_score) + b)


def _sigmoid(z: float) -> float:
    return float(1.0 / (1.0 + np.exp(-z)))


def _logit(p: float, eps: float = 1e-6) -> float:
    p = min(max(float(p), eps), 1.0 - eps)
    return float(np.log(p / (1.0 - p)))
