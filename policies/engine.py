"""PolicyEngine: the gateway's four questions to Rego, answered fail-closed and tagged with the bundle hash.

Atomicity: the active bundle and its backend live in one immutable `_Active` object; a request
reads the reference once and uses only that object, and `reload()` swaps the reference after the
new bundle has loaded and answered probe queries. So a request sees the old bundle or the new
one, never a mix, and every answer carries the hash of the bundle that produced it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from policies.backends import Backend, EmbeddedBackend, OpaBackend, engine_error, rule_ref
from policies.bundle import Bundle, load_bundle
from policies.model import (ACTIONS, NON_TEXT, SCOPES, Decision, ErasureDecision, KvPriority, PolicyError, Retention,
                            Tenancy)

log = structlog.get_logger(__name__)

# Inputs the bundle must answer before it may become active (shapes documented in the .rego files).
_PROBES: dict[str, dict[str, Any]] = {
    "lethe/decision": {
        "tenant": "probe", "user": "probe", "session": {"id": "probe", "age_s": 0, "tokens": 0},
        "tool": "probe", "span": {"bytes": 0, "tokens": 0},
        "gate": {"injection": 0.0, "secret": 0.0, "findings": []},
    },
    "lethe/tenancy": {"tenant": "probe", "user": "probe", "public_prefix": False},
    "lethe/retention": {
        "tenant": "probe", "tool": "probe", "state": "live",
        "gate": {"injection": 0.0, "secret": 0.0, "findings": []},
    },
    "lethe/kv_priority": {"tenant": "probe", "segments": [{"role": "system", "tool": None, "state": "live",
                                                          "n_tokens": 1}]},
    "lethe/erasure": {
        "actor": {"tenant": "probe", "user": "probe", "roles": []},
        "target": {"tenant": "probe", "session_id": "probe", "session_owner": "probe"},
        "action": "forget",
    },
}


# Per-tenant activation probes: what every tenant's decision must be on content everyone agrees on.
_KNOWN_INJECTION = {"injection": 1.0, "secret": 0.0,
                    "findings": [{"kind": "injection", "rule_id": "probe", "layer": "rules", "score": 1.0}]}
_KNOWN_SECRET = {"injection": 0.0, "secret": 1.0,
                 "findings": [{"kind": "secret", "rule_id": "probe", "layer": "rules", "score": 1.0}]}
_ERASING = frozenset({"forget", "redact"})


def _tenant_probes(tenant: str) -> list[tuple[str, dict[str, Any]]]:
    base: dict[str, Any] = {"tenant": tenant, "user": "probe", "session": {"id": "probe", "age_s": 0, "tokens": 0},
            "tool": "lethe.probe", "span": {"bytes": 64, "tokens": 16}}
    requoted = {**base, "channel": "user", "tool": None, "gate": {"injection": 0.0, "secret": 0.0, "findings": []},
                "content_sha256": "probe", "session": {**base["session"], "quarantined_hashes": ["probe"]}}
    return [("a known injection", {**base, "gate": _KNOWN_INJECTION}),
            ("a quarantined result re-sent as user text", requoted),
            ("a known secret", {**base, "gate": _KNOWN_SECRET})]


def _merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _secret_actions(settings: dict) -> frozenset[str]:
    """forget or redact, or the one other action a tenant opted into with both switches (see decision.rego)."""
    action = settings.get("sensitive_action")
    if action == "amortize" and settings.get("amortize_opt_in") is True:
        return frozenset({"amortize"})
    if action == "allow" and settings.get("admit_sensitive") is True:
        return frozenset({"allow"})
    return _ERASING


@dataclass(frozen=True)
class _Active:
    bundle: Bundle
    backend: Backend


class PolicyEngine:
    """Evaluates the Lethe policies on the embedded engine (default) or an OPA server."""

    def __init__(
        self,
        bundle_dir: Path | None = None,
        *,
        backend: str = "embedded",
        opa_url: str = "http://127.0.0.1:8181",
        timeout_s: float = 0.5,
        retries: int = 2,
    ) -> None:
        if backend not in ("embedded", "opa"):
            raise ValueError(f"policy backend {backend!r} is unknown; use 'embedded' or 'opa'")
        self._backend_name = backend
        self._opa = OpaBackend(opa_url, timeout_s, retries) if backend == "opa" else None
        self._reload_lock = threading.Lock()
        self._active = self._activate(load_bundle(bundle_dir))

    @property
    def bundle_hash(self) -> str:
        return self._active.bundle.hash

    @property
    def bundle_dir(self) -> Path:
        return self._active.bundle.root

    @property
    def backend(self) -> str:
        return self._backend_name

    def evaluate(self, rule_path: str, input: dict) -> dict:
        """The raw object at data.<rule_path> (e.g. "lethe/decision"); raises PolicyError."""
        return self._evaluate(self._active, rule_path, input)

    def decide(self, input: dict) -> Decision:
        """allow | quarantine | redact | forget | amortize for one tool result. Never raises; errors quarantine."""
        active = self._active
        try:
            return _decision(self._evaluate(active, "lethe/decision", input), active.bundle.hash)
        except Exception as exc:  # fail closed on anything, including bugs in this module
            log.warning("policy.decision_failed", error=str(exc), bundle_hash=active.bundle.hash)
            return Decision("quarantine", (f"policy-error: {exc}",), active.bundle.hash)

    def tenancy(self, input: dict) -> Tenancy:
        """The cache-salt scope of a request; raises PolicyError so the gateway refuses the request."""
        active = self._active
        return _tenancy(self._evaluate(active, "lethe/tenancy", input), active.bundle.hash)

    def retention(self, input: dict) -> Retention:
        """TTL of a stored segment. Never raises: on error nothing is kept (data_class "policy-error", ttl 0).

        Keeping nothing is the closed side for retention: a lost cache entry costs a recompute,
        a kept secret cannot be taken back.
        """
        active = self._active
        try:
            return _retention(self._evaluate(active, "lethe/retention", input), active.bundle.hash)
        except Exception as exc:
            log.warning("policy.retention_failed", error=str(exc), bundle_hash=active.bundle.hash)
            return Retention("policy-error", 0.0, active.bundle.hash)

    def kv_priority(self, input: dict) -> KvPriority:
        """Per-segment KV priorities of a session; raises PolicyError (the gateway then keeps the
        session's previous priorities, or the lowest: a policy failure must not pin memory)."""
        active = self._active
        return _kv_priority(self._evaluate(active, "lethe/kv_priority", input), active.bundle.hash,
                            len(input.get("segments", ())))

    def erasure_allowed(self, input: dict) -> ErasureDecision:
        """May this actor forget that session? Never raises; errors deny."""
        active = self._active
        try:
            return _erasure(self._evaluate(active, "lethe/erasure", input), active.bundle.hash)
        except Exception as exc:
            log.warning("policy.erasure_failed", error=str(exc), bundle_hash=active.bundle.hash)
            return ErasureDecision(False, (f"policy-error: {exc}",), active.bundle.hash)

    def reload(self, bundle_dir: Path | None = None) -> str:
        """Load `bundle_dir` (default: the active bundle's directory, re-read) and swap it in atomically.

        A bundle that fails to read, parse, load or answer the probe queries raises PolicyError
        and the active bundle stays. Returns the new bundle hash.
        """
        with self._reload_lock:
            old = self._active
            new = self._activate(load_bundle(bundle_dir if bundle_dir is not None else old.bundle.root))
            self._active = new
        log.info("policy.reloaded", old_hash=old.bundle.hash, new_hash=new.bundle.hash, backend=self._backend_name)
        return new.bundle.hash

    def _activate(self, bundle: Bundle) -> _Active:
        # The embedded engine vets every bundle, also for the opa backend, whose server is
        # expected to serve the same directory (see README: docker-compose mounts it).
        embedded = _Active(bundle, EmbeddedBackend(bundle))
        for rule_path, probe in _PROBES.items():
            try:
                _VALIDATORS[rule_path](self._evaluate(embedded, rule_path, probe), bundle.hash)
            except PolicyError as exc:
                raise PolicyError(f"policy bundle {bundle.root} refused: {exc}") from exc
        self._probe_tenants(embedded)
        return _Active(bundle, self._opa) if self._opa is not None else embedded

    def _probe_tenants(self, active: _Active) -> None:
        """Every tenant (and one with no overrides) must quarantine a known injection and a re-sent
        quarantined result, and forget (or redact) a known secret unless it opted into another action."""
        data = json.loads(active.bundle.data_json)["lethe"]
        tenants = data.get("tenants", {})
        for tenant in ["lethe.probe.no-overrides", *sorted(tenants)]:
            settings = _merged(data["defaults"], tenants.get(tenant, {}))
            for what, probe in _tenant_probes(tenant):
                expected = _secret_actions(settings) if probe["gate"] is _KNOWN_SECRET else frozenset({"quarantine"})
                try:
                    action = self._evaluate(active, "lethe/decision", probe).get("action")
                except PolicyError as exc:
                    raise PolicyError(f"policy bundle {active.bundle.root} refused: tenant {tenant!r}: {exc}") from exc
                if action not in expected:
                    raise PolicyError(
                        f"policy bundle {active.bundle.root} refused: for tenant {tenant!r} {what} gives {action!r}, "
                        f"must be {' or '.join(sorted(expected))}; check that tenant's thresholds, blocked/trusted "
                        "tools and sensitive settings")

    @staticmethod
    def _evaluate(active: _Active, rule_path: str, input: dict) -> dict:
        try:
            result = active.backend.evaluate(rule_path, input)
        except PolicyError:
            raise
        except Exception as exc:
            raise PolicyError(f"{active.backend.name} backend failed: {engine_error(exc)}") from exc
        if result is None:
            raise PolicyError(f"{rule_ref(rule_path)} is undefined for this input")
        if not isinstance(result, dict):
            raise PolicyError(f"{rule_ref(rule_path)} is {type(result).__name__}, not an object")
        return result


def _reasons(result: dict, ref: str) -> tuple[str, ...]:
    reasons = result.get("reasons")
    if not isinstance(reasons, list) or not reasons or not all(isinstance(r, str) and r for r in reasons):
        raise PolicyError(f"malformed {ref}: reasons must be a non-empty list of strings, got {reasons!r}")
    return tuple(reasons)


def _decision(result: dict, bundle_hash: str) -> Decision:
    action = result.get("action")
    if action not in ACTIONS:
        raise PolicyError(f"malformed data.lethe.decision: unknown action {action!r}")
    kinds = result.get("redact_kinds", [])
    if action == "redact" and (not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) and k for k in kinds)):
        raise PolicyError(f"malformed data.lethe.decision: redact needs redact_kinds, a non-empty list of strings, got {kinds!r}")
    non_text = result.get("non_text", "withhold")
    if non_text not in NON_TEXT:
        raise PolicyError(f"malformed data.lethe.decision: non_text must be 'pass' or 'withhold', got {non_text!r}")
    return Decision(action, _reasons(result, "data.lethe.decision"), bundle_hash,
                    tuple(kinds) if action == "redact" else (), non_text)


def _tenancy(result: dict, bundle_hash: str) -> Tenancy:
    scope, key, epoch = result.get("scope"), result.get("scope_key"), result.get("epoch")
    if scope not in SCOPES:
        raise PolicyError(f"malformed data.lethe.tenancy: unknown scope {scope!r}")
    if not isinstance(key, str) or not key:
        raise PolicyError(f"malformed data.lethe.tenancy: scope_key must be a non-empty string, got {key!r}")
    if isinstance(epoch, bool) or not isinstance(epoch, (int, float)) or epoch != int(epoch) or epoch < 0:
        raise PolicyError(f"malformed data.lethe.tenancy: epoch must be a non-negative integer, got {epoch!r}")
    return Tenancy(scope, key, int(epoch), bundle_hash)


def _retention(result: dict, bundle_hash: str) -> Retention:
    data_class, ttl = result.get("data_class"), result.get("ttl_seconds", "missing")
    if not isinstance(data_class, str) or not data_class:
        raise PolicyError(f"malformed data.lethe.retention: data_class must be a non-empty string, got {data_class!r}")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl < 0):
        raise PolicyError(f"malformed data.lethe.retention: ttl_seconds must be null or >= 0, got {ttl!r}")
    return Retention(data_class, None if ttl is None else float(ttl), bundle_hash)


def _priority(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or not 0 <= value <= 100:
        raise PolicyError(f"malformed data.lethe.kv_priority: {what} must be an integer 0-100, got {value!r}")
    return int(value)


def _kv_priority(result: dict, bundle_hash: str, expected: int | None = None) -> KvPriority:
    segments = result.get("segments")
    if not isinstance(segments, list) or (expected is not None and len(segments) != expected):
        raise PolicyError(f"malformed data.lethe.kv_priority: segments must be a list with one entry per input "
                          f"segment, got {segments!r}")
    out = []
    for i, seg in enumerate(segments):
        duration = seg.get("duration_s") if isinstance(seg, dict) else "missing"
        if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                     or duration <= 0):
            raise PolicyError(f"malformed data.lethe.kv_priority: segments[{i}].duration_s must be null or > 0, "
                              f"got {duration!r}")
        out.append((_priority(seg.get("priority"), f"segments[{i}].priority"),
                    None if duration is None else float(duration)))
    return KvPriority(_priority(result.get("default_priority"), "default_priority"),
                      _priority(result.get("offload_min_priority"), "offload_min_priority"), tuple(out), bundle_hash)


def _erasure(result: dict, bundle_hash: str) -> ErasureDecision:
    allow = result.get("allow")
    if not isinstance(allow, bool):
        raise PolicyError(f"malformed data.lethe.erasure: allow must be a boolean, got {allow!r}")
    return ErasureDecision(allow, _reasons(result, "data.lethe.erasure"), bundle_hash)


_VALIDATORS = {
    "lethe/decision": _decision,
    "lethe/tenancy": _tenancy,
    "lethe/retention": _retention,
    "lethe/kv_priority": _kv_priority,
    "lethe/erasure": _erasure,
}
