"""Leave-kinds-out cross-validation of the injection probe and its stack, and the shipped fit.

    nice -n 10 python -m gate.train.probe_features            # once: cache the states (resumable)
    python -m gate.train.probe_cv --cv > var/probe_cv.json      # seconds per setting from the cache
    python -m gate.train.probe_cv --ship 12                     # write gate/weights/probe.{npz,json}

Why: a probe chosen and calibrated on held-out *rows* looks good and fails on *kinds* it never
saw (the wide set's figures). Here the wide set's host kinds go into ``HOST_FOLDS`` and its attack
kinds into ``ATTACK_FOLDS``; model (i, j) trains on the training corpus, the contrast kinds and
every wide row whose host kind is not in fold i and whose attack kind is not in fold j. Benign
rows of fold i are scored by the four models (i, *), each with weight 1/4; an injected row with
host in fold i and attack in fold j by model (i, j) alone: every score comes from a model that
never saw its row's host kind nor its attack kind. Calibration (Platt on the window-max logit),
the stack with the byte gate and the threshold for held-out fold i are fitted on the
out-of-fold scores of the other folds only. Settings are chosen by the pooled cross-validated
figure; the shipped probe is refitted on everything, calibrated on all out-of-fold scores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gate.evaluate import roc_auc
from gate.probe import PROBE_PATH, InjectionProbe
from gate.train.kind_eval import ece, fit_logistic
from gate.train.probe_features import LAYERS, REDTEAM_TRAIN, TRAINING_SETS, WINDOW, FeatureSet, load_all
from gate.train.train_probe import BASE_PROBE_PATH as BASE_PROBE
from gate.train.train_probe import CACHE_DIR, fit_logreg

HOST_FOLDS = (
    {"readme-install", "calendar", "service-log", "real-source", "real-json"},
    {"notes", "travel-json", "shell-history", "real-docstring"},
    {"todo-email", "banking-json", "docs-html", "config-secret", "short-output"},
    {"chat-json", "plain-config", "lookalike", "real-readme"},
)
ATTACK_FOLDS = (
    {"new:tool_hijack", "bipia-text:Space Removal & Grouping"},
    {"new:short_output", "bipia-code:Cookie Theft", "bipia-text:Information Retrieval", "synth:scam"},
    {"bipia-code:Exploiting System Vulnerabilities", "bipia-text:Malware Distribution", "synth:manipulate_output"},
    {"bipia-code:Sending Out Spam Emails", "bipia-text:Persuasion"},
)
TARGET_FPR = 0.01
Logits = Sequence[np.ndarray] | Mapping[int, np.ndarray]  # per row (index), its windows' logits


@dataclass(frozen=True)
class Setting:
    layers: tuple[int, ...]
    l2: float
    mil_top: int  # windows of an unlabelled injected document taken as positives
    contrast: bool  # train on the contrast kinds
    prior: bool = True  # the corpus-trained base probe's window logit is a feature
    extra: bool = False  # train on the second round of contrast kinds (``contrast.extra_rows``) too
    third: bool = False  # and on the third (``contrast3.third_rows``: developer artifacts, other languages)
    fourth: bool = False  # and on the fourth (``contrast4.fourth_rows``: text about AI, forms, foreign business documents)
    redteam: tuple[str, ...] = ()  # and on these red-team sets (files of ``probe_features.REDTEAM_TRAIN``)
    span: int = 1  # read-out windows of ``span * WINDOW`` tokens (stride ``WINDOW // 2``), averaged from the cache
    rounds: int = 1  # multiple-instance rounds: later ones re-pick the positive windows by the previous fit
    # Platt, stack and policy threshold fitted on the red-team sets' out-of-set scores too (``redteam_out_of_set``),
    # not on the wide set's out-of-fold scores alone (its generated and package hosts calibrate it for those only)
    calibrate_redteam: bool = False
    # the FPR of the calibration scores at which the policy threshold sits (the bound is 2%)
    policy_fpr: float = TARGET_FPR
    # each red-team window's weight in the fit relative to the other sets' (1: all alike)
    redteam_weight: float = 1.0

    @property
    def trains_on(self) -> dict[str, bool]:
        """Which cached sets besides the wide set this setting trains on (the corpus whenever cached)."""
        return {"corpus": True, "contrast": self.contrast, "contrast-extra": self.extra, "contrast-third": self.third,
                "contrast-fourth": self.fourth, "redteam": bool(self.redteam)}

    @property
    def window(self) -> int:
        return self.span * WINDOW


def _fold(value: str | None, folds: tuple[set[str], ...]) -> int:
    return next((i for i, f in enumerate(folds) if value in f), -1)


def widen(f: np.ndarray, span: int) -> np.ndarray:
    """Means of ``span * WINDOW``-token windows every ``WINDOW // 2`` tokens from the cached
    ``WINDOW``-token means (windows k, k+2, ..., k+2(span-1) tile it); a row too short for one such
    window gets the mean of its windows. Exact except for the cache's end-aligned last window."""
    if span == 1:
        return f
    step = 2 * (span - 1)
    if len(f) <= step:
        return f.astype(np.float32).mean(axis=0, keepdims=True)
    total: np.ndarray = sum(f[k : len(f) - step + k].astype(np.float32) for k in range(0, step + 1, 2))  # type: ignore[assignment]
    return total / span


def matrices(fs: FeatureSet, cols: np.ndarray, prior: InjectionProbe | None, span: int = 1) -> list[np.ndarray]:
    """Per row, its windows' features for a setting: the chosen layers' columns, and the base
    probe's window logit when ``prior`` is given (what the corpus taught, kept as one feature)."""
    out = []
    pcols = fs.layer_slice(prior.layers) if prior is not None else None
    for f in fs.feats:
        f = widen(f, span)
        x = f[:, cols].astype(np.float32)
        if prior is not None:
            z = ((f[:, pcols].astype(np.float64) - prior.mean) / prior.scale) @ prior.coef + prior.intercept
            x = np.concatenate([x, z[:, None].astype(np.float32)], axis=1)
        out.append(x)
    return out


def window_set(fs: FeatureSet, mats: list[np.ndarray], idx: np.ndarray, base_logits: Logits | None, top: int,
               window: int = WINDOW):
    """Training windows of rows ``idx``: spans label windows; unlabelled injected rows contribute
    their ``top`` windows by ``base_logits`` (multiple-instance), benign rows every window."""
    xs, ys = [], []
    stride = WINDOW // 2
    for i in idx:
        row, f = fs.rows[i], mats[i]
        if row["label"] != "injection":
            xs.append(f)
            ys.append(np.zeros(len(f)))
        elif "tokens" in row:
            a, b = row["tokens"]
            st = np.arange(len(f)) * stride
            overlap = np.clip(np.minimum(st + window, b) - np.maximum(st, a), 0, None)
            need = max(1, min(window, b - a) / 2)
            keep = (overlap >= need) | (overlap == 0)
            xs.append(f[keep])
            ys.append((overlap[keep] >= need).astype(float))
        elif base_logits is not None:
            best = np.argsort(-base_logits[i])[:top]
            xs.append(f[best])
            ys.append(np.ones(len(best)))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys)


def window_logits(mats: list[np.ndarray], idx, fitted) -> list[np.ndarray]:
    mean, scale, coef, b = fitted
    w = (coef / scale).astype(np.float32)
    bias = b - float((mean / scale) @ coef)
    return [mats[i] @ w + bias for i in idx]


def fit(sets: dict[str, FeatureSet], mats: dict[str, list[np.ndarray]], wide_idx: np.ndarray, s: Setting):
    """Probe on the corpus (when cached), the contrast kinds (when chosen) and the given wide rows.
    An injected wide row has no span: its ``mil_top`` windows by the base probe's logit (the last
    feature), or without one by a first fit on the labelled rows, are its positives."""
    names = [n for n, want in s.trains_on.items() if want and n in sets]
    # rows without spans (the red-team sets) take their top windows by the base probe, as wide rows do
    labelled = [window_set(sets[n], mats[n], np.arange(len(sets[n].rows)), [m[:, -1] for m in mats[n]] if s.prior else None,
                           s.mil_top, s.window) for n in names]
    shares = [s.redteam_weight if n == "redteam" else 1.0 for n in names] + [1.0]  # the wide rows' last
    wide, wm = sets["wide"], mats["wide"]
    if s.prior:
        lookup: Logits = [m[:, -1] for m in wm]
    else:
        benign = np.array([i for i in wide_idx if wide.rows[i]["label"] != "injection"], dtype=int)
        lookup = window_logits(wm, range(len(wm)), _fit(labelled + [window_set(wide, wm, benign, None, 0, s.window)], shares, s.l2))
    idx = np.asarray(wide_idx, dtype=int)
    fitted = _fit(labelled + [window_set(wide, wm, idx, lookup, s.mil_top, s.window)], shares, s.l2)
    for _ in range(s.rounds - 1):  # re-pick each unlabelled injected row's positive windows by this fit
        lookup = dict(zip(idx, window_logits(wm, idx, fitted)))
        fitted = _fit(labelled + [window_set(wide, wm, idx, lookup, s.mil_top, s.window)], shares, s.l2)
    return fitted


def _fit(pairs: list[tuple[np.ndarray, np.ndarray]], shares: list[float], l2: float):
    """``fit_logreg`` on the sets' windows together, each set's windows weighted by its share
    (shares of 1 are ``fit_logreg``'s unweighted fit, value for value)."""
    x, y = _cat(pairs)
    return fit_logreg(x, y, l2, np.concatenate([np.full(len(p[1]), w) for p, w in zip(pairs, shares)]))


def _cat(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


def for_setting(sets: dict[str, FeatureSet], s: Setting) -> dict[str, FeatureSet]:
    """``sets`` with the red-team set cut to the files ``s`` trains on (the cache holds every file
    of ``REDTEAM_TRAIN``: a setting recorded with fewer files stays reproducible)."""
    if "redteam" not in sets:
        return sets
    red = sets["redteam"]
    missing = sorted(set(s.redteam) - {r["set"] for r in red.rows})
    if missing:
        raise SystemExit(f"{s} trains on red-team files {missing} whose states are not cached: add them to "
                         "probe_features.REDTEAM_TRAIN and run `nice -n 10 python -m gate.train.probe_features --sets redteam`")
    keep = [i for i, r in enumerate(red.rows) if r["set"] in s.redteam]
    return {**sets, "redteam": FeatureSet([red.rows[i] for i in keep], [red.feats[i] for i in keep])}


def setting_matrices(sets: dict[str, FeatureSet], s: Setting) -> dict[str, list[np.ndarray]]:
    """Every cached set's per-row window features for setting ``s`` (see ``matrices``)."""
    prior = InjectionProbe.load(BASE_PROBE) if s.prior else None
    return {n: matrices(fs, fs.layer_slice(s.layers), prior, s.span) for n, fs in sets.items()}


def cross_validate(sets: dict[str, FeatureSet], s: Setting, mats: dict[str, list[np.ndarray]] | None = None) -> dict:
    """Out-of-fold window-max logits of every wide row (benign: one per attack fold); ``mats``:
    ``setting_matrices(sets, s)`` when the caller already has them."""
    wide = sets["wide"]
    missing = [n for n, want in s.trains_on.items() if want and n != "corpus" and n not in sets]
    if missing:
        raise SystemExit(f"{s} trains on {missing}, whose states are not cached: run "
                         f"`nice -n 10 python -m gate.train.probe_features --sets {' '.join(missing)}` first")
    mats = mats or setting_matrices(sets, s)
    hf = np.array([_fold(r["kind"], HOST_FOLDS) for r in wide.rows])
    af = np.array([_fold(r.get("attack"), ATTACK_FOLDS) for r in wide.rows])
    if (hf < 0).any():
        raise SystemExit(f"kinds without a fold: {sorted({r['kind'] for r, f in zip(wide.rows, hf) if f < 0})}")
    oof = np.full((len(wide.rows), len(ATTACK_FOLDS)), np.nan)
    for i in range(len(HOST_FOLDS)):
        for j in range(len(ATTACK_FOLDS)):
            test = np.flatnonzero((hf == i) & ((af == j) | (af < 0)))
            if not len(test):
                continue
            fitted = fit(sets, mats, np.flatnonzero((hf != i) & (af != j)), s)
            for k, z in zip(test, window_logits(mats["wide"], test, fitted)):
                oof[k, j] = z.max()
            print(f"[probe_cv] {s} fold ({i},{j}) done", file=sys.stderr, flush=True)
    return {"oof": oof, "host_fold": hf}


def expand(wide: FeatureSet, oof: np.ndarray, hf: np.ndarray, byte: np.ndarray):
    """Flatten to scored instances: (row, logit, byte score, label, weight, host fold)."""
    out = []
    for k, r in enumerate(wide.rows):
        js = np.flatnonzero(~np.isnan(oof[k]))
        for j in js:
            out.append((k, oof[k, j], byte[k], float(r["label"] == "injection"), 1.0 / len(js), hf[k]))
    a = np.array(out)
    return {"row": a[:, 0].astype(int), "z": a[:, 1], "byte": a[:, 2], "y": a[:, 3], "w": a[:, 4], "fold": a[:, 5].astype(int)}


def redteam_out_of_set(sets: dict[str, FeatureSet], mats: dict[str, list[np.ndarray]], s: Setting) -> np.ndarray:
    """Each red-team row's window-max logit from a probe fitted on everything but the whole set
    (``REDTEAM_TRAIN`` file) the row comes from: scores on tool outputs written by someone else,
    in genres the wide set lacks. Out of set, not strictly out of kind: the sets share some genres."""
    red = sets["redteam"]
    names = np.array([r["set"] for r in red.rows])
    z = np.full(len(red.rows), np.nan)
    for name in dict.fromkeys(names):
        keep, held = np.flatnonzero(names != name), np.flatnonzero(names == name)
        sub = {**sets, "redteam": FeatureSet([red.rows[i] for i in keep], [red.feats[i] for i in keep])}
        fitted = fit(sub, {**mats, "redteam": [mats["redteam"][i] for i in keep]}, np.arange(len(sets["wide"].rows)), s)
        z[held] = [w.max() for w in window_logits(mats["redteam"], held, fitted)]
        print(f"[probe_cv] {s} without {name} done", file=sys.stderr, flush=True)
    return z


def calibration_instances(sets: dict[str, FeatureSet], mats: dict[str, list[np.ndarray]], s: Setting,
                          inst: dict) -> dict[str, np.ndarray]:
    """What Platt, the stack and the threshold are fitted on: the wide set's out-of-fold
    instances, and with ``calibrate_redteam`` the red-team rows' out-of-set scores (weight 1)."""
    pooled = {k: inst[k] for k in ("z", "byte", "y", "w")}
    if not s.calibrate_redteam:
        return pooled
    red = sets["redteam"]
    extra = {"z": redteam_out_of_set(sets, mats, s), "byte": byte_scores(red.rows, "redteam"), "y": red.y,
             "w": np.ones(len(red.rows))}
    return {k: np.concatenate([pooled[k], extra[k]]) for k in pooled}


def _lg(p):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def stack_features(z: np.ndarray, byte: np.ndarray, with_byte: bool) -> np.ndarray:
    return np.stack([z, _lg(byte)], axis=1) if with_byte else z[:, None]


def weighted_threshold(score, y, w, fpr: float) -> float:
    """Lowest threshold t with weighted FPR(score > t) <= fpr."""
    neg = np.argsort(-score[y == 0])
    s, ww = score[y == 0][neg], w[y == 0][neg]
    cum = np.cumsum(ww) / ww.sum()
    k = np.searchsorted(cum, fpr, side="right")
    return float(s[k]) if k < len(s) else float(-np.inf)


def _rates(score, y, w, t):
    return {"recall": round(float((score[y == 1] > t).mean()), 3),
            "fpr": round(float(np.sum(w[y == 0] * (score[y == 0] > t)) / np.sum(w[y == 0])), 4)}


def score_folds(inst: dict, with_byte: bool, fpr: float = TARGET_FPR) -> dict:
    """Per held-out host fold: calibrated stack and threshold fitted on the other folds' instances."""
    p = np.zeros(len(inst["z"]))
    hits: dict[str, Any] = {"recall": [], "fpr_num": 0.0, "fpr_den": 0.0, "thresholds": []}
    feats = stack_features(inst["z"], inst["byte"], with_byte)
    y, w = inst["y"], inst["w"]
    for i in range(len(HOST_FOLDS)):
        te, tr = inst["fold"] == i, inst["fold"] != i
        coef = fit_logistic(feats[tr], y[tr], l2=1e-3)
        p[te] = 1 / (1 + np.exp(-(feats[te] @ coef[:-1] + coef[-1])))
        ptr = 1 / (1 + np.exp(-(feats[tr] @ coef[:-1] + coef[-1])))
        t = weighted_threshold(ptr, y[tr], w[tr], fpr)
        hits["thresholds"].append(round(t, 4))
        hits["recall"] += list(p[te & (y == 1)] > t)
        hits["fpr_num"] += float(np.sum(w[te & (y == 0)] * (p[te & (y == 0)] > t)))
        hits["fpr_den"] += float(np.sum(w[te & (y == 0)]))
    t_pool = weighted_threshold(p, y, w, fpr)
    return {"p": p, "recall_at_1pct_fpr": _rates(p, y, w, t_pool)["recall"], "auc": round(roc_auc(p, y), 4),
            "ece": round(ece(p, y), 3),
            "at_training_fold_threshold": {"thresholds": hits["thresholds"], "recall": round(float(np.mean(hits["recall"])), 3),
                                           "fpr": round(hits["fpr_num"] / hits["fpr_den"], 4)}}


def report(wide: FeatureSet, inst: dict, res: dict, threshold: float | None = None, policy_p: np.ndarray | None = None) -> dict:
    """Per host kind and per attack kind of the pooled out-of-fold scores. The figures at the policy
    ``threshold`` are read on ``policy_p`` (the scores that threshold was set on) when given."""
    p, y, w = res["p"], inst["y"], inst["w"]
    q = p if policy_p is None else policy_p
    t1 = weighted_threshold(p, y, w, TARGET_FPR)
    kinds = np.array([wide.rows[k]["kind"] for k in inst["row"]])
    attacks = np.array([wide.rows[k].get("attack", "") for k in inst["row"]])
    by_kind = {}
    for kind in sorted(set(kinds)):
        m = kinds == kind
        pos, neg = m & (y == 1), m & (y == 0)
        entry = {"negatives": int(round(w[neg].sum())), "injections": int(pos.sum()),
                 "recall_at_1pct_fpr": round(float((p[pos] > t1).mean()), 3) if pos.any() else None,
                 "fpr_at_1pct_threshold": round(float(np.sum(w[neg] * (p[neg] > t1)) / w[neg].sum()), 3) if neg.any() else None,
                 "ece": round(ece(p[m], y[m]), 3)}
        if threshold is not None:
            entry.update(fpr_at_policy=round(float(np.sum(w[neg] * (q[neg] >= threshold)) / w[neg].sum()), 3) if neg.any() else None,
                         recall_at_policy=round(float((q[pos] >= threshold).mean()), 3) if pos.any() else None)
        by_kind[kind] = entry
    by_attack = {a: round(float((p[(attacks == a) & (y == 1)] > t1).mean()), 3) for a in sorted(set(attacks[y == 1]))}
    return {"threshold_1pct_pooled": round(t1, 4), "by_kind": by_kind, "by_attack_recall_at_1pct_fpr": by_attack}


def byte_gate_version() -> str:
    """A digest of what the byte gate's injection score depends on: its rules, its heuristics and
    its learned layer's weights (a cache keyed by content alone served stale scores after a change)."""
    from gate import heuristics
    from gate.learned import WEIGHTS_PATH
    from gate.heuristics import RULES_PATH

    h = hashlib.sha256()
    for path in (RULES_PATH, Path(heuristics.__file__), WEIGHTS_PATH):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def byte_scores(rows: list[dict], name: str) -> np.ndarray:
    """The byte gate's injection probability per row, cached by content and `byte_gate_version`."""
    from gate.core import Gate

    key = hashlib.sha256(json.dumps([[r["text"] for r in rows], byte_gate_version()]).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"byte-{name}-{key}.npy"
    if path.is_file():
        return np.load(path)
    gate = Gate()
    out = np.array([gate.scan(r["text"].encode("utf-8", "surrogatepass")).injection for r in rows])
    np.save(path, out)
    return out


SETTINGS = [
    Setting((), 1e-3, 2, False),  # the base probe alone, recalibrated and stacked out of fold: the reference
    Setting((12, 18), 1e-3, 2, True), Setting(LAYERS, 1e-3, 2, True), Setting(LAYERS, 1e-2, 2, True),
    Setting((9, 12, 15, 18), 1e-2, 2, True), Setting(LAYERS, 1e-2, 2, False), Setting(LAYERS, 1e-2, 1, True),
    Setting((12, 18), 1e-2, 2, True, prior=False), Setting(LAYERS, 1e-1, 2, True), Setting(LAYERS, 1e-2, 4, True),
    Setting(LAYERS, 1.0, 2, True), Setting(LAYERS, 1e-1, 2, False),
    # issue 15, second round: more contrast kinds, longer windows, re-picked positive windows
    Setting(LAYERS, 1e-1, 2, True, extra=True), Setting(LAYERS, 1e-1, 2, True, span=2),
    Setting(LAYERS, 1e-1, 2, True, rounds=2), Setting(LAYERS, 1e-1, 2, True, extra=True, span=2),
    Setting(LAYERS, 1.0, 2, True, extra=True), Setting(LAYERS, 1e-2, 2, True, extra=True),
    # issue 15, third round: developer artifacts and other languages (the design fixed before the run: 12 plus them)
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True),
    # fourth round: text about AI assistants, forms and manuals, business documents in other languages
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True),
    # and the hand-written red-team sets s4-s6 (judged on a set written after them)
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:3]),
    # s4-s8, calibrated on the red-team sets' out-of-set scores as well (judged on s9)
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:5], calibrate_redteam=True),
    # s9 and three training sets written for it with marked injections (t1-t3, 60 genres; judged on s10)
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:9], calibrate_redteam=True),
    # it missed recall at its 1%-FPR threshold on s10 (0.450 vs 0.488) though 0.66 vs 0.40 at 1% FPR: s10 too,
    # and the policy threshold at the calibration scores' 2%-FPR point, the issue's bound (judged on s11)
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:10], calibrate_redteam=True,
            policy_fpr=0.02),
    # s11 and four more training sets (t4-t7: public sector and science, industry, media and personal life,
    # agent tools' own replies with a third of the rows short; judged on s12): its rule held there (0.912 vs 0.825
    # at 1% FPR) but its wide-set CV fell to 0.753, below the suite's standing bound of 0.80: not shipped
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:15], calibrate_redteam=True,
            policy_fpr=0.02),
    # the red-team windows (127k of 24's 175k) outweighed the rest: 24's data with them weighted 0.5 cross-validates
    # at 0.786 on the wide set, at 0.25 at 0.804 (session 10); s12 and s13 too, weighted 0.2 (the red-team share of
    # the 0.25 run, a little under), fixed before the judge s14 was scored
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:17], calibrate_redteam=True,
            policy_fpr=0.02, redteam_weight=0.2),
    # 25 beat the shipped gate on s14 but lost the wide-set CV (0.789) through docs-html false positives: s14 too
    # (development data now), and t8, documentation pages as tool outputs (180 benign, dense with imperatives to
    # the reader; 60 with a planted instruction), at red-team weights 0.2 and 0.1; the candidate (the larger
    # weight with a wide-set CV >= 0.80) was fixed before the judge s15 was scored (gate/data/rule_s15.md):
    # CV 0.795 (26) and 0.804 (27); on s15 27 beat 23 at 1% FPR (0.988 vs 0.963) but not in recall at its own
    # threshold (0.90 vs 0.95): not shipped
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:19], calibrate_redteam=True,
            policy_fpr=0.02, redteam_weight=0.2),
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:19], calibrate_redteam=True,
            policy_fpr=0.02, redteam_weight=0.1),
    # 27 with s15 (development data since its decision) in training: the candidate judged on s16 when its
    # wide-set CV is >= 0.80, else 27 itself (gate/data/rule_s16.md, written before s16 existed)
    Setting(LAYERS, 1e-1, 2, True, extra=True, third=True, fourth=True, redteam=REDTEAM_TRAIN[:20], calibrate_redteam=True,
            policy_fpr=0.02, redteam_weight=0.1),
]


def run_cv(sets, settings) -> list[dict]:
    wide = sets["wide"]
    byte = byte_scores(wide.rows, "wide")
    out = []
    for s in settings:
        cv = cross_validate(for_setting(sets, s), s)
        inst = expand(wide, cv["oof"], cv["host_fold"], byte)
        entry = {"setting": s.__dict__ | {"layers": list(s.layers)}}
        for name, wb in (("probe", False), ("stack", True)):
            res = score_folds(inst, wb)
            entry[name] = {k: v for k, v in res.items() if k != "p"}
            if wb:
                entry[name]["detail"] = report(wide, inst, res)
        print(f"[probe_cv] {json.dumps({k: entry[k] if k == 'setting' else {x: y for x, y in entry[k].items() if x != 'detail'} for k in entry})}",
              file=sys.stderr, flush=True)
        out.append(entry)
    return out


def fold_prior(fitted, layers: tuple[int, ...], prior: InjectionProbe | None):
    """One linear read-out over ``probe_layers``' states (mean 0, scale 1): the fitted weights on
    the chosen layers plus the base probe's weights scaled by its feature's coefficient."""
    mean, scale, coef, b = fitted
    probe_layers = tuple(sorted(set(layers) | set(prior.layers if prior else ())))
    d = 576
    w = np.zeros(len(probe_layers) * d)
    at = lambda layer: slice(probe_layers.index(layer) * d, (probe_layers.index(layer) + 1) * d)  # noqa: E731
    direct = coef[: len(layers) * d] / scale[: len(layers) * d]
    for k, layer in enumerate(layers):
        w[at(layer)] += direct[k * d : (k + 1) * d]
    bias = b - float(direct @ mean[: len(layers) * d])
    if prior is not None:
        gz = coef[-1] / scale[-1]
        pw = prior.coef / prior.scale
        for k, layer in enumerate(prior.layers):
            w[at(layer)] += gz * pw[k * d : (k + 1) * d]
        bias += gz * (prior.intercept - float((prior.mean / prior.scale) @ prior.coef) - mean[-1])
    return probe_layers, w, bias


def ship(sets: dict[str, FeatureSet], s: Setting, out: Path) -> dict:
    """Fit on everything; Platt, stack and the policy threshold from the cross-validated scores
    (with ``calibrate_redteam``, and the red-team sets' out-of-set scores)."""
    from gate.train.train_probe import model_identity

    sets = for_setting(sets, s)
    wide = sets["wide"]
    byte = byte_scores(wide.rows, "wide")
    mats = setting_matrices(sets, s)
    cv = cross_validate(sets, s, mats)
    inst = expand(wide, cv["oof"], cv["host_fold"], byte)
    prior = InjectionProbe.load(BASE_PROBE) if s.prior else None
    cal = calibration_instances(sets, mats, s, inst)
    a, c = fit_logistic(cal["z"][:, None], cal["y"], l2=1e-3)
    features = lambda z, b: np.stack([a * z + c, _lg(b)], axis=1)  # noqa: E731
    st = fit_logistic(features(cal["z"], cal["byte"]), cal["y"], l2=1e-3)
    stacked = lambda z, b: 1 / (1 + np.exp(-(features(z, b) @ st[:-1] + st[-1])))  # noqa: E731
    threshold = weighted_threshold(stacked(cal["z"], cal["byte"]), cal["y"], cal["w"], s.policy_fpr)
    folds, probe_folds = score_folds(inst, True), score_folds(inst, False)
    layers, w, bias = fold_prior(fit(sets, mats, np.arange(len(wide.rows)), s), s.layers, prior)
    wide_stacked = stacked(inst["z"], inst["byte"])
    meta = {"layers": list(layers), "hidden_size": 576, "window": s.window, "stride": WINDOW // 2, "intercept": bias,
            "platt": [float(a), float(c)], "model_identity": model_identity(), "plan": "leave-kinds-out",
            "setting": s.__dict__ | {"layers": list(s.layers)}, "base_probe": BASE_PROBE.name,
            "stack": {"coef": [float(st[0]), float(st[1])], "intercept": float(st[2])},
            "policy_threshold": {"value": round(threshold, 4), "target_fpr": s.policy_fpr,
                                 "how": f"the weighted {s.policy_fpr:.0%}-FPR point of the pooled out-of-fold stack scores"
                                        + (" and the red-team sets' out-of-set scores" if s.calibrate_redteam else "")},
            "host_folds": [sorted(f) for f in HOST_FOLDS], "attack_folds": [sorted(f) for f in ATTACK_FOLDS],
            "trained_on": {k: len(v.rows) for k, v in sets.items()},
            "cross_validated_probe_alone": {k: v for k, v in probe_folds.items() if k != "p"},
            "cross_validated": {**{k: v for k, v in folds.items() if k != "p"}, **report(wide, inst, folds, threshold, wide_stacked),
                                "at_shipped_threshold": _rates(wide_stacked, inst["y"], inst["w"], threshold - 1e-12)}}
    if s.calibrate_redteam:
        n = len(wide_stacked)
        red = {k: v[n:] for k, v in cal.items()}
        p = stacked(red["z"], red["byte"])
        meta["redteam_out_of_set"] = {"rows": len(p), "auc": round(roc_auc(p, red["y"]), 4),
                                      "recall_at_1pct_fpr": _rates(p, red["y"], red["w"], weighted_threshold(p, red["y"], red["w"], TARGET_FPR))["recall"],
                                      "at_shipped_threshold": _rates(p, red["y"], red["w"], threshold - 1e-12)}
    np.savez_compressed(out, mean=np.zeros_like(w, dtype=np.float32), scale=np.ones_like(w, dtype=np.float32),
                        coef=w.astype(np.float32), meta=json.dumps(meta))
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cv", action="store_true", help="cross-validate the settings (--only: a subset)")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="indices into SETTINGS")
    ap.add_argument("--ship", type=int, default=None, help="fit SETTINGS[i] on everything and write --out")
    ap.add_argument("--out", type=Path, default=PROBE_PATH)
    args = ap.parse_args(argv)
    sets = load_all(extract=False, names=("wide", *TRAINING_SETS))
    if "wide" not in sets:
        raise SystemExit("no cached wide-set states: run `nice -n 10 python -m gate.train.probe_features` first")
    print(f"[probe_cv] cached: { {k: len(v.rows) for k, v in sets.items()} }", file=sys.stderr, flush=True)
    if args.cv:
        chosen = [SETTINGS[i] for i in args.only] if args.only is not None else SETTINGS
        json.dump(run_cv(sets, chosen), sys.stdout, indent=1)
    if args.ship is not None:
        json.dump(ship(sets, SETTINGS[args.ship], args.out), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
