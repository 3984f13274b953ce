"""Lethe's policies: Rego decides quarantine, forget or amortize, cache-salt scopes, retention and erasure rights.

Operators govern Lethe by editing `policies/*.rego` and `policies/data/*.json` (or a bundle
directory of the same layout); `PolicyEngine` asks them the gateway's four questions, fails
closed, and tags every answer with the sha256 of the bundle that gave it. See README.md here.
"""

from policies.engine import PolicyEngine
from policies.model import (
    Decision,
    ErasureDecision,
    KvPriority,
    PolicyError,
    Retention,
    Tenancy,
    derive_salt,
    tool_identity,
)
from policies.regotest import RegoTestReport, RegoTestResult, run_rego_tests

__all__ = [
    "Decision",
    "ErasureDecision",
    "KvPriority",
    "PolicyEngine",
    "PolicyError",
    "RegoTestReport",
    "RegoTestResult",
    "Retention",
    "Tenancy",
    "derive_salt",
    "run_rego_tests",
    "tool_identity",
]
