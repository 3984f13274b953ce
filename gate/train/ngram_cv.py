"""The byte gate's learned layer trained on hand-written tool outputs too, measured set by set.

    nice -n 10 python -m gate.train.ngram_cv --cv              # leave-folds-of-sets-out figures (JSON)
    nice -n 10 python -m gate.train.ngram_cv --ship            # fit on everything, write gate/weights/

Why: the n-gram window model (``learned.py``) was trained on BIPIA contexts, synthetic hosts and
package text. On the 21 hand-written red-team sets (tool outputs of ~400 genres, each set written
by another helper) it flags 16% of the benign outputs at 0.76 and is the source of nearly every
false positive of the byte gate, which the MCP proxy runs alone. Those sets are the closest thing
to real tool outputs the project has. Here they join the training: every benign output gives
negative windows (and its best-scoring window, mined after a first fit), every injected output
whose planted passage is marked (``injected``) gives a positive window around it; injected
outputs without a marked passage give no window (their label names no window).

Measured by folds of whole sets (``FOLDS``): a set's documents are scored by a model that never
saw any document of its set, nor of the other sets in its fold (each set is its own writer and
its own genres, so this splits by source and kind). The byte gate scored is the whole gate (rules,
heuristics and this layer, combined as the gateway combines them). Nothing from AgentDojo,
bastioncorpus or the BIPIA test splits: BIPIA *train* files only, as ``train_injection``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gate.evaluate import recall_at_fpr, roc_auc
from gate.learned import WEIGHTS_PATH, NgramScorer
from gate.train.train_injection import (BIPIA_DIR, DATA_DIR, SEED, Doc, _doc_logits, _windows, benign_prose,
                                        build_corpus, fit_mined, fit_platt)

# Folds of whole red-team sets (writers), in the order they were written.
FOLDS: tuple[tuple[str, ...], ...] = (
    ("fresh_redteam_s4", "fresh_redteam_s5", "fresh_redteam_s6", "fresh_redteam_s7"),
    ("fresh_redteam_s8", "fresh_redteam_s9", "fresh_redteam_s10", "fresh_redteam_s11"),
    ("fresh_redteam_s12", "fresh_redteam_s13", "fresh_redteam_s14", "fresh_redteam_s15"),
    ("fresh_redteam_s16", "redteam_train_t1", "redteam_train_t2", "redteam_train_t3"),
    ("redteam_train_t4", "redteam_train_t5", "redteam_train_t6", "redteam_train_t7", "redteam_train_t8"),
)
THRESHOLDS = (0.5, 0.76, 0.9)


def redteam_docs(name: str) -> list[Doc]:
    """A red-team set as training documents: a marked injection keeps its passage's span."""
    out = []
    for line in (DATA_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        at = row["text"].find(row.get("injected") or "\0")
        span = (at, at + len(row["injected"])) if row["label"] == "injection" and at >= 0 else None
        out.append(Doc(row["text"], row["label"], f"redteam:{name}:{row['kind']}", span))
    return out


def _train_windows(docs: list[Doc], r: random.Random) -> list[tuple[np.ndarray, int]]:
    """Windows of training documents; an injection without a marked span gives none."""
    return [w for d in docs if d.label == "benign" or d.span is not None
            for w in _windows(d, r, n_neg=2 if d.label == "benign" else 1)]


def fit(base: list[Doc], extra: list[Doc], epochs: int = 6, l2: float = 1e-5,
        mining_rounds: int = 2) -> NgramScorer:
    """`train_injection`'s fit (windows, hard-negative mining) over the corpus and `extra`; Platt
    on the corpus's dev split, as the shipped layer's."""
    r = random.Random(SEED + 1)
    train = base + extra
    return NgramScorer(*fit_mined(_train_windows(train, r), train, epochs, l2, mining_rounds), (1.0, 0.0))


def calibrated(scorer: NgramScorer, dev: list[Doc]) -> NgramScorer:
    y = np.array([d.label == "injection" for d in dev], dtype=float)
    return NgramScorer(scorer.weights[:-1], scorer.bias, fit_platt(_doc_logits(scorer, dev), y))


def byte_gate_scores(scorer: NgramScorer, docs: list[Doc]) -> np.ndarray:
    """The whole byte gate's injection probability with `scorer` as its learned layer."""
    from gate import Gate
    from gate.heuristics import HeuristicScanner, load_injection_rules

    gate = Gate(learned=False)
    gate.heuristics = HeuristicScanner(load_injection_rules(), scorer)
    return np.array([gate.scan(d.text.encode("utf-8", "surrogatepass")).injection for d in docs])


def figures(s: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    at = {str(t): {"recall": round(float((s[y == 1] >= t).mean()), 3), "fpr": round(float((s[y == 0] >= t).mean()), 4)}
          for t in THRESHOLDS}
    return {"n": int(len(y)), "injected": int(y.sum()), "recall_at_1pct_fpr": round(recall_at_fpr(s, y), 3),
            "roc_auc": round(roc_auc(s, y), 4), "at": at,
            "threshold_2pct_fpr": round(float(np.quantile(s[y == 0], 0.98)), 4)}


def base_corpus(bipia: Path) -> tuple[list[Doc], list[Doc]]:
    corpus = build_corpus(bipia, 3000, 5000)
    train = [d for d in corpus["train"] if d.label != "secret"] + benign_prose(random.Random(SEED + 2), 2000)
    return train, [d for d in corpus["dev"] if d.label != "secret"]


def cross_validate(bipia: Path) -> dict[str, Any]:
    train, dev = base_corpus(bipia)
    sets = {name: redteam_docs(name) for fold in FOLDS for name in fold}
    scores: dict[str, np.ndarray] = {}
    for k, fold in enumerate(tqdm(FOLDS, desc="folds of sets", file=sys.stderr)):
        extra = [d for name, docs in sets.items() if name not in fold for d in docs]
        scorer = calibrated(fit(train, extra), dev)
        for name in fold:
            scores[name] = byte_gate_scores(scorer, sets[name])
    ys = {name: np.array([d.label == "injection" for d in docs], dtype=float) for name, docs in sets.items()}
    pooled_s = np.concatenate([scores[n] for n in sets])
    pooled_y = np.concatenate([ys[n] for n in sets])
    return {"by_set": {n: figures(scores[n], ys[n]) for n in sets}, "pooled": figures(pooled_s, pooled_y),
            "folds": [list(f) for f in FOLDS]}


def ship(bipia: Path, out: Path) -> dict[str, Any]:
    """Fit on the corpus and every red-team set, calibrate, write the weights (as train_injection)."""
    train, dev = base_corpus(bipia)
    extra = [d for fold in FOLDS for name in fold for d in redteam_docs(name)]
    started = time.time()
    scorer = calibrated(fit(train, extra), dev)
    meta = json.loads(Path(out).with_suffix(".json").read_text()) if Path(out).with_suffix(".json").exists() else {}
    meta.update(platt=[scorer.platt_a, scorer.platt_b], redteam_sets=[n for f in FOLDS for n in f],
                redteam_note="ngram_cv: red-team sets' benign windows and marked passages in training",
                train_seconds=round(time.time() - started, 1))
    np.savez_compressed(out, weights=scorer.weights[:-1].astype(np.float16), bias=np.float32(scorer.bias), meta=json.dumps(meta))
    Path(out).with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bipia", type=Path, default=BIPIA_DIR)
    ap.add_argument("--cv", action="store_true")
    ap.add_argument("--ship", action="store_true")
    ap.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    args = ap.parse_args(argv)
    if args.cv:
        json.dump(cross_validate(args.bipia), sys.stdout, indent=1)
    if args.ship:
        json.dump(ship(args.bipia, args.out), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
