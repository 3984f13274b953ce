"""Reproducible training of the hidden-state injection probe (:mod:`gate.probe`).

    nice -n 10 python -m gate.train.train_probe          # writes gate/weights/probe_base.{npz,json}
    # then gate.train.probe_features + gate.train.probe_cv --ship refine it into the shipped probe.npz
    python -m gate.train.train_probe --full --threads 2  # the same, on whole documents
    # a probe for another LETHE_MODEL (its converted dir from `lethe prepare`), with the by-kind report:
    python -m gate.train.train_probe --model-dir var/models/<model> --out var/probe-<model>.npz --kinds gate/data/kinds.jsonl
    # quick and offline (no BIPIA, no package files): the synthetic corpus only, 40 documents per split
    python -m gate.train.train_probe --model-dir <dir> --out <path> --corpus synth --docs 40 --kinds gate/data/kinds.jsonl

Data: the same corpus and train/dev/test separation as ``train_injection`` (``build_corpus``,
same seed), subsampled to fit a CPU budget. Each document is cut to the plan's ``max_tokens``
(around the injection for positives, a random window for negatives; ``--full`` keeps whole
documents up to ``FULL_CAP`` tokens and searches only the layers and window the cut plan chose),
rendered as the tool message of a
short chat (system, user task, assistant tool call, tool) and prefilled through SmolLM2; the
tool message's token states of the candidate layers are cached in ``var/probe_features/``.
Layers, window and regularisation are chosen on dev; Platt calibration is fitted on dev; test is
scored once, at the end, together with the n-gram layer and the full gate on the same texts.

Another model: the candidate layers follow its depth (``candidate_layers``: SmolLM2's fixed list
for models at least as deep, else seven evenly spread depths), so any converted Llama-family
checkpoint trains; the probe records the model's identity and the gateway refuses it for others.
``--corpus synth`` replaces ``build_corpus`` (BIPIA + installed packages) by the synthetic
generators alone, split the same way (test-only families and kinds only in test).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from tqdm import tqdm

from gate.core import Gate
from gate.learned import NgramScorer
from gate.probe import PROBE_PATH, InjectionProbe, _logit, window_features
from gate.evaluate import recall_at_fpr, roc_auc
from gate.train.train_injection import BIPIA_DIR, DATA_DIR, SEED, Doc, build_corpus, fit_platt

log = structlog.get_logger(__name__)

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "var" / "models" / "SmolLM2-135M-Instruct"
CACHE_DIR = REPO / "var" / "probe_features"
BASE_PROBE_PATH = PROBE_PATH.with_name("probe_base.npz")
CANDIDATE_LAYERS = (3, 6, 9, 12, 15, 18, 21)
GRID_L2 = (1e-3, 1e-2, 1e-1)


@dataclass(frozen=True)
class Plan:
    """What a training run extracts and searches. ``max_tokens`` 0 keeps documents whole."""

    name: str
    layers: tuple[int, ...]  # extracted; every grid entry is a subset
    grid_layers: tuple[tuple[int, ...], ...]
    grid_windows: tuple[int, ...]
    max_tokens: int
    sample: dict[str, tuple[int, int]]  # documents per split: (injection, benign)


# Documents cut to 128 tokens around the injection; a wide search. Sized by the CPU budget.
CUT = Plan("cut", CANDIDATE_LAYERS, tuple((layer,) for layer in CANDIDATE_LAYERS) + ((9, 15), (12, 18), (6, 12, 18)),
           (16, 32, 64), 128, {"train": (240, 240), "dev": (150, 180), "test": (150, 180)})
# Whole documents (up to FULL_CAP tokens), the layers and window CUT selected: what the gateway sees,
# so long benign documents, whose many windows each get a chance to look like an injection, are
# negatives in training and in calibration.
FULL_CAP = 1024
FULL = Plan("full", (12, 18), ((12, 18),), (16,), 0, {"train": (360, 360), "dev": (200, 240), "test": (150, 180)})
# (user task, tool call): the conversation the tool result is prefilled after.
PREFIXES = [
    ("Summarize my latest email.", '{"name": "read_email", "arguments": {"folder": "inbox", "index": 0}}'),
    ("What does this table say about last quarter?", '{"name": "read_file", "arguments": {"path": "report.csv"}}'),
    ("Can you explain what this code does?", '{"name": "read_file", "arguments": {"path": "src/main.py"}}'),
    ("Find the docs page for this and tell me the key points.", '{"name": "fetch", "arguments": {"url": "https://example.com/docs"}}'),
    ("Check the API response and tell me if anything is wrong.", '{"name": "http_get", "arguments": {"url": "https://api.example.com/v1/items"}}'),
    ("Please look up this ticket and draft a reply.", '{"name": "get_ticket", "arguments": {"id": 4821}}'),
]


@dataclass
class Sample:
    text: str  # the cut document, as the tool message content
    label: int
    source: str
    prefix: int
    inj: tuple[int, int] | None  # injection token span inside ``text``'s tokens


def candidate_layers(model_dir: Path) -> tuple[int, ...]:
    """Layers to extract for this checkpoint: SmolLM2's list when the model is deep enough (the
    committed probe and its feature cache use it), else up to seven depths spread from 10% to 70%,
    never the last layer (whose state Hugging Face returns after the final norm, unlike the kernel)."""
    n = int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])
    if n >= max(CANDIDATE_LAYERS) + 2:
        return CANDIDATE_LAYERS
    return tuple(sorted({max(0, min(n - 2, round(f * n))) for f in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)}))


def plan_for(plan: Plan, layers: tuple[int, ...], docs: int | None) -> Plan:
    """``plan`` on another model's layers (singles, then adjacent pairs) and optionally ``docs``
    documents per split (half injected). The FULL plan keeps CUT's choice where it can."""
    if layers != CANDIDATE_LAYERS:
        grid = tuple((layer,) for layer in layers) + tuple(zip(layers, layers[1:]))
        plan = replace(plan, layers=layers, grid_layers=grid if plan.name == "cut" else (layers[-2:],))
    if docs:
        plan = replace(plan, sample={k: (docs // 2, docs - docs // 2) for k in plan.sample})
    return plan


def synth_corpus(n_per_split: int, seed: int = SEED) -> dict[str, list[Doc]]:
    """The synthetic generators alone, split as ``build_corpus`` splits them: the test-only
    injection families and benign kinds appear in test only. Offline and fast (for other models'
    probes and tests)."""
    from gate.train import synth
    from gate.train.train_injection import TEST_ONLY_BENIGN, TEST_ONLY_FAMILIES

    r = random.Random(seed)
    out: dict[str, list[Doc]] = {}
    for split in ("train", "dev", "test"):
        fams = [f for f in synth.FAMILIES if split == "test" or f not in TEST_ONLY_FAMILIES]
        kinds = [k for k in synth.BENIGN_KINDS if split == "test" or k not in TEST_ONLY_BENIGN]
        docs = []
        for i in range(n_per_split):
            host = synth.benign(r, kinds[i % len(kinds)])
            docs.append(Doc(host, "benign", f"synth-{kinds[i % len(kinds)]}"))
            fam = r.choice(fams)
            text, a, b = synth.insert(r, synth.benign(r, r.choice(kinds)), synth.injection(r, fam))
            docs.append(Doc(text, "injection", f"synth|synth:{fam}", (a, b)))
        out[split] = docs
    return out


def model_identity(model_dir: Path = MODEL_DIR) -> str:
    """sha256 over the safetensors tensors in name order (name, dtype, shape, bytes), as kvkernel."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        weights = load_file(f)
        for name in sorted(weights):
            t = weights[name].contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _cut(tok, doc: Doc, r: random.Random, max_tokens: int) -> tuple[str, tuple[int, int] | None]:
    """Cut ``doc`` to at most ``max_tokens`` tokens (0: FULL_CAP); a positive's window contains its injection."""
    enc = tok(doc.text, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    n = len(offs)
    limit = max_tokens or FULL_CAP
    if n <= limit:
        s = 0
    elif doc.span is None:
        s = r.randint(0, n - limit)
    else:
        ta = next(i for i, (a, b) in enumerate(offs) if b > doc.span[0])
        tb = next((i for i, (a, b) in enumerate(offs) if a >= doc.span[1]), n)
        lo, hi = (max(0, tb - limit), min(ta, n - limit)) if tb - ta <= limit else (ta, ta)
        s = r.randint(lo, max(lo, hi))
    e = min(n, s + limit)
    c0, c1 = offs[s][0], offs[e - 1][1]
    span = None if doc.span is None else (max(doc.span[0], c0) - c0, min(doc.span[1], c1) - c0)
    return doc.text[c0:c1], span


def _token_span(tok, text: str, span: tuple[int, int]) -> tuple[int, int]:
    offs = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    inside = [i for i, (a, b) in enumerate(offs) if b > span[0] and a < span[1]]
    return (inside[0], inside[-1] + 1) if inside else (0, 0)


def make_samples(tok, docs: list[Doc], split: str, r: random.Random, plan: Plan) -> list[Sample]:
    pool = [d for d in docs if d.label in ("injection", "benign")]
    r.shuffle(pool)
    n_inj, n_ben = plan.sample[split]
    chosen = [d for d in pool if d.label == "injection"][:n_inj] + [d for d in pool if d.label == "benign"][:n_ben]
    out = []
    for d in chosen:
        text, span = _cut(tok, d, r, plan.max_tokens)
        inj = _token_span(tok, text, span) if span is not None else None
        out.append(Sample(text, int(d.label == "injection"), d.source, r.randrange(len(PREFIXES)), inj))
    return out


class Extractor:
    """SmolLM2 truncated after the deepest candidate layer; chat prefixes prefilled once."""

    def __init__(self, model_dir: Path = MODEL_DIR, layers: tuple[int, ...] = CANDIDATE_LAYERS, threads: int = 1) -> None:
        """Loads ``model_dir`` (a Hugging Face safetensors checkpoint with its tokenizer)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.layers = list(layers)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        keep = max(layers) + 2  # hidden_states[-1] is final-normed: keep one layer past it
        model.model.layers = model.model.layers[:keep]
        model.config.num_hidden_layers = keep
        self.model = model.model
        self.prefix_ids = [self._ids(self.prefix_text(i)) for i in range(len(PREFIXES))]
        self.prefix_cache = [self._forward(ids, None)[1] for ids in self.prefix_ids]

    @staticmethod
    def prefix_text(i: int) -> str:
        task, call = PREFIXES[i]
        return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{task}<|im_end|>\n"
                f"<|im_start|>assistant\n<tool_call>{call}</tool_call><|im_end|>\n<|im_start|>tool\n")

    def _ids(self, text: str):
        return self.torch.tensor([self.tok(text, add_special_tokens=False)["input_ids"]])

    def _forward(self, ids, cache):
        with self.torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        return out.hidden_states, out.past_key_values

    def states(self, text: str, prefix: int) -> np.ndarray:
        """[n_tokens, len(self.layers), d] float16: the tool content's states after the prefix."""
        hs, _ = self._forward(self._ids(text), copy.deepcopy(self.prefix_cache[prefix]))
        return np.stack([hs[layer + 1][0].numpy() for layer in self.layers], axis=1).astype(np.float16)


@dataclass
class Split:
    samples: list[Sample]
    states: np.ndarray  # [total_tokens, n_layers, d] float16
    offsets: np.ndarray  # [n_docs + 1]
    layers: tuple[int, ...]

    def hidden(self, i: int) -> dict[int, np.ndarray]:
        s = self.states[self.offsets[i] : self.offsets[i + 1]]
        return {layer: s[:, j].astype(np.float32) for j, layer in enumerate(self.layers)}

    @property
    def y(self) -> np.ndarray:
        return np.array([s.label for s in self.samples])


def extract(ex: Extractor, name: str, samples: list[Sample], cache_dir: Path = CACHE_DIR) -> Split:
    layers = tuple(ex.layers)
    key = hashlib.sha256(json.dumps([[s.text, s.prefix] for s in samples] + [list(layers), PREFIXES]).encode()).hexdigest()[:16]
    path = cache_dir / f"{name}-{key}.npz"
    if path.is_file():
        with np.load(path) as z:
            return Split(samples, z["states"], z["offsets"], layers)
    t0, cpu0 = time.time(), time.process_time()
    chunks = [ex.states(s.text, s.prefix) for s in tqdm(samples, desc=f"states {name}", unit="doc", file=sys.stderr)]
    offsets = np.concatenate([[0], np.cumsum([c.shape[0] for c in chunks])])
    states = np.concatenate(chunks)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.savez(path, states=states, offsets=offsets)
    log.info("extracted", split=name, docs=len(samples), tokens=int(offsets[-1]), wall_s=round(time.time() - t0, 1),
             cpu_s=round(time.process_time() - cpu0, 1))
    return Split(samples, states, offsets, layers)


# ------------------------------------------------------------------------------- probe fitting

def _train_windows(split: Split, layers, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows that hold the injection are positives; windows clear of it, and all benign ones, negatives."""
    stride = window // 2
    xs, ys = [], []
    for i, s in enumerate(split.samples):
        feats = window_features(split.hidden(i), layers, window, stride)
        n = split.offsets[i + 1] - split.offsets[i]
        if s.inj is None:
            xs.append(feats)
            ys.append(np.zeros(len(feats)))
            continue
        starts = _starts(n, window, stride)
        a, b = s.inj
        overlap = np.array([max(0, min(st + window, n, b) - max(st, a)) for st in starts])
        need = min(window, n, b - a) / 2
        keep = (overlap >= need) | (overlap == 0)
        xs.append(feats[keep])
        ys.append((overlap[keep] >= need).astype(float))
    return np.concatenate(xs), np.concatenate(ys)


def _starts(n: int, window: int, stride: int) -> list[int]:
    """Window starts exactly as :func:`gate.probe.window_means` lays them out."""
    if n <= window:
        return [0]
    starts = list(range(0, n - window + 1, stride))
    return starts if starts[-1] == n - window else starts + [n - window]


def fit_logreg(x: np.ndarray, y: np.ndarray, l2: float,
               weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Class-balanced L2 logistic regression on standardised features (L-BFGS in torch); ``weight``
    scales each row's share within its class (the classes keep equal total weight)."""
    import torch

    mean, scale = x.mean(0), x.std(0) + 1e-6
    xt = torch.tensor((x - mean) / scale, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64)
    rw = torch.ones_like(yt) if weight is None else torch.tensor(weight, dtype=torch.float64)
    pos, neg = (rw * (yt == 1)).sum(), (rw * (yt == 0)).sum()
    sw = rw * torch.where(yt == 1, neg / pos.clamp(min=1e-12), torch.tensor(1.0, dtype=torch.float64))
    sw = sw / sw.mean()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt, weight=sw) + l2 * (w * w).sum())
        loss.backward()
        return loss

    opt.step(closure)
    return mean, scale, w.detach().numpy(), float(b.detach())


def _probe(layers, window, fitted, platt=(1.0, 0.0), identity="", meta=None) -> InjectionProbe:
    mean, scale, coef, intercept = fitted
    return InjectionProbe(tuple(layers), mean.size // len(layers), window, window // 2, mean, scale, coef, intercept,
                          platt, identity, meta or {})


def doc_logits(probe: InjectionProbe, split: Split) -> np.ndarray:
    return np.array([probe.logit({k: v for k, v in split.hidden(i).items() if k in probe.layers}) for i in range(len(split.samples))])


def _metrics(scores: np.ndarray, y: np.ndarray) -> dict:
    return {"recall_at_1pct_fpr": round(recall_at_fpr(scores, y), 4), "recall_at_5pct_fpr": round(recall_at_fpr(scores, y, 0.05), 4),
            "roc_auc": round(roc_auc(scores, y), 4)}


def _stack(p1: np.ndarray, p2: np.ndarray) -> np.ndarray:
    return np.array([[_logit(a), _logit(b)] for a, b in zip(p1, p2)])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bipia", type=Path, default=BIPIA_DIR)
    ap.add_argument("--out", type=Path, default=BASE_PROBE_PATH,
                    help="SmolLM2's default is the base probe that gate.train.probe_cv refines and ships as probe.npz")
    ap.add_argument("--full", action="store_true", help="train and calibrate on whole documents (plan FULL)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR,
                    help="converted checkpoint of the configured LETHE_MODEL (`lethe prepare` prints it)")
    ap.add_argument("--kinds", type=Path, default=None,
                    help="also report the held-out-by-kind evaluation on this JSONL (python -m gate.train.kinds)")
    ap.add_argument("--corpus", choices=("full", "synth"), default="full",
                    help="full: train_injection's corpus (BIPIA train files + installed packages); synth: synthetic only")
    ap.add_argument("--docs", type=int, default=None, help="documents per split (default: the plan's)")
    ap.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="where extracted states are cached")
    args = ap.parse_args(argv)
    plan = plan_for(FULL if args.full else CUT, candidate_layers(args.model_dir), args.docs)
    t0, cpu0 = time.time(), time.process_time()
    say = lambda msg: print(f"[train_probe] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"model {args.model_dir}; layers {list(plan.layers)}; corpus {args.corpus}; docs per split {plan.sample}")
    if args.corpus == "synth":
        corpus = synth_corpus(max(sum(v) for v in plan.sample.values()))
    else:
        corpus = build_corpus(args.bipia, 3000, 5000)  # train_injection's defaults: identical splits
        _check_same_data(corpus)
    ex = Extractor(args.model_dir, layers=plan.layers, threads=args.threads)
    r = random.Random(SEED + 7)
    plan_key = plan.name if args.model_dir == MODEL_DIR else f"{plan.name}-{ex_key(args.model_dir)}"
    splits = {name: extract(ex, f"{plan_key}-{name}", make_samples(ex.tok, corpus[name], name, r, plan), args.cache_dir)
              for name in ("train", "dev", "test")}
    say(f"states extracted ({round(time.time() - t0)} s); searching {len(plan.grid_layers) * len(plan.grid_windows) * len(GRID_L2)} settings on dev")
    extract_cpu = time.process_time() - cpu0
    train, dev, test = splits["train"], splits["dev"], splits["test"]

    # Selection on dev only: every (layers, window, l2) by dev recall at 1% and 5% FPR, then AUC.
    grid = []
    for layers in plan.grid_layers:
        for window in plan.grid_windows:
            x, y = _train_windows(train, layers, window)
            for l2 in GRID_L2:
                m = _metrics(doc_logits(_probe(layers, window, fit_logreg(x, y, l2)), dev), dev.y)
                grid.append({"layers": list(layers), "window": window, "l2": l2, **m})
                log.info("grid", **grid[-1])
    best = max(grid, key=lambda g: (g["recall_at_1pct_fpr"] + g["recall_at_5pct_fpr"], g["roc_auc"]))
    layers, window = tuple(best["layers"]), best["window"]
    x, y = _train_windows(train, layers, window)
    fitted = fit_logreg(x, y, best["l2"])
    dev_logit = doc_logits(_probe(layers, window, fitted), dev)
    platt = fit_platt(dev_logit, dev.y.astype(float))
    identity = model_identity(args.model_dir)
    meta = {"layers": list(layers), "hidden_size": int(fitted[0].size // len(layers)), "window": window, "stride": window // 2,
            "intercept": fitted[3], "platt": list(platt), "model_identity": identity, "seed": SEED, "plan": plan.name,
            "max_tokens": plan.max_tokens or FULL_CAP, "sample": plan.sample, "prefixes": PREFIXES, "l2": best["l2"], "train_windows": int(len(y)),
            "train_positive_windows": int(y.sum())}
    probe = _probe(layers, window, fitted, platt, identity, meta)

    # Test, once: probe, n-gram layer and full gate on the very same cut texts; stack fitted on dev.
    scores: dict[str, dict[str, np.ndarray]] = {}
    for name, split in (("dev", dev), ("test", test)):
        ngram, gate = _baselines([s.text for s in split.samples])
        probe_p = np.array([probe.score(split.hidden(i)) for i in range(len(split.samples))])
        scores[name] = {"ngram": ngram, "gate": gate, "probe": probe_p}
    mu, sc, c, b = fit_logreg(_stack(scores["dev"]["probe"], scores["dev"]["gate"]), dev.y.astype(float), 1e-4)
    stack = {"coef": (c / sc).tolist(), "intercept": float(b - (c * mu / sc).sum())}  # on raw logits
    probe = replace(probe, meta={**meta, "stack": stack})
    metrics: dict[str, dict[str, Any]] = {}
    for name, split in (("dev", dev), ("test", test)):
        s = scores[name]
        s["max(probe,gate)"] = np.maximum(s["probe"], s["gate"])
        s["stack(probe,gate)"] = np.array([probe.combine(a, b) for a, b in zip(s["probe"], s["gate"])])
        metrics[name] = {"docs": len(split.samples), "positives": int(split.y.sum()),
                         **{k: _metrics(v, split.y) for k, v in s.items()}}
        metrics[name]["probe"]["by_source_recall_at_0.5"] = _by_source(split, s["probe"])
        metrics[name]["probe"]["worst"] = _worst(split, s["probe"])
    meta.update(metrics=metrics, selection_grid=grid, stack=stack,
                cpu_s={"extraction_and_setup": round(extract_cpu, 1), "total": round(time.process_time() - cpu0, 1)},
                wall_s=round(time.time() - t0, 1))
    args.out.parent.mkdir(exist_ok=True)
    np.savez_compressed(args.out, mean=fitted[0].astype(np.float32), scale=fitted[1].astype(np.float32),
                        coef=fitted[2].astype(np.float32), meta=json.dumps(meta))
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("trained", best=best, dev=metrics["dev"], test=metrics["test"])
    say(f"wrote {args.out}: layers {list(layers)}, window {window}; test recall@1%FPR probe "
        f"{metrics['test']['probe']['recall_at_1pct_fpr']}, stack {metrics['test']['stack(probe,gate)']['recall_at_1pct_fpr']}")
    if args.kinds is not None:
        from gate.evaluate import load_rows, scan_rows
        from gate.train.eval_full import stack_scores
        from gate.train.kind_eval import evaluate, policy_thresholds

        rows = load_rows(args.kinds)
        byte = scan_rows(rows, Gate())[0]["injection"]
        probe_p, stacked, _ = stack_scores(rows, byte, name=f"{args.kinds.stem}-{identity[:12]}", threads=args.threads,
                                           probe=InjectionProbe.load(args.out), model_dir=args.model_dir,
                                           cache_dir=args.cache_dir)
        meta["held_out_by_kind"] = report = evaluate(rows, byte, probe_p, stacked, policy_thresholds()["injection"])
        args.out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
        say(f"held out by kind ({args.kinds}): stack recall@1%FPR {report['stack_shipped']['recall_at_1pct_fpr']}; per kind "
            + ", ".join(f"{k} {v['recall_at_1pct_fpr']}" for k, v in report["stack_shipped"]["by_kind"].items()))
    return meta


def ex_key(model_dir: Path) -> str:
    """A short cache key for another model's states: its directory name and config."""
    return hashlib.sha256((Path(model_dir).name + (Path(model_dir) / "config.json").read_text()).encode()).hexdigest()[:10]


def _baselines(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The n-gram layer alone and the full gate (rules + heuristics + n-gram), calibrated probabilities."""
    ngram, gate = NgramScorer.load(), Gate()
    data = [t.encode() for t in texts]
    return (np.array([ngram.probability(ngram.best_window(d).logit) for d in data]),
            np.array([gate.scan(d).injection for d in data]))


def _by_source(split: Split, p: np.ndarray) -> dict:
    out: dict[str, list[int]] = {}
    for s, pi in zip(split.samples, p):
        if s.label:
            tag = s.source.split("|")[1].rsplit(":", 1)[0]
            out.setdefault(tag, []).append(int(pi >= 0.5))
    return {k: [round(float(np.mean(v)), 3), len(v)] for k, v in sorted(out.items())}


def _worst(split: Split, p: np.ndarray, k: int = 5) -> dict:
    """Highest-scoring negatives and lowest-scoring positives: what the probe gets wrong, for the README."""
    y = split.y
    neg, pos = np.flatnonzero(y == 0), np.flatnonzero(y == 1)
    show = lambda i: {"p": round(float(p[i]), 3), "source": split.samples[i].source, "text": split.samples[i].text[:100]}  # noqa: E731
    return {"negatives": [show(i) for i in neg[np.argsort(-p[neg])][:k]], "positives": [show(i) for i in pos[np.argsort(p[pos])][:k]]}


def _check_same_data(corpus: dict[str, list[Doc]]) -> None:
    """Refuse to train if build_corpus no longer reproduces the shipped dev/test files."""
    for name in ("dev", "test"):
        lines = [json.dumps({"text": d.text, "label": d.label, "source": d.source}, ensure_ascii=False) for d in corpus[name]]
        if ("\n".join(lines) + "\n").encode() != (DATA_DIR / f"{name}.jsonl").read_bytes():
            raise SystemExit(f"build_corpus does not reproduce gate/data/{name}.jsonl; rerun gate.train.train_injection first")


if __name__ == "__main__":
    main()
