"""The gateway's core, as one object the HTTP layer calls: sessions, turns, erasure, retention.

Threading: a turn runs in one worker thread from start to end (`run_turn`), holding its session's
lock for exactly that synchronous block; kernel calls take the model lock one at a time and run
on the one model thread (`Compute`). No lock
is held across an await or a yield to a client, and every lock wait has a timeout.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, Protocol

import structlog

from kvkernel import GenerationConfig, KVCache

from .chat import ChatMessage, Conversation, with_tools
from .erasure import Erasure, actor_of
from .errors import GatewayError, fails_as
from .memstat import default_kv_budget, trim, tune_allocator
from .offload import DiskTier, HostTier, Offload
from .pipeline import Components, Pipeline
from .residency import Residency
from .sessions import Compute, PrefixCache, Sessions
from .tenants import Principal
from .turn import Turn

__all__ = ["Components", "Gateway", "TurnChannel"]

log = structlog.get_logger(__name__)

# The heaps are trimmed when the last running turn ends and, under load that never lets the
# gateway go idle, after every TRIM_EVERY turns: the free pages a flood leaves in the middle of
# the heaps otherwise stay resident (~100-150 MB measured under 8 concurrent turns).
TRIM_EVERY = 32


def residency_for(parts: Components, sessions: Sessions, compute: Compute) -> Residency:
    """The KV budget and its offload tier: host memory when the kernel runs on CUDA, else disk."""
    budget = parts.kv_budget_bytes or default_kv_budget(parts.model.device, parts.kv_budget_share)
    offload_bytes = 2 * budget if parts.kv_offload_bytes is None else parts.kv_offload_bytes
    tier: DiskTier | HostTier | None = HostTier() if parts.model.device.type == "cuda" else \
        DiskTier(parts.offload_dir) if parts.offload_dir is not None else None
    offload = Offload(tier, offload_bytes) if tier is not None and offload_bytes > 0 else None
    tune_allocator()
    log.info("kv.budget", budget_bytes=budget, offload_bytes=offload_bytes if offload else 0,
             tier=tier.name if offload and tier else None)
    return Residency(kernel=parts.kernel, ledger=parts.ledger, policy=parts.policy, metrics=parts.metrics,
                     sessions=sessions, budget_bytes=budget, offload=offload,
                     offload_min_priority=parts.kv_offload_min_priority, compute=compute)


class TurnChannel(Protocol):
    """How a running turn talks to whoever waits for it (the HTTP response)."""

    def prepared(self, turn: Turn) -> None:
        """The prompt is staged: headers (session id, actions) can go out."""

    def token(self, token: int) -> bool:
        """One generated token; False stops the generation (a stop string was reached)."""

    def cancelled(self) -> bool:
        """The client went away: stop generating and end the turn."""

    def tool_calls(self) -> list[dict[str, Any]]:
        """The finished reply's tool calls in the OpenAI shape (ids assigned), as the client will get them."""


class Gateway:
    """Sessions and their pipeline; the HTTP layer is a thin shell over this."""

    def __init__(self, parts: Components) -> None:
        self.p = parts
        self.compute = Compute()
        self.sessions = Sessions(parts.kernel, parts.ledger, parts.policy, parts.salt_secret)
        self.residency = residency_for(parts, self.sessions, self.compute)
        self.sessions.prefixes.room = self.residency.fits
        self.erasure = Erasure(sessions=self.sessions, ledger=parts.ledger, audit=parts.audit, policy=parts.policy,
                               metrics=parts.metrics, compute=self.compute, witness_mode=parts.witness_mode,
                               lock_timeout_s=parts.lock_timeout_s, tokenizer=parts.model.tokenizer,
                               residency=self.residency)
        self.pipeline = Pipeline(parts, prefixes=self.sessions.prefixes, erasure=self.erasure,
                                 compute=self.compute, residency=self.residency)
        self.stopping = threading.Event()  # shutdown: running turns stop generating and end
        self._running = 0
        self._ended = 0  # turns ended, for TRIM_EVERY
        self._running_changed = threading.Condition()
        self._trimmer = ThreadPoolExecutor(1, thread_name_prefix="heap-trim")  # off the reply's path

    @property
    def prefixes(self) -> PrefixCache:
        return self.sessions.prefixes

    # ---- a chat turn ------------------------------------------------------------------------

    def run_turn(self, principal: Principal, session_id: str | None, messages: list[ChatMessage],
                 tools: list[dict[str, Any]] | None, cfg: GenerationConfig, channel: TurnChannel) -> Turn:
        """Prepare, generate and end one turn, in this thread, holding the session lock throughout.

        `turn.end` runs on every path (the `finally`), before the lock is released: a failed or
        cancelled turn leaves the cache and the ledger as they were; a finished one has applied
        its post-turn erasures.
        """
        if self.stopping.is_set():
            raise GatewayError(503, "shutting_down", "the gateway is shutting down; retry on another replica",
                               retry_after=5)
        conv_messages, offset = with_tools(messages, tools)
        live = self.sessions.open(principal, session_id)
        with self._running_changed:
            self._running += 1
        try:
            with self.sessions.hold(live, self.p.lock_timeout_s) as live:
                try:
                    self.residency.admit(live)
                    turn = Turn(live, before=live.cache.tokens,
                                abandoned=lambda: channel.cancelled() or self.stopping.is_set())
                    outcome = "failed"
                    try:
                        conv = Conversation(self.p.model.tokenizer, conv_messages, memo=live.chunks)
                        self.pipeline.prepare(turn, principal, conv, cfg.max_new_tokens, offset,
                                              tool_spec=bool(tools))
                        channel.prepared(turn)
                        self.p.hold_point("turn-written", turn.abandoned)
                        outcome = self._generate(turn, cfg, channel)
                    finally:
                        turn.end(outcome, self.pipeline)
                        self.p.metrics.turns.labels(turn.outcome).inc()
                finally:
                    self.residency.settle(live)
                    self.p.metrics.kv_bytes.set(self.kv_bytes())
                if tools and turn.outcome == "completed":
                    self._record_tool_calls(turn.session_id, channel)
            return turn
        finally:
            with self._running_changed:
                self._running -= 1
                self._ended += 1
                due = not self._running or not self._ended % TRIM_EVERY
                self._running_changed.notify_all()
            if due:  # the heaps' free pages back to the OS (1-70 ms; see memstat), after the reply
                self._trimmer.submit(trim)

    def _record_tool_calls(self, session_id: str, channel: TurnChannel) -> None:
        """Record the calls the model made (id -> name) before the reply leaves: the results that
        answer them are then told apart from results the client invents (`pipeline.tool_of`).
        If the record cannot be written the reply fails, so no id goes out unrecorded."""
        calls = {c["id"]: c["function"]["name"] for c in channel.tool_calls()}
        with fails_as("ledger"):
            self.p.ledger.tool_calls.record(session_id, calls)

    def _generate(self, turn: Turn, cfg: GenerationConfig, channel: TurnChannel) -> str:
        """Feed generated tokens to the channel; each decode step takes the model lock on its own."""
        started, count = time.perf_counter(), 0
        with fails_as("kernel"):
            tokens = turn.live.cache.generate(cfg)
        try:
            while not (channel.cancelled() or self.stopping.is_set()):
                with fails_as("kernel"):
                    token = self.compute(next, tokens, None)
                if token is None:
                    break
                count += 1
                if not channel.token(token):
                    break
        finally:
            self.compute(tokens.close)
        elapsed = time.perf_counter() - started
        self.p.metrics.tokens.labels("decode").inc(count)
        if count and elapsed > 0:
            self.p.metrics.tokens_per_second.set(count / elapsed)
        return "cancelled" if channel.cancelled() or self.stopping.is_set() else "completed"

    def drain(self, timeout_s: float) -> bool:
        """Shutdown: stop every running turn and wait (bounded) until all have ended."""
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        with self._running_changed:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("shutdown.turns_left", running=self._running)
                    return False
                self._running_changed.wait(left)
        return True

    @property
    def running(self) -> int:
        return self._running

    # ---- sessions, erasure, retention ---------------------------------------------------------

    def inspect(self, principal: Principal, session_id: str) -> dict[str, Any]:
        """Token count, cache digest and KV memory of a session: what an auditor compares."""
        record = self.sessions.scoped(principal, session_id)
        with self.sessions.hold(record, self.p.lock_timeout_s) as live:
            copy = self.residency.offloaded(live)
            if copy is not None:  # a read must not restore it and evict others: its digest at eviction
                return {"session_id": record.id, "tenant": record.tenant, "tokens": copy.tokens, "resident": False,
                        "offloaded": True, "cache_digest": copy.digest, "kv": {"offloaded_bytes": copy.nbytes}}
            try:
                self.residency.admit(live)  # a resident cache the ledger has moved past is wiped first
                return {"session_id": record.id, "tenant": record.tenant, "tokens": len(live.cache),
                        "resident": len(live.cache) > 0, "offloaded": False,
                        "cache_digest": self.compute(live.cache.digest), "kv": live.cache.memory().to_dict()}
            finally:
                self.residency.settle(live)

    def end_session(self, principal: Principal, session_id: str) -> dict[str, Any]:
        """DELETE /v1/sessions/{id}: erase every KV copy of the session (resident memory zeroed,
        offloaded copy overwritten and unlinked), audited as `kv-release` naming the copies. The
        ledger keeps the conversation (erase content with /forget); a later turn rebuilds it."""
        record = self.sessions.scoped(principal, session_id)
        with fails_as("policy"):
            decision = self.p.policy.erasure_allowed({
                "actor": principal.policy_actor(),
                "target": {"tenant": record.tenant, "session_id": record.id, "session_owner": record.user},
                "action": "forget"})
        if not decision.allowed:
            raise GatewayError(403, "erasure_denied", "ending the session denied by policy: " + "; ".join(decision.reasons))
        with self.sessions.hold(record, self.p.lock_timeout_s) as live:
            copies = self.residency.release(live)
        body = {"kind": "kv-release", "tenant": record.tenant, "session": record.id, "actor": actor_of(principal),
                "copies": copies}
        index = self.erasure.append_records([body])[0]
        log.info("session.ended", session=record.id, copies=sorted(copies))
        return {"session_id": record.id, "copies": copies, "audit_index": index}

    def scoped_session(self, principal: Principal, session_id: str) -> Any:
        return self.sessions.scoped(principal, session_id)

    def cache(self, session_id: str) -> KVCache | None:
        """The session's resident KV cache, if any (for inspection; callers must not mutate it)."""
        live = self.sessions.get(session_id)
        return live.cache if live is not None else None

    def session_salt(self, session_id: str) -> str | None:
        record = self.p.ledger.get_session(session_id)
        return record.salt_scope if record else None

    def kv_bytes(self) -> int:
        """Bytes of K/V rows the sessions hold (tokens x bytes per token, capacity not counted);
        `residency.used()` is what the budget counts."""
        return sum(s.cache.memory().total_bytes for s in self.sessions.all())

    def close(self) -> None:
        """Shutdown: erase every offloaded copy."""
        self.residency.close()

    def forget_request(self, principal: Principal, session_id: str, selector: dict[str, Any]) -> dict[str, Any]:
        return self.erasure.forget_request(principal, session_id, selector)

    def sweep_retention(self, now: datetime | None = None) -> int:
        return self.erasure.sweep_retention(now)

    def settle(self) -> int:
        """Do what turns still owe (audit records, forgets): at start-up and on every sweeper pass."""
        return self.erasure.settle()
