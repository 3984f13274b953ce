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


def report(path: Path, rows: list[dict], scores: dict[str, np.ndarray], total_bytes: int, seconds: float,
           thresholds: dict[str, float] | None = None) -> dict:
    """Per-label metrics of ``scores`` against the rows' labels, with the throughput they took.

    ``thresholds`` (label -> the policy's threshold) adds ``at_policy_threshold``: recall, FPR and
    precision where the operator's policy actually decides, next to the 0.5 figures."""
    labels = np.array([row["label"] for row in rows])
    out: dict = {"path": str(path), "documents": len(rows), "megabytes": round(total_bytes / 1e6, 3),
                 "throughput_mb_s": round(total_bytes / 1e6 / seconds, 3) if seconds else None,
                 "docs_per_s": round(len(rows) / seconds, 1) if seconds else None}
    for label in LABELS:
        y = (labels == label).astype(float)
        m = _metrics(scores[label], y)
        m["false_positives_per_10mb"] = m["false_positives"] / max(total_bytes, 1) * 1e7
        if thresholds and label in thresholds:
            at = _metrics(scores[label], y, thresholds[label])
            m["at_policy_threshold"] = {"threshold": thresholds[label], "recall": at["recall"], "fpr": at["fpr"],
                                        "precision": at["precision"], "false_positives": at["false_positives"]}
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


def package_text(megabytes: float, *, seed: int = 15) -> list[tuple[str, bytes]]:
    """Real benign text, offline: source, docs, metadata and RECORD files (sha256 hashes) of the
    installed packages, sampled across packages until ``megabytes``; (relative path, bytes)."""
    import random

    site = Path(np.__file__).resolve().parents[1]
    exts = {".py", ".md", ".rst", ".txt", ".json", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".html", ".pyi", ""}
    files = sorted(p for p in site.glob("*/**/*") if p.suffix in exts and p.is_file()
                   and (p.suffix or p.name in ("RECORD", "METADATA")))
    random.Random(seed).shuffle(files)
    out, size = [], 0
    for path in files:
        try:
            data = path.read_bytes()[:400_000]
        except OSError:
            continue
        out.append((str(path.relative_to(site)), data))
        size += len(data)
        if size >= megabytes * 1e6:
            break
    return out


def evaluate_secrets(gate: Gate | None = None, *, megabytes: float = 10.0, per_format: int = 7) -> dict:
    """Secret recall per format on generated credentials inside carriers, and false positives on
    real package text, generated look-alikes and documentation example keys.

    A credential counts as found only when a secret finding overlaps its value's bytes (a hit
    elsewhere in the carrier does not count)."""
    from .train import secretgen

    gate = gate or default_gate()
    rows = secretgen.corpus(per_format=per_format)
    by_format: dict[str, list[int]] = defaultdict(list)
    by_carrier: dict[str, list[int]] = defaultdict(list)
    missed = []
    for row in rows:
        data = row["text"].encode()
        first_line = row["secret"].split("\n")[0].encode()
        start = data.find(first_line)
        if start < 0:  # a header's value alone, as a JSON carrier holds it
            first_line = first_line.split(b": ", 1)[-1]
            start = data.find(first_line)
        end = start + len(row["secret"].encode())
        hit = start >= 0 and any(f.kind == "secret" and f.byte_start < end and f.byte_end > start for f in gate.scan(data).findings)
        by_format[row["format"]].append(int(hit))
        by_carrier[row["carrier"]].append(int(hit))
        if not hit:
            missed.append(f"{row['format']}/{row['carrier']}")
    benign = package_text(megabytes)
    benign_bytes = sum(len(d) for _, d in benign)
    fps = [(path, f.rule_id) for path, data in benign for f in gate.scan_secrets(data)]  # the readings too
    look = secretgen.lookalikes()
    look_fps = [(text[:60], f.rule_id) for text in look for f in gate.scan_secrets(text.encode())]
    found = sum(sum(v) for v in by_format.values())
    return {
        "credentials": len(rows), "formats": len(by_format), "carriers": sorted(by_carrier),
        "recall": round(found / len(rows), 4),
        "recall_by_format": {k: round(float(np.mean(v)), 3) for k, v in sorted(by_format.items())},
        "recall_by_carrier": {k: round(float(np.mean(v)), 3) for k, v in sorted(by_carrier.items())},
        "missed": missed,
        "benign_megabytes": round(benign_bytes / 1e6, 2), "benign_files": len(benign),
        "false_positives": len(fps), "false_positives_per_10mb": round(len(fps) / benign_bytes * 1e7, 3),
        "false_positive_rules": sorted({r for _, r in fps}), "false_positive_files": sorted({p for p, _ in fps})[:20],
        "lookalike_documents": len(look), "lookalike_false_positives": len(look_fps),
        "lookalike_false_positive_rules": sorted({r for _, r in look_fps}),
    }


# Secret sets written blind (by helpers that saw no rule, no project file and ran no scanner), in
# the order they were written; each was scored once as it came, then its misses were fixed, so
# now each is development data (first-contact figures: README "Secrets").
DATA_DIR = Path(__file__).parent / "data"
BLIND_SECRET_SETS = ("blind_secrets_b1.jsonl", "blind_secrets_b2.jsonl", "blind_secrets_b3.jsonl", "blind_secrets_b4.jsonl",
                     "blind_secrets_b5.jsonl")


def evaluate_secret_set(path: Path, gate: Gate | None = None) -> dict:
    """Recall on a set of {label: secret, text, secrets: [{format, value}]} and {label: benign,
    text} rows: a value is found when a secret finding (score >= 0.5) overlaps its bytes; a benign
    row is a false positive when any secret finding is in it."""
    gate = gate or default_gate()
    found: dict[str, list[int]] = defaultdict(list)
    benign = flagged = 0
    for row in load_rows(path):
        data = row["text"].encode()
        hits = [(f.byte_start, f.byte_end) for f in gate.scan_secrets(data) if f.score >= 0.5]
        if row["label"] == "benign":
            benign += 1
            flagged += bool(hits)
            continue
        for secret in row["secrets"]:
            start = data.find(secret["value"].encode())
            end = start + len(secret["value"].encode())
            found[secret["format"]].append(int(any(s < end and e > start for s, e in hits)))
    values = [v for vs in found.values() for v in vs]
    return {"set": path.name, "credentials": len(values), "formats": len(found),
            "recall": round(float(np.mean(values)), 4) if values else None,
            "benign_rows": benign, "benign_rows_flagged": flagged,
            "formats_below_1": {k: round(float(np.mean(v)), 3) for k, v in sorted(found.items()) if min(v) < 1}}
