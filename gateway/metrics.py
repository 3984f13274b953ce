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
        self.injection_scorer = Info("lethe_injection_scorer", "What scores tool results for injection", registry=r)
