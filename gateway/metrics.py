"""Prometheus metrics, on a registry of the app's own so that several apps (tests) never collide."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("lethe_requests_total", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram("lethe_request_seconds", "HTTP request latency", ["route"], registry=r)
        self.gate_verdicts = Counter("lethe_gate_verdicts_total", "Gate verdicts on tool results", ["verdict"],
                                     registry=r)
        self.actions = Counter("lethe_actions_total", "Policy actions applied", ["action"], registry=r)
        self.erasures = Counter("lethe_erasures_total", "Exact erasures", ["cause"], registry=r)
        self.erasure_seconds = Histogram("lethe_erasure_seconds", "Forget latency incl. witness", registry=r)
        self.overhead_seconds = Histogram(
            "lethe_tool_overhead_seconds", "Gateway overhead per tool result, model compute excluded", registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5))
        self.turns = Counter("lethe_turns_total", "Chat turns ended, by outcome", ["outcome"], registry=r)
        self.tokens = Counter("lethe_tokens_total", "Tokens processed", ["phase"], registry=r)
        self.tokens_per_second = Gauge("lethe_decode_tokens_per_second", "Last decode speed", registry=r)
        self.kv_bytes = Gauge("lethe_kv_bytes", "KV cache bytes held across sessions", registry=r)
        self.kv_resident_bytes = Gauge("lethe_kv_resident_bytes", "KV bytes held or reserved in memory (sessions, "
                                       "staged rows, prefix caches): what LETHE_KV_BUDGET_BYTES bounds", registry=r)
        self.kv_offloaded_bytes = Gauge("lethe_kv_offloaded_bytes", "Bytes of evicted sessions' KV in the offload tier",
                                        registry=r)
        self.kv_evictions = Counter("lethe_kv_evictions_total", "Sessions evicted from memory, by where they went",
                                    ["to"], registry=r)
        self.kv_offloads = Counter("lethe_kv_offloads_total", "Evicted sessions written to the offload tier",
                                   registry=r)
        self.kv_restores = Counter("lethe_kv_restores_total", "Offloaded sessions on their next turn: restored "
                                   "exactly (hit) or discarded and rebuilt from the ledger", ["result"], registry=r)
        self.kv_restore_seconds = Histogram("lethe_kv_restore_seconds", "Time to read, verify and restore an "
                                            "offloaded session", registry=r,
                                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.injection_scorer = Info("lethe_injection_scorer", "What scores tool results for injection", registry=r)
