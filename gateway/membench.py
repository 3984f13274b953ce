"""`lethe bench memory`: many sessions against a KV budget a tenth of what they need.

What it checks, on a real gateway on loopback with the configured model: every request answers
200, or 503 `kv_budget_exhausted` with Retry-After (the client then waits and retries; the count of
each is reported with the overload: what the sessions need against the budget); RSS stays within
the budget plus a stated overhead over the process before the load (`memstat.overhead_bytes`, for
the turn threads the load brought up);
every session's ledger holds its messages in order; every restore is verified (digest at
eviction), and at the end sampled offloaded sessions are restored and compared with a fresh
prefill of their tokens (exact: equal digests). Then one long session: a verified restore from the
offload tier against a rebuild of the same session from its ledger.

The sessions take their turns round by round (every session's turn 1, then every session's turn
2, ...), so with a budget of a tenth nearly every turn after the first finds its session evicted
and restores it: the load exercises eviction, offload and restore, not one session's hot cache.
Turns are short (a few tool-result rows, `max_tokens` 2): the bench is about memory, not
generation. Progress goes to stderr every few seconds; the result is one JSON object.

The clients are threads of this process (their memory, a few MiB, is in the RSS figures).
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from .config import Settings
from .loadtest import ledger_matches
from .memstat import overhead_bytes, rss_bytes
from .service import Gateway

log = structlog.get_logger(__name__)

MB = 1 << 20
LOCK_S = 60.0  # the bench's own holds of a session (sampling, the long session): generous, never hit


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

    def start(self) -> None:
        self.messages = [{"role": "system", "content": "You are an inventory agent."},
                         {"role": "user", "content": f"Check stock for store {self.n}."}]


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


def _client(base: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=900)


def _turn(http: httpx.Client, agent: Agent, turn: int, rows: int, max_tokens: int, retries: int) -> None:
    """One turn: a tool call and its result, then the reply (the last reply reaches the ledger
    only with a next turn)."""
    if agent.problem:
        return
    call = f"c{turn}"
    agent.messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call, "type": "function", "function": {"name": "inventory", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": call, "content": _tool_result(agent.n, turn, rows)}]
    response = _post(http, agent, max_tokens, retries)
    if response is None or response.status_code != 200:
        agent.problem = f"turn {turn}: " + ("503 after retries" if response is None else
                                            f"HTTP {response.status_code} {response.text[:200]}")
        return
    agent.session_id = response.headers["x-lethe-session"]
    agent.messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"] or ""})


def _check_ledger(http: httpx.Client, agent: Agent) -> None:
    if agent.problem:
        return
    segments = http.get(f"/v1/sessions/{agent.session_id}/segments").json()["segments"]
    ok, problem = ledger_matches(segments, agent.messages[:-1])
    agent.problem = "" if ok else problem


def _run_agents(base: str, key: str, agents: list[Agent], *, turns: int, rows: int, max_tokens: int,
                retries: int, concurrency: int, progress: "Progress") -> None:
    """Every agent's turn `t` before any agent's turn `t + 1`, `concurrency` at a time."""
    local = threading.local()
    clients: list[httpx.Client] = []

    def client() -> httpx.Client:
        if not hasattr(local, "http"):
            local.http = _client(base, key)
            clients.append(local.http)
        return local.http  # type: ignore[no-any-return]

    def step(agent: Agent, turn: int) -> None:
        _turn(client(), agent, turn, rows, max_tokens, retries)
        progress.requests_done += 1

    for agent in agents:
        agent.start()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for turn in range(turns):
                progress.turn = turn
                list(pool.map(lambda a: step(a, turn), agents))
            list(pool.map(lambda a: _check_ledger(client(), a), agents))
    finally:
        for http in clients:
            http.close()


class Progress:
    """Samples RSS every 20 ms (its peak is the figure reported) and writes a progress line to
    stderr every `every_s` seconds."""

    def __init__(self, gw: Gateway, agents: list[Agent], total: int, every_s: float = 10.0) -> None:
        self.peak = rss_bytes()
        self.requests_done = 0
        self.turn = 0
        self._gw, self._agents, self._total, self._every = gw, agents, total, every_s
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membench-progress", daemon=True)

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.report()

    def _run(self) -> None:
        next_line = self._started + self._every
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())
            if time.monotonic() >= next_line:
                next_line += self._every
                self.report()

    def report(self) -> None:
        m = self._gw.p.metrics
        res = self._gw.residency
        retried = sum(a.retried_503 for a in self._agents)
        failed = sum(1 for a in self._agents if a.problem)
        print(f"membench {time.monotonic() - self._started:6.0f}s round {self.turn + 1}: "
              f"{self.requests_done}/{self._total} turns, {retried} 503 retried, {failed} sessions failed, "
              f"rss {rss_bytes() / MB:.0f} MiB (peak {self.peak / MB:.0f}), "
              f"kv {res.used() / MB:.0f}/{res.budget / MB:.0f} MiB, "
              f"evicted {_count(m.kv_evictions, 'offloaded')}+{_count(m.kv_evictions, 'dropped')}, "
              f"restored {_count(m.kv_restores, 'hit')}, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)


def _count(metric: Any, label: str | None = None) -> int:
    return int((metric.labels(label) if label else metric)._value.get())


@contextmanager
def _held(gw: Gateway, session_id: str) -> Iterator[Any]:
    record = gw.p.ledger.get_session(session_id)
    assert record is not None
    with gw.sessions.hold(record, LOCK_S) as live:
        yield live


def _exact_restores(gw: Gateway, agents: list[Agent], sample: int) -> dict[str, Any]:
    """Restore sampled offloaded sessions and compare each with a fresh prefill of its tokens."""
    offload = gw.residency.offload
    ids = [a.session_id for a in agents if a.session_id and not a.problem]
    chosen = [s for s in ids if offload is not None and offload.copy_of(s) is not None][:sample]
    exact = 0
    for sid in chosen:
        with _held(gw, sid) as live:
            touched = gw.residency.admit(live)
            restored = touched.get("offload", {}).get("action") == "restored-erased"
            tokens = live.cache.tokens
            exact += restored and gw.compute(gw.p.kernel.prefill, tokens).digest() == live.cache.digest()
            gw.residency.settle(live)
    return {"offloaded_checked": len(chosen), "exact": exact}


def restore_vs_rebuild(gw: Gateway, base: str, key: str, tokens: int, reps: int) -> dict[str, Any]:
    """One session of about `tokens` tokens, made through the API: a verified restore from the
    offload tier against a rebuild from its ledger (what a dropped session costs: the ledger's
    content rendered, tokenized and prefilled), median of `reps`, on the gateway's own kernel."""
    agent = Agent(-1)
    agent.start()
    rows = max(1, tokens // 25)  # a row is about 25 tokens
    with _client(base, key) as http:
        _turn(http, agent, 0, rows, 1, retries=20)
    if agent.problem:
        raise RuntimeError(f"the long session failed: {agent.problem}")
    offload = gw.residency.offload
    assert offload is not None
    restore_s, rebuild_s, exact = [], [], True
    with _held(gw, agent.session_id) as live:
        reference = live.cache.digest()
        n = len(live.cache)
        for _ in range(reps):
            gw.residency.drop(live)
            started = time.perf_counter()
            assert gw.erasure.rebuild(live, gw.p.ledger.segments(live.record.id))
            rebuild_s.append(time.perf_counter() - started)
            exact &= live.cache.digest() == reference
            copy, _lost = offload.store(live.record.id, live.cache, "bench")
            assert copy is not None
            gw.residency.drop(live)
            started = time.perf_counter()
            live.cache = offload.load(copy, gw.p.kernel)
            restore_s.append(time.perf_counter() - started)
            offload.discard(live.record.id)
            exact &= live.cache.digest() == reference
        gw.residency.release(live)
    rebuild, restore = statistics.median(rebuild_s), statistics.median(restore_s)
    return {"tokens": n, "reps": reps, "rebuild_from_ledger_s": round(rebuild, 4),
            "restore_verified_s": round(restore, 4), "speedup": round(rebuild / restore, 2) if restore else None,
            "exact": exact}


def _session_bytes(gw: Gateway, base: str, key: str, turns: int, rows: int, max_tokens: int) -> int:
    """What one finished session holds (measured: one agent run to the end, then released)."""
    agent = Agent(-1)
    agent.start()
    with _client(base, key) as http:
        for turn in range(turns):
            _turn(http, agent, turn, rows, max_tokens, retries=0)
    if agent.problem:
        raise RuntimeError(f"the sizing session failed: {agent.problem}")
    with _held(gw, agent.session_id) as live:
        held = live.cache.nbytes
        gw.residency.release(live)
    return held


def run_memory_bench(settings: Settings, *, sessions: int = 200, turns: int = 3, rows: int = 4,
                     max_tokens: int = 2, concurrency: int = 8, budget_share: float = 0.1,
                     retries: int = 60, sample: int = 16, long_tokens: int = 2000, reps: int = 3) -> dict[str, Any]:
    from .demo import local_gateway

    with local_gateway(settings, port=settings.port) as lg:  # LETHE_PORT: the bench listens there
        gw: Gateway = lg.app.state.lethe.gateway
        per_session = _session_bytes(gw, lg.base, lg.key, turns, rows, max_tokens)
        need = per_session * sessions
        budget = max(int(need * budget_share), 3 * per_session)
        gw.residency.budget = budget
        gw.residency.peak = 0
        assert gw.residency.offload is not None
        gw.residency.offload.max_bytes = max(gw.residency.offload.max_bytes, 2 * need)  # every copy fits
        baseline = rss_bytes()
        load_before = os.getloadavg()
        log.info("membench.start", sessions=sessions, turns=turns, per_session=per_session, budget=budget)
        agents = [Agent(n) for n in range(sessions)]
        started = time.perf_counter()
        with Progress(gw, agents, sessions * turns) as progress:
            _run_agents(lg.base, lg.key, agents, turns=turns, rows=rows, max_tokens=max_tokens, retries=retries,
                        concurrency=concurrency, progress=progress)
        elapsed = time.perf_counter() - started
        load_after = os.getloadavg()
        statuses = [s for a in agents for s in a.statuses]
        metrics = gw.p.metrics
        exactness = _exact_restores(gw, agents, sample)
        long = restore_vs_rebuild(gw, lg.base, lg.key, long_tokens, reps)
        turn_threads = sum(t.name.startswith("turn") for t in threading.enumerate())  # they never exit
        overhead = overhead_bytes(turn_threads)
        allowed = baseline + budget + overhead
        return {
            "sessions": sessions, "turns": turns, "rows_per_tool_result": rows, "max_tokens": max_tokens,
            "concurrency": concurrency, "seconds": round(elapsed, 1),
            "loadavg_1_5_15": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
            "cpus": os.cpu_count(),
            "overload": {"need_bytes": need, "budget_bytes": budget, "need_over_budget": round(need / budget, 2),
                         "per_session_bytes": per_session,
                         "offered": f"{sessions} sessions x {turns} turns, {concurrency} at once, round by round"},
            "requests": len(statuses),
            "status": {str(code): statuses.count(code) for code in sorted(set(statuses))},
            "non_200_other_than_503_retry_after": sum(s not in (200, 503) for s in statuses)
            + sum(a.refused_503_without_retry_after for a in agents),
            "sessions_failed": [f"{a.n}: {a.problem}" for a in agents if a.problem][:10],
            "ledgers_intact": sum(1 for a in agents if not a.problem),
            "rss": {"baseline_bytes": baseline, "peak_bytes": progress.peak, "budget_bytes": budget,
                    "turn_threads": turn_threads, "overhead_bytes": overhead, "allowed_bytes": allowed,
                    "within_budget_plus_overhead": progress.peak <= allowed,
                    "peak_over_baseline_plus_budget_bytes": progress.peak - baseline - budget,
                    "accounted_kv_peak_bytes": gw.residency.peak},
            "kv": {"evictions": {to: _count(metrics.kv_evictions, to) for to in ("offloaded", "dropped")},
                   "offloads": _count(metrics.kv_offloads),
                   "restores": {r: _count(metrics.kv_restores, r) for r in ("hit", "rebuilt")}},
            "restores_exact": exactness,
            "restore_vs_rebuild": long,
        }
