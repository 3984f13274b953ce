"""Offline evaluation of a Gate on labelled JSONL (``{"text", "label"}`` per line).

Per label L in {injection, secret}, documents labelled L are positives and every other line is
a negative; the score is the report's ``injection`` or ``secret`` probability and the decision
threshold is 0.5 (the calibrated "more likely than not"). ``recall_at_1pct_fpr`` instead picks
the threshold from the negatives, which is what an operator tuning for false alarms would do.
Optional ``source`` fields give per-source recall, so held-out slices can be read separately.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from .core import Gate, default_gate

LABELS = ("injection", "secret")


def recall_at_fpr(scores: np.ndarray, y: np.ndarray, fpr: float = 0.01) -> float:
    """Recall with the threshold set so that at most ``fpr`` of negatives score above it."""
    neg = np.sort(scores[y == 0])[::-1]
    if neg.size == 0 or not y.any():
        return float("nan")
    k = int(np.floor(fpr * neg.size))
    threshold = neg[k] if k < neg.size else -np.inf
    return float((scores[y == 1] > threshold).mean())


def roc_auc(scores: np.ndarray, y: np.ndarray) -> float:
    """Mann-Whitney AUC with tied scores averaged."""
    n1, n0 = int(y.sum()), int((1 - y).sum())
    if not n1 or not n0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    uniq, inverse = np.unique(scores, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    counts = np.bincount(inverse)
    ranks = (sums / counts)[inverse]
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def _metrics(scores: np.ndarray, y: np.ndarray, threshold: float = 0.5) -> dict:
    pred = scores >= threshold
    tp, fp = int((pred & (y == 1)).sum()), int((pred & (y == 0)).sum())
    pos, neg = int(y.sum()), int((1 - y).sum())
    return {
        "positives": pos, "negatives": neg,
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
        "recall": tp / pos if pos else float("nan"),
        "fpr": fp / neg if neg else float("nan"),
        "false_positives": fp,
        "recall_at_1pct_fpr": recall_at_fpr(scores, y),
        "roc_auc": roc_auc(scores, y),
    }


def evaluate_jsonl(path: Path, *, gate: Gate | None = None) -> dict:
    """Scan every line of ``path`` and report per-label metrics and throughput (JSON-able)."""
    rows = load_rows(path)
    t0 = time.perf_counter()
    scores, total_bytes = scan_rows(rows, gate or default_gate())
    return report(path, rows, scores, total_bytes, time.perf_counter() - t0)


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def scan_rows(rows: list[dict], gate: Gate) -> tuple[dict[str, np.ndarray], int]:
    """Each label's gate probability per row, and the bytes scanned."""
    scores = {label: np.zeros(len(rows)) for label in LABELS}
    total_bytes = 0
    for i, row in enumerate(rows):
        data = row["text"].encode("utf-8", "surrogatepass")
        report = gate.scan(data)
        total_bytes += len(data)
        scores["injection"][i], scores["secret"][i] = report.injection, report.secret
    return scores, total_bytes


def report(path: Path, rows: list[dict], scores: dict[str, np.ndarray], total_bytes: int, seconds: float) -> dict:
    """Per-label metrics of ``scores`` against the rows' labels, with the throughput they took."""
    labels = np.array([row["label"] for row in rows])
    out: dict = {"path": str(path), "documents": len(rows), "megabytes": round(total_bytes / 1e6, 3),
                 "throughput_mb_s": round(total_bytes / 1e6 / seconds, 3) if seconds else None,
                 "docs_per_s": round(len(rows) / seconds, 1) if seconds else None}
    for label in LABELS:
        y = (labels == label).astype(float)
        m = _metrics(scores[label], y)
        m["false_positives_per_10mb"] = m["false_positives"] / max(total_bytes, 1) * 1e7
        by_source: dict[str, list[float]] = defaultdict(list)
        for row, s in zip(rows, scores[label]):
            if row["label"] == label and "source" in row:
                by_source[row["source"].split("|")[-1].rsplit(":", 1)[0]].append(float(s >= 0.5))
        if by_source:
            m["recall_by_source"] = {k: round(float(np.mean(v)), 3) for k, v in sorted(by_source.items())}
        out[label] = m
    return out


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:] or [str(Path(__file__).parent / "data" / "dev.jsonl")]:
        print(json.dumps(evaluate_jsonl(Path(arg)), indent=2))
