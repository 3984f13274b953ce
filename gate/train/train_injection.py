"""Reproducible training of the learned injection scorer and the shipped dev/test sets.

    nice -n 10 python -m gate.train.train_injection            # writes gate/weights/, gate/data/

Splits (fixed seed), so that the test set measures generalisation rather than memory:
  * BIPIA contexts (email, table, code): 65% train / 15% dev / 20% test, by context.
  * BIPIA attack categories: a fixed subset of text and code categories appears ONLY in test.
  * Synthetic injection families ``manipulate_output`` and ``scam`` appear ONLY in test.
  * Synthetic benign kinds ``ticket`` and ``log`` appear ONLY in test.
  * Real benign text (files of the installed Python packages, split by package name).
The test set is written once and never used for tuning or calibration; dev is used for both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from gate.evaluate import recall_at_fpr, roc_auc
from gate.learned import BITS, NGRAMS, WINDOW, WEIGHTS_PATH, NgramScorer, ngram_ids
from gate.train import synth

log = structlog.get_logger(__name__)

SEED = 20240611
BIPIA_DIR = Path(os.environ.get("LETHE_BIPIA_DIR") or Path(__file__).resolve().parents[2].parent / "shared" / "data" / "bipia")
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
TEST_ONLY_FAMILIES = {"manipulate_output", "scam"}
TEST_ONLY_BENIGN = {"ticket", "log"}
MAX_CONTEXT = 4000
EVAL_PER_KIND = 25  # eval hosts per synthetic kind (x3 per BIPIA domain, x4 real): jsonl < 2 MB
EVAL_SECRETS = 120
_SUSPECT = re.compile(r"<\|im_start\|>|\[INST\]|ignore (all )?previous instructions|you are a helpful assistant", re.I)


@dataclass
class Doc:
    text: str
    label: str  # injection | benign | secret
    source: str
    span: tuple[int, int] | None = None  # char span of the injected attack


def _bipia(bipia: Path) -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    contexts: dict[str, list[str]] = {}
    for domain in ("email", "table", "code"):
        rows = [json.loads(x) for x in (bipia / domain / "train.jsonl").read_text().splitlines() if x.strip()]
        contexts[domain] = [("\n".join(c) if isinstance(c, list) else c)[:MAX_CONTEXT] for c in (r["context"] for r in rows)]
    attacks = {k: json.loads((bipia / f"{k}_attack_train.json").read_text()) for k in ("text", "code")}
    return contexts, attacks


def _split(items: list, r: random.Random, fractions=(0.65, 0.15)) -> dict[str, list]:
    items = items[:]
    r.shuffle(items)
    a, b = int(len(items) * fractions[0]), int(len(items) * (fractions[0] + fractions[1]))
    return {"train": items[:a], "dev": items[a:b], "test": items[b:]}


def _real_text(r: random.Random, limit: int) -> dict[str, list[str]]:
    """Chunks of docs and source from installed packages: real prose and code, offline."""
    site = Path(np.__file__).resolve().parents[1]
    files = sorted(p for ext in ("*.md", "*.rst", "*.txt", "*.py") for p in site.glob(f"*/**/{ext}"))
    r.shuffle(files)
    out: dict[str, list[str]] = {"train": [], "dev": [], "test": []}
    for path in files[: limit * 2]:
        try:
            text = path.read_text(encoding="utf-8")[:20000]
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 300 or _SUSPECT.search(text):
            continue
        bucket = zlib.crc32(path.relative_to(site).parts[0].encode()) % 10
        split = "train" if bucket < 7 else "dev" if bucket == 7 else "test"
        length = r.randint(200, 3000)
        start = r.randint(0, max(0, len(text) - length))
        out[split].append(text[start : start + length])
    return out


def benign_prose(r: random.Random, limit: int) -> list[Doc]:
    """Contrastive negatives: imperative prose written for humans (package READMEs from METADATA,
    docstrings), from the training packages only (hash buckets 0-6). Over-defense on exactly this
    text (install steps, "use the X function", examples) is what held-out READMEs showed."""
    from gate.train.kinds import _docstrings, package_bucket

    site = Path(np.__file__).resolve().parents[1]
    meta = [m for m in sorted(site.glob("*.dist-info/METADATA")) if package_bucket(m.parent.name.split("-")[0]) < 7]
    py = sorted(p for pkg in site.iterdir() if pkg.is_dir() and package_bucket(pkg.name) < 7 for p in pkg.rglob("*.py"))
    r.shuffle(py)
    texts = []
    for m in meta:
        body = m.read_text(encoding="utf-8", errors="replace").split("\n\n", 1)[-1]
        texts += [body[i : i + 2000] for i in range(0, min(len(body), 12000), 2000) if len(body[i : i + 2000]) > 300]
    for path in py:
        if len(texts) >= limit:
            break
        texts += [d[:2000] for d in _docstrings(path)[:3]]
    r.shuffle(texts)
    return [Doc(t, "benign", "prose") for t in texts[:limit] if not _SUSPECT.search(t)]


def build_corpus(bipia: Path, n_synth: int, n_real: int) -> dict[str, list[Doc]]:
    r = random.Random(SEED)
    contexts, attacks = _bipia(bipia)
    ctx = {d: _split(v, r) for d, v in contexts.items()}
    text_cats, code_cats = sorted(attacks["text"]), sorted(attacks["code"])
    r.shuffle(text_cats)
    r.shuffle(code_cats)
    held = {"text": set(text_cats[:4]), "code": set(code_cats[:3])}
    real = _real_text(r, n_real)
    corpus: dict[str, list[Doc]] = {"train": [], "dev": [], "test": []}
    for split, docs in corpus.items():
        families = [f for f in synth.FAMILIES if split == "test" or f not in TEST_ONLY_FAMILIES]
        kinds = [k for k in synth.BENIGN_KINDS if split == "test" or k not in TEST_ONLY_BENIGN]
        n_kind = n_synth // len(kinds) if split == "train" else EVAL_PER_KIND
        hosts = [(f"bipia-{d}", c) for d, parts in ctx.items() for c in parts[split][: None if split == "train" else EVAL_PER_KIND * 3]]
        hosts += [(f"synth-{k}", synth.benign(r, k)) for k in kinds for _ in range(n_kind)]
        hosts += [("real", t) for t in real[split][: None if split == "train" else EVAL_PER_KIND * 4]]
        for source, host in hosts:
            docs.append(Doc(host, "benign", source))
            # The few BIPIA email/code contexts are the closest thing to the target data: reuse them more.
            copies = (6 if split == "train" else 5) if source in ("bipia-email", "bipia-code") else 2 if split == "train" else 1
            for _ in range(copies):
                docs.append(_inject(r, split, source, host, attacks, held, families))
        if split != "train":
            docs += [_secret_doc(r, source, host) for source, host in r.sample(hosts, EVAL_SECRETS)]
    return corpus


def _inject(r, split, source, host, attacks, held, families) -> Doc:
    use_bipia = r.random() < 0.5
    kind = "code" if source == "bipia-code" or (source in ("synth-code", "real") and r.random() < 0.5) else "text"
    if use_bipia:
        cats = [c for c in sorted(attacks[kind]) if (c in held[kind]) == (split == "test")]
        cat = r.choice(cats)
        attack, tag = r.choice(attacks[kind][cat]), f"bipia:{kind}:{cat}"
    else:
        fam = r.choice(["code_payload"] if kind == "code" and r.random() < 0.5 else families)
        if split == "test" and r.random() < 0.6:
            fam = r.choice(sorted(TEST_ONLY_FAMILIES))
        attack, tag = synth.injection(r, fam), f"synth:{fam}"
    text, a, b = synth.insert(r, host, attack)
    return Doc(text, "injection", f"{source}|{tag}", (a, b))


def _secret_doc(r: random.Random, source: str, host: str) -> Doc:
    kind, secret = synth.fake_secret(r)
    text, _, _ = synth.insert(r, host, secret)
    return Doc(text, "secret", f"{source}|secret:{kind}")


# ------------------------------------------------------------------------------- training

def _byte_span(text: str, span: tuple[int, int]) -> tuple[int, int]:
    return len(text[: span[0]].encode()), len(text[: span[1]].encode())


def _windows(doc: Doc, r: random.Random, n_neg: int) -> list[tuple[np.ndarray, int]]:
    """(n-gram ids of a window, label) pairs cut from one document, ids hashed on the full text."""
    data = doc.text.encode()
    ids = ngram_ids(data)
    n = len(data)
    w = min(WINDOW, n)
    out = []
    if doc.span is not None:
        a0, a1 = _byte_span(doc.text, doc.span)
        if a1 - a0 <= w:
            lo, hi = max(0, a1 - w), min(a0, n - w)
        else:
            lo, hi = a0, a0 + (a1 - a0 - w) // 3
        s = r.randint(lo, max(lo, hi))
        out.append((ids[:, s : s + w], 1))
    for _ in range(n_neg):
        s = r.randint(0, n - w)
        if doc.span is None or s + w <= _byte_span(doc.text, doc.span)[0] or s >= _byte_span(doc.text, doc.span)[1]:
            out.append((ids[:, s : s + w], 0))
    return out


def _pack(windows: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = len(NGRAMS)
    cols = np.full((len(windows), k * WINDOW), 1 << BITS, dtype=np.int32)
    lengths = np.empty(len(windows), dtype=np.float32)
    for i, (ids, _) in enumerate(windows):
        cols[i, : ids.size] = ids.ravel()
        lengths[i] = WINDOW  # fixed normaliser, as in NgramScorer.best_window
    return cols, lengths, np.array([y for _, y in windows], dtype=np.float32)


def train_logreg(cols, lengths, y, epochs: int, l2: float, seed: int) -> tuple[np.ndarray, float]:
    """Mini-batch Adam on hashed sparse features (mean over the window's positions), class-balanced."""
    dim = (1 << BITS) + 1
    w, b = np.zeros(dim, dtype=np.float64), 0.0
    m, v, mb, vb = np.zeros(dim), np.zeros(dim), 0.0, 0.0
    pos_w = (y == 0).sum() / max(1, (y == 1).sum())
    sample_w = np.where(y == 1, pos_w, 1.0)
    rng = np.random.default_rng(seed)
    lr, beta1, beta2, step = 0.05, 0.9, 0.999, 0
    for _ in range(epochs):
        for batch in np.array_split(rng.permutation(len(y)), max(1, len(y) // 2048)):
            c = cols[batch]
            z = w[c].sum(axis=1) / lengths[batch] + b
            p = 1.0 / (1.0 + np.exp(-z))
            g = (p - y[batch]) * sample_w[batch] / len(batch)
            grad = np.bincount(c.ravel(), weights=np.repeat(g / lengths[batch], c.shape[1]), minlength=dim) + l2 * w
            grad[-1] = 0.0
            gb = g.sum()
            step += 1
            m = beta1 * m + (1 - beta1) * grad
            v = beta2 * v + (1 - beta2) * grad * grad
            w -= lr * (m / (1 - beta1**step)) / (np.sqrt(v / (1 - beta2**step)) + 1e-8)
            mb = beta1 * mb + (1 - beta1) * gb
            vb = beta2 * vb + (1 - beta2) * gb * gb
            b -= lr * (mb / (1 - beta1**step)) / (np.sqrt(vb / (1 - beta2**step)) + 1e-8)
    return w[:-1].astype(np.float32), float(b)


def fit_platt(logits: np.ndarray, y: np.ndarray, iters: int = 2000) -> tuple[float, float]:
    """Platt scaling by Newton steps on 2 parameters (with Platt's target smoothing)."""
    t = np.where(y == 1, (y.sum() + 1) / (y.sum() + 2), 1 / ((1 - y).sum() + 2))
    a, c = 1.0, 0.0
    for _ in range(iters):
        p = 1 / (1 + np.exp(-(a * logits + c)))
        ga, gc = ((p - t) * logits).sum(), (p - t).sum()
        s = p * (1 - p) + 1e-12
        h = np.array([[(s * logits * logits).sum(), (s * logits).sum()], [(s * logits).sum(), s.sum()]]) + 1e-9 * np.eye(2)
        da, dc = np.linalg.solve(h, [ga, gc])
        a, c = a - da, c - dc
        if abs(da) + abs(dc) < 1e-10:
            break
    return float(a), float(c)


def _doc_logits(scorer: NgramScorer, docs: list[Doc]) -> np.ndarray:
    return np.array([scorer.best_window(d.text.encode()).logit for d in docs])


def _write_jsonl(path: Path, docs: list[Doc]) -> str:
    lines = [json.dumps({"text": d.text, "label": d.label, "source": d.source}, ensure_ascii=False) for d in docs]
    payload = ("\n".join(lines) + "\n").encode()
    path.write_bytes(payload)
    return hashlib.sha256(payload).hexdigest()



def fit_mined(windows: list, train: list, epochs: int, l2: float, mining_rounds: int) -> tuple[np.ndarray, float]:
    """The window model fitted, then refitted `mining_rounds` times with hard negatives: the best
    window of every benign training doc is what the max-over-windows document score sees, so
    teach the model about exactly those windows (`windows` grows by them)."""
    cols, lengths, y = _pack(windows)
    weights, bias = train_logreg(cols, lengths, y, epochs, l2, SEED)
    for _ in range(mining_rounds):
        scorer = NgramScorer(weights, bias, (1.0, 0.0))
        for d in train:
            if d.label == "benign":
                data = d.text.encode()
                ws = scorer.best_window(data)
                windows.append((ngram_ids(data)[:, ws.byte_start : ws.byte_start + WINDOW], 0))
        cols, lengths, y = _pack(windows)
        weights, bias = train_logreg(cols, lengths, y, epochs, l2, SEED)
    return weights, bias


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bipia", type=Path, default=BIPIA_DIR)
    ap.add_argument("--synthetic", type=int, default=3000, help="synthetic benign hosts in train")
    ap.add_argument("--real", type=int, default=5000, help="installed-package files to sample")
    ap.add_argument("--prose", type=int, default=2000, help="README/docstring negatives from training packages")
    ap.add_argument("--mining-rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--l2", type=float, default=1e-5)
    ap.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    args = ap.parse_args(argv)
    t0 = time.time()
    corpus = build_corpus(args.bipia, args.synthetic, args.real)
    DATA_DIR.mkdir(exist_ok=True)
    hashes = {s: _write_jsonl(DATA_DIR / f"{s}.jsonl", corpus[s]) for s in ("dev", "test")}
    r = random.Random(SEED + 1)
    train = [d for d in corpus["train"] if d.label != "secret"] + benign_prose(random.Random(SEED + 2), args.prose)
    windows = [w for d in train for w in _windows(d, r, n_neg=2 if d.label == "benign" else 1)]
    log.info("train_windows", n=len(windows), positives=sum(int(label) for _, label in windows),
             seconds=round(time.time() - t0, 1))
    weights, bias = fit_mined(windows, train, args.epochs, args.l2, args.mining_rounds)
    scorer = NgramScorer(weights, bias, (1.0, 0.0))
    dev = [d for d in corpus["dev"] if d.label != "secret"]
    y_dev = np.array([d.label == "injection" for d in dev], dtype=float)
    dev_logits = _doc_logits(scorer, dev)
    platt = fit_platt(dev_logits, y_dev)
    metrics = {"dev_learned_auc": roc_auc(dev_logits, y_dev), "dev_learned_recall_at_1pct_fpr": recall_at_fpr(dev_logits, y_dev),
               "train_windows": len(windows), "train_seconds": round(time.time() - t0, 1)}
    meta = {"bits": BITS, "window": WINDOW, "ngrams": list(NGRAMS), "platt": list(platt), "seed": SEED,
            "data_sha256": {**hashes, "bipia": _hash_dir(args.bipia)}, "metrics": metrics,
            "epochs": args.epochs, "l2": args.l2, "mining_rounds": args.mining_rounds, "real_files": args.real, "prose_negatives": args.prose, "test_only": {"families": sorted(TEST_ONLY_FAMILIES), "benign": sorted(TEST_ONLY_BENIGN)}}
    args.out.parent.mkdir(exist_ok=True)
    np.savez_compressed(args.out, weights=weights.astype(np.float16), bias=np.float32(bias), meta=json.dumps(meta))
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("trained", **metrics, platt=platt)
    return meta


def _hash_dir(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


if __name__ == "__main__":
    main()
