"""The injection stack as the gateway runs it, scored on whole documents (never cut).

    python -m gate.train.eval_full --data gate/data/test.jsonl > test-full.json

Each line's text goes whole into the short agent chat the probe was trained with (the prefix is
chosen by line number), the byte gate scores its bytes, the hidden-state probe scores the tool
content's residual states, and :meth:`InjectionProbe.combine` stacks the two: the ``injection``
the gateway's policy receives. Negatives are all non-injection lines (benign and secret).

Why a separate script: `lethe gate eval` scores bytes only, at MB/s; this one runs the model
(~600 tok/s on 2 cores), so it caches each line's window features in ``var/probe_features/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gate.core import Gate
from gate.evaluate import load_rows, recall_at_fpr, roc_auc, scan_rows
from gate.probe import InjectionProbe, window_features
from gate.train.train_probe import CACHE_DIR, PREFIXES, Extractor


def window_table(extractor: Callable[[], Extractor], texts: list[str], layers: tuple[int, ...], window: int,
                 name: str, cache_dir: Path | None = None) -> tuple[list[np.ndarray], bool]:
    """Per text, its windows' mean states (``window_features``), cached by content and settings.

    Returns the table and whether it came from the cache (the model is only loaded on a miss).
    Extraction is resumable: texts are done in a fixed shuffled order, CHUNK at a time, each chunk
    saved as ``<cache>.parts/<k>.npz`` (a long run on a shared CPU survives being stopped, and the
    parts done so far are a random sample of the set: ``partial_table``).
    """
    path = cache_path(texts, layers, window, name, cache_dir)
    if path.is_file():
        with np.load(path) as z:
            return np.split(z["feats"], z["offsets"][1:-1]), True
    parts = path.with_suffix(".parts")
    parts.mkdir(parents=True, exist_ok=True)
    order = extraction_order(len(texts))
    ex = None
    with tqdm(total=len(texts), desc=f"states {name}", unit="doc", file=sys.stderr) as bar:
        for k in range(0, len(order), CHUNK):
            part = parts / f"{k // CHUNK:05d}.npz"
            idx = order[k : k + CHUNK]
            if not part.is_file():
                ex = ex or extractor()
                feats = [_doc_windows(ex, texts[i], i, layers, window) for i in idx]
                np.savez(part, feats=np.concatenate(feats), offsets=np.concatenate([[0], np.cumsum([len(f) for f in feats])]))
            bar.update(len(idx))
    table = partial_table(path, len(texts))
    feats = [table[i] for i in range(len(texts))]
    offsets = np.concatenate([[0], np.cumsum([len(f) for f in feats])])
    np.savez(path, feats=np.concatenate(feats), offsets=offsets)
    shutil.rmtree(parts)
    return feats, False


CHUNK = 25


def cache_path(texts: list[str], layers: tuple[int, ...], window: int, name: str, cache_dir: Path | None = None) -> Path:
    """Where a table is cached; ``cache_dir`` None reads the module's ``CACHE_DIR`` at call time (tests redirect it)."""
    cache_dir = cache_dir or CACHE_DIR
    key = hashlib.sha256(json.dumps([texts, layers, window, PREFIXES]).encode()).hexdigest()[:16]
    return cache_dir / f"full-{name}-{key}.npz"


def extraction_order(n: int) -> list[int]:
    """The fixed order texts are extracted in: shuffled, so any prefix is a random sample."""
    return [int(i) for i in np.random.default_rng(15).permutation(n)]


def partial_table(path: Path, n: int) -> dict[int, np.ndarray]:
    """Index -> window features of the texts whose chunks are saved under ``path``'s parts."""
    order, out = extraction_order(n), {}
    for part in sorted(path.with_suffix(".parts").glob("[0-9]*.npz")):
        k = int(part.stem) * CHUNK
        with np.load(part) as z:
            for i, f in zip(order[k : k + CHUNK], np.split(z["feats"], z["offsets"][1:-1])):
                out[i] = f
    return out


def _doc_windows(ex: Extractor, text: str, i: int, layers: tuple[int, ...], window: int) -> np.ndarray:
    states = ex.states(text, i % len(PREFIXES))
    hidden = {layer: states[:, ex.layers.index(layer)].astype(np.float32) for layer in layers}
    return window_features(hidden, layers, window, window // 2).astype(np.float32)


def probe_logit(probe: InjectionProbe, feats: np.ndarray) -> float:
    """The document logit from cached window features: the same arithmetic as ``probe.logit``."""
    return float(((feats - probe.mean) / probe.scale @ probe.coef).max() + probe.intercept) if len(feats) else -np.inf


def partial_stack_scores(rows: list[dict], byte: np.ndarray, *, name: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Like :func:`stack_scores` for the rows whose states an unfinished extraction has saved so
    far (a random sample, see ``extraction_order``): (their indices, probe scores, stack scores)."""
    probe = InjectionProbe.load()
    table = partial_table(cache_path([r["text"] for r in rows], probe.layers, probe.window, name), len(rows))
    idx = sorted(table)
    probe_p = np.array([probe.calibrate(probe_logit(probe, table[i])) for i in idx])
    return idx, probe_p, np.array([probe.combine(p, q) for p, q in zip(probe_p, byte[idx])])


def stack_scores(rows: list[dict], byte: np.ndarray, *, name: str, threads: int = 2,
                 probe: InjectionProbe | None = None, model_dir: Path | None = None,
                 cache_dir: Path | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per row: the probe's calibrated score and its stack with the byte gate's ``byte`` score
    (the ``injection`` the gateway's policy receives), and whether the states came from the cache.
    ``model_dir``: the converted checkpoint (``lethe prepare``); default the repository's var/models."""
    probe = probe or InjectionProbe.load()
    extractor = lambda: Extractor(model_dir=model_dir, layers=probe.layers, threads=threads) if model_dir else \
        Extractor(layers=probe.layers, threads=threads)
    feats, cached = window_table(extractor, [r["text"] for r in rows], probe.layers, probe.window, name,
                                 cache_dir or CACHE_DIR)  # read at call time: tests point CACHE_DIR elsewhere
    probe_p = np.array([probe.calibrate(probe_logit(probe, f)) for f in feats])
    return probe_p, np.array([probe.combine(p, q) for p, q in zip(probe_p, byte)]), cached


def evaluate(rows: list[dict], byte: np.ndarray, probe_p: np.ndarray, stack: np.ndarray) -> dict:
    """Byte gate, probe and stack side by side: recall at 1% FPR, AUC, and per-attack recall of the stack."""
    y = np.array([r["label"] == "injection" for r in rows], dtype=int)
    result: dict = {"documents": len(rows), "injections": int(y.sum()), "negatives": int((1 - y).sum())}
    for name, s in (("byte_gate", byte), ("probe", probe_p), ("stack", stack)):
        pred = s >= 0.5
        result[name] = {"recall_at_1pct_fpr": round(recall_at_fpr(s, y), 4), "roc_auc": round(roc_auc(s, y), 4),
                        "recall_at_0.5": round(float(pred[y == 1].mean()), 4), "fpr_at_0.5": round(float(pred[y == 0].mean()), 4)}
    by_source: dict[str, list[int]] = {}
    threshold = np.sort(stack[y == 0])[::-1][int(0.01 * (1 - y).sum())]
    for r, s, yi in zip(rows, stack, y):
        if yi:
            by_source.setdefault(r.get("source", "?").split("|")[-1].rsplit(":", 1)[0], []).append(int(s > threshold))
    result["stack"]["by_attack_recall_at_1pct_fpr"] = {k: [round(float(np.mean(v)), 3), len(v)] for k, v in sorted(by_source.items())}
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="JSONL of {text, label[, source]}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    rows = load_rows(args.data)
    started = time.time()
    byte = scan_rows(rows, Gate())[0]["injection"]
    probe_p, stack, _ = stack_scores(rows, byte, name=args.data.stem, threads=args.threads)
    result = evaluate(rows, byte, probe_p, stack)
    result.update(data=str(args.data), seconds=round(time.time() - started, 1))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
