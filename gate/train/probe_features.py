"""Cached multi-layer window features for probe training and leave-kind-out cross-validation.

    nice -n 10 python -m gate.train.probe_features --threads 2     # wide set and both rounds of contrast kinds

Why: fitting and cross-validating a probe must take seconds, but SmolLM2's states of ~2,500
documents take tens of minutes on a shared CPU. Each document is prefilled once (as the tool
message after one of the chat prefixes, at most ``MAX_TOKENS`` tokens) and what any candidate
probe reads is stored: the mean state of every ``WINDOW``-token window (stride ``WINDOW // 2``,
exactly :func:`gate.probe.window_means`) for each of ``LAYERS``, concatenated, float16. A wider
window is an average of these. Extraction is resumable (chunks saved as they finish).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gate.probe import window_features
from gate.train.train_probe import CACHE_DIR, CUT, PREFIXES, SEED, Extractor, make_samples

LAYERS = (6, 9, 12, 15, 18)
WINDOW = 16
MAX_TOKENS = 512
CHUNK = 25
WIDE = Path(__file__).resolve().parents[1] / "data" / "kinds_wide.jsonl"
# Hand-written red-team sets that may be trained on (``redteam_rows``): ``fresh_redteam_s*``, sets
# already used to judge a shipped probe (a set not listed here stays held out), and
# ``redteam_train_t*``, sets written for training only. Append only: a row's random chat prefix
# depends on the rows before it.
REDTEAM_TRAIN = ("fresh_redteam_s4.jsonl", "fresh_redteam_s5.jsonl", "fresh_redteam_s6.jsonl", "fresh_redteam_s7.jsonl",
                 "fresh_redteam_s8.jsonl", "fresh_redteam_s9.jsonl", "redteam_train_t1.jsonl", "redteam_train_t2.jsonl",
                 "redteam_train_t3.jsonl", "fresh_redteam_s10.jsonl", "fresh_redteam_s11.jsonl", "redteam_train_t7.jsonl",
                 "redteam_train_t4.jsonl", "redteam_train_t5.jsonl", "redteam_train_t6.jsonl",
                 "fresh_redteam_s12.jsonl", "fresh_redteam_s13.jsonl", "fresh_redteam_s14.jsonl",
                 "redteam_train_t8.jsonl", "fresh_redteam_s15.jsonl")
# The sets a probe setting may train on besides the wide set and the corpus (``load_all``'s names).
TRAINING_SETS = ("contrast", "contrast-extra", "contrast-third", "contrast-fourth", "redteam")


@dataclass
class FeatureSet:
    """Rows (``text``, ``label``, ``kind``, optional ``attack`` and ``tokens`` = injection token span) and their windows."""

    rows: list[dict]
    feats: list[np.ndarray]  # per row [n_windows, len(LAYERS) * d] float16

    @property
    def y(self) -> np.ndarray:
        return np.array([r["label"] == "injection" for r in self.rows], dtype=float)

    def layer_slice(self, layers: tuple[int, ...], d: int = 576) -> np.ndarray:
        """Column indices of ``layers`` inside the stored concatenation."""
        if not layers:
            return np.zeros(0, dtype=int)
        return np.concatenate([np.arange(LAYERS.index(layer) * d, (LAYERS.index(layer) + 1) * d) for layer in layers])


def _truncate(tok, text: str) -> str:
    offs = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text if len(offs) <= MAX_TOKENS else text[: offs[MAX_TOKENS - 1][1]]


def _token_span(tok, text: str, span: list[int]) -> list[int]:
    offs = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    inside = [i for i, (a, b) in enumerate(offs) if b > span[0] and a < span[1]]
    return [inside[0], inside[-1] + 1] if inside else [0, 0]


def _cache_path(name: str, rows: list[dict], cache_dir: Path) -> Path:
    key = hashlib.sha256(json.dumps([[r["text"], r["prefix"]] for r in rows] + [LAYERS, WINDOW, PREFIXES]).encode()).hexdigest()[:16]
    return cache_dir / f"cv-{name}-{key}.npz"


def _read_parts(parts: Path) -> dict[int, list[np.ndarray]]:
    """Chunk number -> its rows' window features, for the chunks saved so far."""
    table = {}
    for part in sorted(parts.glob("*.npz")):
        with np.load(part) as z:
            table[int(part.stem)] = np.split(z["feats"], z["offsets"][1:-1])
    return table


def chunk_order(n_rows: int) -> list[int]:
    """Chunks are extracted in a fixed shuffled order, so an unfinished extraction has a random
    sample of the set's kinds rather than its first kinds (the wide set is sorted by kind)."""
    return [int(k) for k in np.random.default_rng(15).permutation(-(-n_rows // CHUNK))]


def extract_set(name: str, rows: list[dict], make_ex, cache_dir: Path = CACHE_DIR) -> FeatureSet:
    """Window features of ``rows`` (each with ``text`` and ``prefix``), cached under ``name`` and content."""
    path = _cache_path(name, rows, cache_dir)
    parts = path.with_suffix(".parts")
    if not path.is_file():
        parts.mkdir(parents=True, exist_ok=True)
        ex, t0 = None, time.time()
        for c in tqdm(chunk_order(len(rows)), desc=f"states {name}", unit=f"x{CHUNK}doc", file=sys.stderr):
            part = parts / f"{c:05d}.npz"
            if part.is_file():
                continue
            ex = ex or make_ex()
            feats = [_windows(ex, r) for r in rows[c * CHUNK : (c + 1) * CHUNK]]
            np.savez(part, feats=np.concatenate(feats), offsets=np.concatenate([[0], np.cumsum([len(f) for f in feats])]))
        done = _read_parts(parts)
        table = [f for c in sorted(done) for f in done[c]]
        np.savez(path, feats=np.concatenate(table), offsets=np.concatenate([[0], np.cumsum([len(f) for f in table])]))
        print(f"[probe_features] {name}: {len(rows)} docs in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    with np.load(path) as z:
        return FeatureSet(rows, np.split(z["feats"], z["offsets"][1:-1]))


def cached_set(name: str, rows: list[dict], cache_dir: Path = CACHE_DIR) -> FeatureSet | None:
    """What is cached of ``rows`` without running the model: the whole set, or the rows of the
    chunks an unfinished extraction has saved (see ``chunk_order``), or None."""
    path = _cache_path(name, rows, cache_dir)
    if path.is_file():
        with np.load(path) as z:
            return FeatureSet(rows, np.split(z["feats"], z["offsets"][1:-1]))
    done = _read_parts(path.with_suffix(".parts")) if path.with_suffix(".parts").is_dir() else {}
    chunks = sorted(done)
    return FeatureSet([r for c in chunks for r in rows[c * CHUNK : (c + 1) * CHUNK]], [f for c in chunks for f in done[c]]) if chunks else None


def _windows(ex: Extractor, row: dict) -> np.ndarray:
    states = ex.states(row["text"], row["prefix"])
    hidden = {layer: states[:, j].astype(np.float32) for j, layer in enumerate(ex.layers)}
    return window_features(hidden, LAYERS, WINDOW, WINDOW // 2).astype(np.float16)


def wide_rows(tok, path: Path = WIDE) -> list[dict]:
    """The held-out-by-kind wide set, each row prefixed as ``eval_full`` does (line number)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{**r, "text": _truncate(tok, r["text"]), "prefix": i % len(PREFIXES)} for i, r in enumerate(rows)]


def contrast_rows(tok, round_: int = 1) -> list[dict]:
    """A round of contrast kinds: 1 :func:`gate.train.contrast.rows`, 2 its ``extra_rows``, 3
    :func:`gate.train.contrast3.third_rows`, 4 :func:`gate.train.contrast4.fourth_rows`."""
    from gate.train import contrast, contrast3, contrast4

    r = random.Random(SEED + 14 + round_)
    out = []
    for row in {1: contrast.rows, 2: contrast.extra_rows, 3: contrast3.third_rows, 4: contrast4.fourth_rows}[round_]():
        out.append(_spanned(tok, row, row.get("span")) | {"prefix": r.randrange(len(PREFIXES))})
    return out


def _spanned(tok, row: dict, span: list[int] | None) -> dict:
    """``row`` truncated to ``MAX_TOKENS``, with ``tokens``, the token span of its injection's
    characters ``span`` when it has one ([0, 0] when the truncation cut the injection off: the text
    the model reads is then clean, every window a negative); without one, multiple-instance."""
    text = _truncate(tok, row["text"])
    return {**row, "text": text, **({"tokens": _token_span(tok, text, span)} if span else {})}


def redteam_rows(tok) -> list[dict]:
    """The red-team sets of ``REDTEAM_TRAIN``, each row prefixed at random and truncated as the
    other sets. An injected row that names its ``injected`` passage gets that passage's token span;
    one that does not (s4-s10, t8) is multiple-instance, as the wide set's."""
    r = random.Random(SEED + 20)
    out = []
    for name in REDTEAM_TRAIN:
        for line in (WIDE.parent / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            at = row["text"].find(row["injected"]) if "injected" in row else -1
            span = [at, at + len(row["injected"])] if at >= 0 else None
            out.append(_spanned(tok, row, span) | {"kind": "redteam:" + row["kind"], "prefix": r.randrange(len(PREFIXES)), "set": name})
    return out


def corpus_rows(tok, bipia: Path) -> list[dict]:
    """``train_probe``'s CUT samples of the train and dev splits (never test: its attack families
    are the wide set's), as rows with a kind per source."""
    from gate.train.train_injection import build_corpus

    corpus = build_corpus(bipia, 3000, 5000)
    r = random.Random(SEED + 7)
    out = []
    for split in ("train", "dev"):
        for s in make_samples(tok, corpus[split], split, r, CUT):
            kind = "corpus:" + s.source.split("|")[0].split(":")[0].split("/")[0]
            row: dict[str, Any] = {"text": s.text, "label": "injection" if s.label else "benign", "kind": kind, "prefix": s.prefix, "split": split}
            if s.inj is not None:
                row.update(attack="corpus:" + s.source.split("|")[-1].rsplit(":", 1)[0], tokens=list(s.inj))
            out.append(row)
    return out


def load_all(threads: int = 2, bipia: Path | None = None, cache_dir: Path = CACHE_DIR, extract: bool = True,
             names: tuple[str, ...] = ("wide", "contrast", "corpus")) -> dict[str, FeatureSet]:
    """The sets ``wide``, ``contrast``, ``contrast-extra``, ``contrast-third``, ``contrast-fourth``, ``redteam``, ``corpus``: extracting what is missing, or (``extract``
    False) only what is cached, partial sets included."""
    from transformers import AutoTokenizer

    from gate.train.train_injection import BIPIA_DIR
    from gate.train.train_probe import MODEL_DIR

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    make_ex = lambda: Extractor(layers=LAYERS, threads=threads)  # noqa: E731
    sets = {"wide": lambda: wide_rows(tok), "contrast": lambda: contrast_rows(tok),
            "contrast-extra": lambda: contrast_rows(tok, 2), "contrast-third": lambda: contrast_rows(tok, 3),
            "contrast-fourth": lambda: contrast_rows(tok, 4), "corpus": lambda: corpus_rows(tok, bipia or BIPIA_DIR)}
    load = (lambda name, rows: extract_set(name, rows, make_ex, cache_dir)) if extract else \
        (lambda name, rows: cached_set(name, rows, cache_dir))
    found = {name: load(name, sets[name]()) if name != "redteam" else _per_file(redteam_rows(tok), load)
             for name in names}
    return {k: v for k, v in found.items() if v is not None}


def _per_file(rows: list[dict], load) -> FeatureSet | None:
    """The red-team set cached file by file (``redteam-<file>``), so a file added to ``REDTEAM_TRAIN``
    costs only its own rows' states; what is cached of each, concatenated."""
    parts = [load(f"redteam-{name}", [r for r in rows if r["set"] == name]) for name in REDTEAM_TRAIN]
    parts = [p for p in parts if p is not None]
    return FeatureSet([r for p in parts for r in p.rows], [f for p in parts for f in p.feats]) if parts else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bipia", type=Path, default=None)
    ap.add_argument("--sets", nargs="*", default=["wide", *TRAINING_SETS], help=f"of: wide {' '.join(TRAINING_SETS)} corpus")
    args = ap.parse_args(argv)
    for name, fs in load_all(args.threads, args.bipia, names=tuple(args.sets)).items():
        print(f"{name}: {len(fs.rows)} docs, {sum(len(f) for f in fs.feats)} windows", file=sys.stderr)


if __name__ == "__main__":
    main()
