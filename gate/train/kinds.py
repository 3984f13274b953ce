"""A held-out-BY-KIND injection set: tool-output kinds and attack kinds the models never trained on.

Split by source and kind, never by row:
  * attacks: only the BIPIA *train-file* categories that ``train_injection`` holds out of training
    (4 text, 3 code; recomputed from its seed) and the synthetic families it never trains on
    (``manipulate_output``, ``scam``);
  * hosts: kinds absent from every training set (package JSON and HTML files, config files and
    logs carrying credentials, lockfile/checksum look-alikes) and kinds seen only from *other*
    packages (READMEs / package METADATA, docstrings, source) drawn from the packages in the
    held-out hash buckets 8-9; plus the synthetic ``ticket`` and ``log`` kinds, test-only in training.
Every line has ``kind`` (host kind) and, for injections, ``attack`` (attack kind). Nothing here
comes from AgentDojo, bastioncorpus or the BIPIA test splits.
"""

from __future__ import annotations

import ast
import json
import random
import zlib
from pathlib import Path

import numpy as np

from gate.train import secretgen, synth
from gate.train.train_injection import BIPIA_DIR, SEED, TEST_ONLY_FAMILIES, _bipia, _split

MAX_CHARS = 600
KINDS_UNSEEN = ("pkg-json", "pkg-html", "config", "lookalike")
KINDS_OTHER_SOURCES = ("readme", "docstring", "source", "ticket", "log")


def held_out_attacks(bipia: Path = BIPIA_DIR) -> dict[str, list[str]]:
    """Attack texts of the kinds ``train_injection`` never trains on, keyed by attack kind."""
    r = random.Random(SEED)
    contexts, attacks = _bipia(bipia)
    for v in contexts.values():
        _split(v, r)
    text_cats, code_cats = sorted(attacks["text"]), sorted(attacks["code"])
    r.shuffle(text_cats)
    r.shuffle(code_cats)
    out = {f"bipia-text:{c}": attacks["text"][c] for c in text_cats[:4]}
    out |= {f"bipia-code:{c}": attacks["code"][c] for c in code_cats[:3]}
    g = random.Random(SEED + 1)
    out |= {f"synth:{fam}": [synth.injection(g, fam) for _ in range(40)] for fam in sorted(TEST_ONLY_FAMILIES)}
    return out


def package_bucket(name: str) -> int:
    """train_injection's split of installed packages: buckets 0-6 train, 7 dev, 8-9 test."""
    return zlib.crc32(name.encode()) % 10


def _held_packages() -> list[Path]:
    site = Path(np.__file__).resolve().parents[1]
    return [p for p in sorted(site.iterdir()) if p.is_dir() and package_bucket(p.name) >= 8]


def _chunk(r: random.Random, text: str) -> str:
    start = r.randint(0, max(0, len(text) - MAX_CHARS))
    return text[start : start + MAX_CHARS]


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef, ast.Module))]
    return [d for d in (ast.get_docstring(n) for n in nodes) if d and len(d) >= 250]


def host_texts(r: random.Random, per_kind: int) -> dict[str, list[str]]:
    """``per_kind`` benign tool outputs of every kind."""
    site = Path(np.__file__).resolve().parents[1]
    held = _held_packages()
    files = {ext: sorted(p for pkg in held for p in pkg.rglob(f"*{ext}")) for ext in (".py",)}
    # READMEs (package METADATA) of the held-out packages only: train_injection's benign-prose
    # negatives take the other packages' METADATA
    meta = [m for m in sorted(site.glob("*.dist-info/METADATA")) if package_bucket(m.parent.name.split("-")[0]) >= 7]
    jsons = sorted(p for p in site.rglob("*.json") if p.stat().st_size > 400)
    htmls = sorted(p for p in site.rglob("*.htm*") if p.stat().st_size > 400)
    out: dict[str, list[str]] = {}

    def sample(paths: list[Path], extract) -> list[str]:
        paths = paths[:]
        r.shuffle(paths)
        texts: list[str] = []
        for p in paths:
            try:
                pieces = extract(p)
            except (OSError, UnicodeDecodeError):
                continue
            texts += [_chunk(r, t) for t in pieces[:2] if len(t) >= 250]
            if len(texts) >= per_kind:
                break
        return texts[:per_kind]

    out["readme"] = sample(meta, lambda p: [p.read_text(encoding="utf-8").split("\n\n", 1)[-1]])
    out["docstring"] = sample(files[".py"], _docstrings)
    out["source"] = sample(files[".py"], lambda p: [p.read_text(encoding="utf-8")])
    out["pkg-json"] = sample(jsons, lambda p: [p.read_text(encoding="utf-8")])
    out["pkg-html"] = sample(htmls, lambda p: [p.read_text(encoding="utf-8")])
    fmts = [f for f in secretgen.FORMATS if not f.inline]
    out["config"] = [secretgen.carry(r, f, secretgen.credential(r, f), secretgen.CARRIERS[i % 7])
                     for i, f in enumerate(r.choices(fmts, k=per_kind))]
    out["lookalike"] = r.sample(secretgen.lookalikes(), per_kind)
    out["ticket"] = [synth.benign(r, "ticket") for _ in range(per_kind)]
    out["log"] = [synth.benign(r, "log")[:MAX_CHARS] for _ in range(per_kind)]
    return out


def build(per_kind: int = 16, injected_per_kind: int = 8, seed: int = 15, bipia: Path = BIPIA_DIR) -> list[dict]:
    """Rows {"text", "label", "kind", "attack"?}: per host kind ``per_kind`` benign and
    ``injected_per_kind`` carrying a held-out attack (attack kinds cycled)."""
    r = random.Random(seed)
    attacks = held_out_attacks(bipia)
    attack_kinds = sorted(attacks)
    rows = []
    for kind, texts in host_texts(r, per_kind + injected_per_kind).items():
        for text in texts[:per_kind]:
            rows.append({"text": text, "label": "benign", "kind": kind})
        for i, host in enumerate(texts[per_kind:]):
            ak = attack_kinds[(i + len(rows)) % len(attack_kinds)]
            text, _, _ = synth.insert(r, host, r.choice(attacks[ak]))
            rows.append({"text": text, "label": "injection", "kind": kind, "attack": ak})
    return rows


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="write the held-out-by-kind injection set as JSONL")
    ap.add_argument("--bipia", type=Path, default=BIPIA_DIR, help="BIPIA checkout (train files only are read)")
    for row in build(bipia=ap.parse_args().bipia):
        sys.stdout.write(json.dumps(row) + "\n")
