"""Decision latency of PolicyEngine.decide(): p50/p99 in microseconds, embedded and (where reachable) OPA.

`python -m policies.bench [--iterations N] [--opa-url URL]` prints the JSON. Inputs cycle through
clean, injected, secret-bearing and blocked-tool results so every rule family is exercised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from policies.engine import PolicyEngine

_GATES = [
    {"injection": 0.02, "secret": 0.0, "findings": []},
    {"injection": 0.93, "secret": 0.1, "findings": [{"kind": "injection", "rule_id": "ignore-previous", "layer": "regex", "score": 0.9}]},
    {"injection": 0.1, "secret": 0.97, "findings": [{"kind": "secret", "rule_id": "aws-key", "layer": "regex", "score": 1.0}]},
]
_INPUTS = [
    {"tenant": "bench", "user": "u", "session": {"id": "s", "age_s": 30.0, "tokens": 2048},
     "tool": tool, "span": {"bytes": 4096, "tokens": 900}, "gate": gate}
    for tool in ("web.fetch", "search.internal")
    for gate in _GATES
]


def _measure(engine: PolicyEngine, iterations: int) -> dict[str, Any]:
    for i in range(min(200, iterations)):  # warm up: per-thread compile, connection pool
        engine.decide(_INPUTS[i % len(_INPUTS)])
    samples: list[float] = []
    actions: dict[str, int] = {}
    for i in range(iterations):
        start = time.perf_counter_ns()
        decision = engine.decide(_INPUTS[i % len(_INPUTS)])
        samples.append((time.perf_counter_ns() - start) / 1000)
        actions[decision.action] = actions.get(decision.action, 0) + 1
    samples.sort()
    return {
        "iterations": iterations,
        "p50_us": round(samples[len(samples) // 2], 1),
        "p99_us": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 1),
        "mean_us": round(statistics.fmean(samples), 1),
        "actions": actions,
    }


def run_policy_bench(*, iterations: int = 5000, opa_url: str | None = None) -> dict:
    """p50/p99 decide() latency on the embedded engine, and on OPA at `opa_url` when given and reachable."""
    embedded = PolicyEngine()
    result: dict[str, Any] = {"bundle_hash": embedded.bundle_hash, "embedded": _measure(embedded, iterations)}
    if opa_url is None:
        result["opa"] = {"skipped": "no opa_url given"}
        return result
    opa = PolicyEngine(backend="opa", opa_url=opa_url)
    probe = opa.decide(_INPUTS[0])
    if probe.reasons[0].startswith("policy-error: "):
        result["opa"] = {"skipped": f"OPA at {opa_url} not usable: {probe.reasons[0]}"}
    else:
        result["opa"] = {"url": opa_url, **_measure(opa, iterations)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--opa-url", default=None)
    args = parser.parse_args()
    print(json.dumps(run_policy_bench(iterations=args.iterations, opa_url=args.opa_url), indent=2))


if __name__ == "__main__":
    main()
