"""Held-out-BY-KIND evaluation of the injection score the gateway's policy receives.

    python -m gate.train.kinds --bipia ../shared/data/bipia > var/kinds.jsonl
    python -m gate.train.kind_eval --data var/kinds.jsonl > var/kind_eval.json

Rows come from :mod:`gate.train.kinds`: host kinds and attack kinds that no training set holds.
Reported per host kind: recall at 1% FPR (the threshold set on *all* held-out negatives), FPR
and recall at the policy's own threshold (``policies/data/defaults.json``) and at 0.5, and the
expected calibration error (10 bins). Scorers: the byte gate, the probe, the shipped stack, and
a stack *cross-fitted by kind*: its two weights and intercept are fitted on the other fold's
kinds only, so every row is scored by a combiner that never saw its kind.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gate.core import Gate
from gate.evaluate import load_rows, recall_at_fpr, roc_auc, scan_rows

POLICY_DEFAULTS = Path(__file__).resolve().parents[2] / "policies" / "data" / "defaults.json"
KIND_FOLDS = ({"readme", "source", "config", "ticket", "pkg-json"}, {"docstring", "log", "lookalike", "pkg-html"})


def policy_thresholds(path: Path = POLICY_DEFAULTS) -> dict[str, float]:
    """The default tenant's thresholds, as the Rego policy applies them."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    found = _find(doc, "thresholds")
    if not isinstance(found, dict) or "injection" not in found:
        raise ValueError(f"{path}: no thresholds.injection; the policy data must define it")
    return {k: float(v) for k, v in found.items()}


def _find(doc, key):
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        for v in doc.values():
            hit = _find(v, key)
            if hit is not None:
                return hit
    return None


def ece(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error: |mean score - positive rate| per equal-width bin, weighted by size."""
    if not len(p):
        return float("nan")
    idx = np.minimum((p * bins).astype(int), bins - 1)
    return float(sum(abs(p[idx == b].mean() - y[idx == b].mean()) * (idx == b).sum() for b in range(bins) if (idx == b).any()) / len(p))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, iters: int = 50) -> np.ndarray:
    """Newton's method for L2-regularised logistic regression; returns [w..., bias]."""
    xb = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(xb.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-xb @ w))
        grad = xb.T @ (p - y) + l2 * np.r_[w[:-1], 0]
        hess = (xb * (p * (1 - p))[:, None]).T @ xb + l2 * np.eye(len(w))
        w -= np.linalg.solve(hess, grad)
    return w


def kind_folds(rows: list[dict]) -> tuple[set[str], ...]:
    """The two folds of host kinds: ``KIND_FOLDS`` for the set they were made for, otherwise the
    sorted kinds dealt alternately (every kind in exactly one fold)."""
    kinds = sorted({r["kind"] for r in rows})
    if set(kinds) == set().union(*KIND_FOLDS):
        return KIND_FOLDS
    return set(kinds[0::2]), set(kinds[1::2])


def cross_fit(rows: list[dict], features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each row scored by a logistic combiner fitted only on the other fold's kinds."""
    out = np.zeros(len(rows))
    for fold in kind_folds(rows):
        test = np.array([r["kind"] in fold for r in rows])
        w = fit_logistic(features[~test], y[~test])
        out[test] = 1 / (1 + np.exp(-(features[test] @ w[:-1] + w[-1])))
    return out


def transferred_threshold(rows: list[dict], score: np.ndarray, y: np.ndarray, fpr: float) -> dict:
    """A threshold chosen on one fold's kinds (the ``fpr`` quantile of its negatives), applied to
    the other fold's kinds: what an operator gets on kinds the threshold never saw."""
    hits: dict[str, list[Any]] = {"recall": [], "fpr": [], "thresholds": []}
    for fold in kind_folds(rows):
        test = np.array([r["kind"] in fold for r in rows])
        neg = np.sort(score[~test & (y == 0)])[::-1]
        t = float(neg[int(fpr * len(neg))])
        hits["thresholds"].append(round(t, 4))
        hits["recall"] += list(score[test & (y == 1)] > t)
        hits["fpr"] += list(score[test & (y == 0)] > t)
    return {"target_fpr": fpr, "thresholds": hits["thresholds"],
            "recall": round(float(np.mean(hits["recall"])), 3) if hits["recall"] else None,
            "fpr": round(float(np.mean(hits["fpr"])), 3)}


def by_kind(rows: list[dict], score: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    neg = np.sort(score[y == 0])[::-1]
    t1 = neg[int(0.01 * len(neg))] if len(neg) else np.inf
    out = {}
    for kind in sorted({r["kind"] for r in rows}):
        m = np.array([r["kind"] == kind for r in rows])
        pos, ngt = m & (y == 1), m & (y == 0)
        out[kind] = {
            "negatives": int(ngt.sum()), "injections": int(pos.sum()),
            "recall_at_1pct_fpr": round(float((score[pos] > t1).mean()), 3) if pos.any() else None,
            "fpr_at_policy": round(float((score[ngt] >= threshold).mean()), 3) if ngt.any() else None,
            "recall_at_policy": round(float((score[pos] >= threshold).mean()), 3) if pos.any() else None,
            "ece": round(ece(score[m], y[m]), 3),
        }
    return out


def summary(rows: list[dict], score: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    at = lambda t: {"recall": round(float((score[y == 1] >= t).mean()), 3), "fpr": round(float((score[y == 0] >= t).mean()), 3)}
    by_attack: dict[str, list[int]] = {}
    neg = np.sort(score[y == 0])[::-1]
    t1 = neg[int(0.01 * len(neg))]
    for r, s, yi in zip(rows, score, y):
        if yi:
            by_attack.setdefault(r.get("attack", "unlabelled"), []).append(int(s > t1))
    return {"recall_at_1pct_fpr": round(recall_at_fpr(score, y), 3), "roc_auc": round(roc_auc(score, y), 4),
            "ece": round(ece(score, y), 3), "at_policy_threshold": {"threshold": threshold, **at(threshold)},
            "at_0.5": at(0.5), "threshold_for_1pct_fpr_on_all_kinds": round(float(t1), 4),
            "threshold_transferred_across_kinds": transferred_threshold(rows, score, y, 0.01),
            "by_kind": by_kind(rows, score, y, threshold),
            "by_attack_recall_at_1pct_fpr": {k: round(float(np.mean(v)), 3) for k, v in sorted(by_attack.items())}}


def evaluate(rows: list[dict], byte: np.ndarray, probe_p: np.ndarray | None, stack: np.ndarray | None,
             threshold: float) -> dict:
    y = np.array([r["label"] == "injection" for r in rows], dtype=float)
    result = {"documents": len(rows), "injections": int(y.sum()), "negatives": int((1 - y).sum()),
              "host_kinds": sorted({r["kind"] for r in rows}), "attack_kinds": sorted({r["attack"] for r in rows if "attack" in r}),
              "kind_folds": [sorted(f) for f in kind_folds(rows)], "byte_gate": summary(rows, byte, y, threshold),
              "byte_gate_cross_fitted": summary(rows, cross_fit(rows, _logit(byte)[:, None], y), y, threshold)}
    if probe_p is not None and stack is not None:
        result["probe"] = summary(rows, probe_p, y, threshold)
        result["stack_shipped"] = summary(rows, stack, y, threshold)
        feats = np.stack([_logit(probe_p), _logit(byte)], axis=1)
        result["stack_cross_fitted"] = summary(rows, cross_fit(rows, feats, y), y, threshold)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="JSONL from gate.train.kinds")
    ap.add_argument("--probe", action="store_true", help="also score with the hidden-state probe (runs the model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--partial", action="store_true",
                    help="with --probe: score only the rows an unfinished extraction has saved (a random sample); "
                         "the byte gate is also reported on every row")
    args = ap.parse_args(argv)
    rows = load_rows(args.data)
    started = time.time()
    byte = scan_rows(rows, Gate())[0]["injection"]
    probe_p = stack = None
    if args.probe and args.partial:
        from gate.train.eval_full import partial_stack_scores

        idx, probe_p, stack = partial_stack_scores(rows, byte, name=args.data.stem)
        everything = evaluate(rows, byte, None, None, policy_thresholds()["injection"])
        rows, byte = [rows[i] for i in idx], byte[idx]
    elif args.probe:
        from gate.train.eval_full import stack_scores

        probe_p, stack, _ = stack_scores(rows, byte, name=args.data.stem, threads=args.threads)
    result = evaluate(rows, byte, probe_p, stack, policy_thresholds()["injection"])
    if args.partial:
        result["partial"] = {"rows_scored": len(rows), "of": everything["documents"],
                             "byte_gate_on_every_row": everything["byte_gate"]}
    result.update(data=str(args.data), seconds=round(time.time() - started, 1))
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
