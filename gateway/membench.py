"""`lethe bench memory`: many sessions against a KV budget a tenth of what they need.

What it checks, on a real gateway on loopback with the configured model: every request answers
200, or 503 `kv_budget_exhausted` with Retry-After (the client then waits and retries; the count of
each is reported with the overload: what the sessions need against the budget); RSS stays within
the budget plus a fixed overhead (the process before the load: weights, runtime, allocator);
every session's ledger holds its messages in order; every restore is verified (digest at
eviction), and at the end sampled sessions are restored and compared with a fresh prefill of their
tokens (exact: equal digests). Then one long session: restore from the offload tier against a
rebuild (prefill) of the same tokens.

The clients are threads of this process (their memory, a few MiB, is in the RSS figures).
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from .config import Settings
from .loadtest import ledger_matches
from .memstat import rss_bytes
from .service import Gateway

log = structlog.get_logger(__name__)

MB = 1 << 20


@dataclass
class Agent:
    """One session's client: the messages it sent, what came back."""

    n: int
    session_id: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    retried_503: int = 0
    refused_503_without_retry_after: int = 0
    problem: str = ""


def _tool_result(n: int, turn: int, rows: int) -> str:
    return "\n".join(f"store {n} turn {turn} row {i}: sku S{n}-{turn}-{i} qty {(i * 7 + turn + n) % 13}"
                     for i in range(rows))


def _post(http: httpx.Client, agent: Agent, max_tokens: int, retries: int) -> httpx.Response | None:
    headers = {"X-Lethe-Session": agent.session_id} if agent.session_id else {}
    for _ in range(retries + 1):
        response = http.post("/v1/chat/completions", headers=headers,
                             json={"model": "m", "messages": agent.messages, "max_tokens": max_tokens})
        agent.statuses.append(response.status_code)
        if response.status_code != 503:
            return response
        after = response.headers.get("retry-after")
        if after is None:
            agent.refused_503_without_retry_after += 1
            return response
        agent.retried_503 += 1
        time.sleep(float(after))
    return None


def _run_agent(base: str, key: str, agent: Agent, turns: int, rows: int, max_tokens: int, retries: int) -> Agent:
    agent.messages = [{"role": "system", "content": "You are an inventory agent."},
                      {"role": "user", "content": f"Check stock for store {agent.n}."}]
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=900) as http:
        for turn in range(turns):
            call = f"c{turn}"
            agent.messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call, "type": "function", "function": {"name": "inventory", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": call, "content": _tool_result(agent.n, turn, rows)}]
            response = _post(http, agent, max_tokens, retries)
            if response is None or response.status_code != 200:
                agent.problem = f"turn {turn}: " + ("503 after retries" if response is None else
                                                    f"HTTP {response.status_code} {response.text[:200]}")
                return agent
            agent.session_id = response.headers["x-lethe-session"]
            agent.messages.append({"role": "assistant",
                                   "content": response.json()["choices"][0]["message"]["content"] or ""})
        agent.messages.pop()  # the last reply reaches the ledger only with a next turn
        segments = http.get(f"/v1/sessions/{agent.session_id}/segments").json()["segments"]
    ok, problem = ledger_matches(segments, agent.messages)
    agent.problem = agent.problem or ("" if ok else problem)
    return agent


class RssSampler:
    """The process's RSS, sampled every `period_s` in a thread; `peak` is the most seen."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.peak = rss_bytes()
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.peak = max(self.peak, rss_bytes())


def _session_bytes(gw: Gateway, base: str, key: str, turns: int, rows: int, max_tokens: int) -> int:
    """What one finished session holds (measured: one agent run to the end, then released)."""
    agent = _run_agent(base, key, Agent(-1), turns, rows, max_tokens, retries=0)
    if agent.problem:
        raise RuntimeError(f"the sizing session failed: {agent.problem}")
    live = gw.sessions.get(agent.session_id)
    assert live is not None
    with live.lock:
        held = live.cache.nbytes
        gw.residency.release(live)
    return held


def _exact_restores(gw: Gateway, agents: list[Agent], sample: int) -> dict[str, Any]:
    """Restore sampled sessions (offloaded ones first) and compare with a fresh prefill."""
    offload = gw.residency.offload
    ids = [a.session_id for a in agents if a.session_id and not a.problem]
    offloaded = [s for s in ids if offload is not None and offload.copy_of(s) is not None]
    chosen = (offloaded + [s for s in ids if s not in offloaded])[:sample]
    exact = 0
    for sid in chosen:
        live = gw.sessions.get(sid)
        assert live is not None
        with live.lock:
            gw.residency.admit(live)
            tokens = live.cache.tokens
            same = not tokens or gw.compute(gw.p.kernel.prefill, tokens).digest() == live.cache.digest()
            gw.residency.settle(live)
        exact += same
    return {"checked": len(chosen), "offloaded_checked": len([s for s in chosen if s in offloaded]),
            "exact": exact}


def restore_vs_rebuild(gw: Gateway, tokens: int, reps: int) -> dict[str, Any]:
    """One `tokens`-token session: offload + verified restore against a rebuild (the prefill the
    pipeline runs for a dropped session), median of `reps`, on the gateway's own kernel."""
    kernel = gw.p.kernel
    record = gw.p.ledger.create_session("ses_membench_long", "membench", None)
    live = gw.sessions.resident(record)
    ids = [(i * 7919) % (kernel.model.config.vocab_size - 10) + 5 for i in range(tokens)]
    restore_s, rebuild_s, exact = [], [], True
    with live.lock:
        for _ in range(reps):
            started = time.perf_counter()
            rebuilt = gw.compute(kernel.prefill, ids)
            rebuild_s.append(time.perf_counter() - started)
            live.cache.wipe()
            live.cache = rebuilt
            live.ledger_mark = "bench"
            digest = rebuilt.digest()
            assert gw.residency.offload is not None
            gw.residency.offload.store(record.id, live.cache, "bench")
            gw.residency.drop(live)
            copy = gw.residency.offload.copy_of(record.id)
            assert copy is not None
            started = time.perf_counter()
            restored = gw.residency.offload.load(copy, kernel)
            restore_s.append(time.perf_counter() - started)
            exact &= restored.digest() == digest
            gw.residency.offload.discard(record.id)
            live.cache = restored
        gw.residency.release(live)
    rebuild, restore = statistics.median(rebuild_s), statistics.median(restore_s)
    return {"tokens": tokens, "reps": reps, "rebuild_s": round(rebuild, 4), "restore_s": round(restore, 4),
            "speedup": round(rebuild / restore, 2) if restore else None, "exact": exact}


def run_memory_bench(settings: Settings, *, sessions: int = 200, turns: int = 4, rows: int = 12,
                     max_tokens: int = 4, concurrency: int = 8, budget_share: float = 0.1,
                     retries: int = 20, sample: int = 16, long_tokens: int = 2000, reps: int = 3) -> dict[str, Any]:
    from .demo import local_gateway

    with local_gateway(settings, port=settings.port) as lg:  # LETHE_PORT: the bench listens there
        gw: Gateway = lg.app.state.lethe.gateway
        per_session = _session_bytes(gw, lg.base, lg.key, turns, rows, max_tokens)
        need = per_session * sessions
        budget = max(int(need * budget_share), 3 * per_session)
        gw.residency.budget = budget
        gw.residency.peak = 0
        baseline = rss_bytes()
        log.info("membench.start", sessions=sessions, turns=turns, per_session=per_session, budget=budget)
        started = time.perf_counter()
        with RssSampler() as rss, ThreadPoolExecutor(concurrency) as pool:
            agents = list(pool.map(lambda n: _run_agent(lg.base, lg.key, Agent(n), turns, rows, max_tokens, retries),
                                   range(sessions)))
        elapsed = time.perf_counter() - started
        statuses = [s for a in agents for s in a.statuses]
        metrics = gw.p.metrics
        exactness = _exact_restores(gw, agents, sample)
        long = restore_vs_rebuild(gw, long_tokens, reps)
        return {
            "sessions": sessions, "turns": turns, "concurrency": concurrency, "seconds": round(elapsed, 1),
            "overload": {"need_bytes": need, "budget_bytes": budget, "need_over_budget": round(need / budget, 2),
                         "per_session_bytes": per_session},
            "requests": len(statuses),
            "status": {str(code): statuses.count(code) for code in sorted(set(statuses))},
            "non_200_other_than_503_retry_after": sum(s not in (200, 503) for s in statuses)
            + sum(a.refused_503_without_retry_after for a in agents),
            "sessions_failed": [f"{a.n}: {a.problem}" for a in agents if a.problem][:10],
            "ledgers_intact": sum(1 for a in agents if not a.problem),
            "rss": {"baseline_bytes": baseline, "peak_bytes": rss.peak, "budget_bytes": budget,
                    "peak_over_baseline_bytes": rss.peak - baseline,
                    "peak_over_baseline_plus_budget_bytes": rss.peak - baseline - budget,
                    "accounted_peak_bytes": gw.residency.peak},
            "kv": {"evictions": {to: metrics.kv_evictions.labels(to)._value.get() for to in ("offloaded", "dropped")},
                   "offloads": metrics.kv_offloads._value.get(),
                   "restores": {r: metrics.kv_restores.labels(r)._value.get() for r in ("hit", "rebuilt")}},
            "restores_exact": exactness,
            "restore_vs_rebuild": long,
        }
