"""Gate throughput and latency benchmark (JSON out; never a timed assertion in tests).

Corpus: deterministic mixed benign text from gate.train.synth (code, JSON, HTML, prose email,
logs, READMEs, tables), concatenated to ``megabytes`` MB. Measured on one thread:
  * rules layer MB/s: secret rules (Hyperscan pass + confirmation) and the injection rule
    screen (Hyperscan pass), the part that must keep up at >= 100 MB/s;
  * learned layer MB/s and tokens/s (tokens = ``\\w+|[^\\w\\s]`` pieces, about 1 per 4 bytes);
  * the hidden-state probe's read-out tokens/s (its states come with the prefill);
  * full ``Gate.scan`` p50/p99 latency on 4 KB and 64 KB results;
  * secret findings on the benign corpus (false positives per 10 MB);
  * secret recall per format on generated credentials in carriers and false positives per 10 MB
    of real installed-package text (``gate.evaluate.evaluate_secrets``);
  * the byte gate on the held-out-by-kind injection set (``gate.train.kind_eval``).

``python -m gate.bench bound``: the time bound (``run_bound_bench``), crafted worst cases from
32 KB to the 256 KB tool-result limit. ``python -m gate.bench peers --bin <venv>/bin``: secrets
side by side with CredSweeper and detect-secrets (``gate.peers``).
"""

from __future__ import annotations

import os
import random
import re
import sys
import time
from functools import partial
from typing import Any

import numpy as np

from .core import Gate
from .probe import InjectionProbe
from .train import synth
from .worst import TOOL_RESULT_LIMIT, WORST_CASES, every_rule_tail, with_tail

_TOKEN = re.compile(rb"\w+|[^\w\s]")


def benign_corpus(megabytes: int, seed: int = 7) -> bytes:
    r = random.Random(seed)
    kinds = sorted(synth.BENIGN_KINDS)
    parts, size = [], 0
    while size < megabytes * 1_000_000:
        doc = synth.benign(r, r.choice(kinds)).encode() + b"\n\n"
        parts.append(doc)
        size += len(doc)
    return b"".join(parts)


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data) - size + 1, size)]


def _best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_gate_bench(*, megabytes: int = 10, progress: bool = True) -> dict:
    say = partial(print, file=sys.stderr) if progress else (lambda *a, **k: None)
    gate = Gate()
    corpus = benign_corpus(megabytes)
    mb = len(corpus) / 1e6
    say(f"corpus: {mb:.1f} MB benign")
    blocks = _chunks(corpus, 1 << 20)

    def rules_layer() -> None:
        for block in blocks:
            gate.secrets.scan(block)
            gate.heuristics.matcher.triggered(block)

    rules_s = _best_of(rules_layer)
    secrets_s = _best_of(lambda: [gate.secrets.scan(b) for b in blocks])
    say(f"rules layer: {mb / rules_s:.1f} MB/s")
    scorer = gate.heuristics.scorer
    if scorer is None:
        raise RuntimeError("the gate has no learned n-gram scorer (its weights are missing): reinstall the package")
    learned_s = _best_of(lambda: [scorer.best_window(b) for b in blocks], repeats=2)
    tokens = len(_TOKEN.findall(corpus))
    say(f"learned layer: {mb / learned_s:.1f} MB/s")
    probe_tokens_s = _probe_readout_tokens_s()
    say(f"probe read-out: {probe_tokens_s:.0f} tokens/s")
    secret_fps = [f.rule_id for b in _chunks(corpus, 64 << 10) for f in gate.secrets.scan(b)]
    latency = {}
    for label, size, n in (("4kb", 4 << 10, 300), ("64kb", 64 << 10, 100)):
        samples = _chunks(corpus, size)[:n]
        times = []
        for s in samples:
            t0 = time.perf_counter()
            gate.scan(s)
            times.append((time.perf_counter() - t0) * 1e3)
        latency[label] = {"p50_ms": round(float(np.percentile(times, 50)), 3),
                          "p99_ms": round(float(np.percentile(times, 99)), 3), "n": len(times)}
        say(f"latency {label}: {latency[label]}")
    say("secrets: generated credentials of every format, and real package text")
    from .evaluate import evaluate_secrets

    secrets = evaluate_secrets(gate, megabytes=megabytes)
    say(f"secrets: recall {secrets['recall']} on {secrets['credentials']}, {secrets['false_positives_per_10mb']} FP/10 MB")
    from .evaluate import BLIND_SECRET_SETS, DATA_DIR, evaluate_secret_set

    blind = [evaluate_secret_set(DATA_DIR / name, gate) for name in BLIND_SECRET_SETS]
    say(f"secrets, sets written blind: {[(b['set'], b['recall'], b['benign_rows_flagged']) for b in blind]}")
    return {
        "secrets": {k: v for k, v in secrets.items() if k != "recall_by_format"} | {
            "formats_below_1": {k: v for k, v in secrets["recall_by_format"].items() if v < 1}},
        "secrets_blind_sets": blind,
        "injection_by_kind": _by_kind(gate, say),
        "injection_leave_kinds_out": shipped_cv(),
        "corpus_mb": round(mb, 2),
        "rules_layer_mb_s": round(mb / rules_s, 1),
        "secrets_only_mb_s": round(mb / secrets_s, 1),
        "learned_layer_mb_s": round(mb / learned_s, 2),
        "learned_layer_tokens_s": round(tokens / learned_s),
        "probe_readout_tokens_s": round(probe_tokens_s),
        "probe_readout_note": "cost of scoring hidden states the staged prefill already computed",
        "secret_false_positives": len(secret_fps),
        "secret_false_positives_per_10mb": round(len(secret_fps) / mb * 10, 2),
        "secret_false_positive_rules": sorted(set(secret_fps)),
        "latency": latency,
        "threads": 1,
    }


def shipped_cv() -> dict:
    """The shipped probe stack's leave-kinds-out figures, as its training command recorded them in
    its weights (recomputing them needs the cached model states: ``python -m gate.train.probe_cv
    --cv``); so that the bench's JSON carries the issue's numbers with where they came from."""
    meta = InjectionProbe.load().meta
    cv = meta["cross_validated"]
    return {"source": "recorded by `python -m gate.train.probe_cv --ship` in gate/weights/probe.json; "
                      "recompute with `python -m gate.train.probe_cv --cv`",
            "setting": meta["setting"], "host_folds": meta["host_folds"], "attack_folds": meta["attack_folds"],
            "policy_threshold": meta["policy_threshold"],
            **{k: cv[k] for k in ("recall_at_1pct_fpr", "auc", "ece", "at_training_fold_threshold",
                                  "at_shipped_threshold", "by_kind", "by_attack_recall_at_1pct_fpr")}}


def _by_kind(gate: Gate, say) -> dict:
    """The byte gate on the held-out-by-kind set (gate.train.kinds); the stack needs the model:
    ``python -m gate.train.kind_eval --probe``."""
    from .train.kind_eval import evaluate, policy_thresholds
    from .train.kinds import build
    from .evaluate import scan_rows

    try:
        rows = build()
    except OSError as exc:  # the held-out attacks come from BIPIA's train files
        return {"skipped": f"BIPIA train files not found ({exc}); pass them to gate.train.kinds --bipia"}
    byte = scan_rows(rows, gate)[0]["injection"]
    result = evaluate(rows, byte, None, None, policy_thresholds()["injection"])
    say(f"injection by kind (byte gate): recall@1%FPR {result['byte_gate']['recall_at_1pct_fpr']}")
    return result


def _probe_readout_tokens_s(tokens: int = 4096) -> float:
    """The hidden-state probe's own cost: states come free with the prefill, the read-out does not."""
    probe = InjectionProbe.load()
    rng = np.random.default_rng(0)
    hidden = {layer: rng.standard_normal((tokens, probe.hidden_size)).astype(np.float32) for layer in probe.layers}
    return tokens / _best_of(lambda: probe.score(hidden), repeats=5)


def scan_seconds(gate: Gate, data: bytes, repeats: int = 3) -> float:
    """Best-of CPU seconds of one ``Gate.scan`` on this thread (CPU, not wall: less hurt by load)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        gate.scan(data)
        best = min(best, time.thread_time() - t0)
    return best


def run_bound_bench(*, sizes: tuple[int, ...] = (32 << 10, 64 << 10, 128 << 10, TOOL_RESULT_LIMIT),
                    budget_ms: float = 100.0, progress: bool = True) -> dict:
    """The gate's time bound: every crafted worst case (gate.worst), each followed by one example of
    every rule so every confirmation runs, scanned at each size on one thread."""
    say = partial(print, file=sys.stderr) if progress else (lambda *a, **k: None)
    gate = Gate()
    tail = every_rule_tail()
    families: dict[str, dict[str, Any]] = {}
    for name, build in WORST_CASES.items():
        ms = {n: round(scan_seconds(gate, with_tail(build, tail)(n)) * 1e3, 2) for n in sizes}
        families[name] = {"ms": {str(n): v for n, v in ms.items()},
                          "ratio_max_to_min_size": round(ms[sizes[-1]] / max(ms[sizes[0]], 1e-3), 2)}
        say(f"{name}: {ms}")
    worst = max(families, key=lambda k: families[k]["ms"][str(sizes[-1])])
    benign_ms = round(scan_seconds(gate, benign_corpus(1)[: sizes[-1]]) * 1e3, 2)
    return {
        "benign_ms_at_limit": benign_ms,
        "worst_over_benign": round(families[worst]["ms"][str(sizes[-1])] / benign_ms, 2),
        "sizes": list(sizes),
        "size_ratio": sizes[-1] / sizes[0],
        "budget_ms_at_limit": budget_ms,
        "over_budget": sorted(k for k, v in families.items() if v["ms"][str(sizes[-1])] > budget_ms),
        "worst_family": worst,
        "worst_ms_at_limit": families[worst]["ms"][str(sizes[-1])],
        "max_ratio": max(v["ratio_max_to_min_size"] for v in families.values()),
        "clock": "thread CPU time, best of 3, one thread (inflated on a loaded host: compare with benign_ms_at_limit)",
        "load_average_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "families": families,
    }


def main(argv: list[str] | None = None) -> dict:
    """``gate`` (default): throughput, latency and detection; ``bound``: the time bound;
    ``peers``: secrets side by side with CredSweeper and detect-secrets (:mod:`gate.peers`)."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m gate.bench", description=main.__doc__)
    ap.add_argument("what", nargs="?", choices=("gate", "bound", "peers"), default="gate")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry with `lethe bench`; output is always JSON")
    ap.add_argument("--bin", type=Path, default=None, help="peers: the bin directory of the environment holding them")
    ap.add_argument("--megabytes", type=float, default=10.0, help="benign text to scan (gate, peers)")
    ap.add_argument("--blind-sets", action="store_true", help="peers: the secret sets written blind, not the generated corpus")
    args = ap.parse_args(argv)
    if args.what == "bound":
        return run_bound_bench()
    if args.what == "peers":
        from .peers import run_peers_bench

        from .evaluate import BLIND_SECRET_SETS

        return run_peers_bench(args.bin, megabytes=args.megabytes, sets=BLIND_SECRET_SETS if args.blind_sets else ())
    return run_gate_bench(megabytes=int(args.megabytes))


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
