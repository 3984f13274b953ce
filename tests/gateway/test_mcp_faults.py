"""Fail closed: when the gate, the policy or the audit log fails, the agent gets an error or a stub, never content.

The proxy runs in process (the SDK's client drives its server object directly) so that one
component can be broken on purpose; the upstream is still the fixture server as a real process.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

import policies
from audit import AuditLog, Signer
from gate import Gate
from gateway.mcp import Caller, Guard, McpSettings, Proxy, UpstreamSpec
from gateway.tenants import Principal
from ledger import Ledger
from policies import PolicyEngine

FIXTURE = Path(__file__).with_name("mcp_upstream.py")
# gate scans before each phase of fx__weather: its definition is several parts (scanned as one
# document, then glued for split secrets), its arguments and its result one part each
DEFINITION, ARGUMENTS = 2, 1
ACME = Caller(Principal("acme", "agent"), None)


class FailingGate(Gate):
    """Scans the first `good` documents, then raises (a corrupt rule database, an OOM...)."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    def scan(self, data: bytes, **kw: Any):  # type: ignore[override]
        if self.good <= 0:
            raise RuntimeError("hyperscan scratch lost")
        self.good -= 1
        return super().scan(data, **kw)


class FailingAudit:
    def __init__(self, real: AuditLog) -> None:
        self.real = real

    def append_many(self, records: list[dict[str, Any]]) -> list[int]:
        raise OSError("disk full")


def _proxy(tmp: Path, *, gate: Gate | None = None, policy: PolicyEngine | None = None,
           audit: Any = None) -> Proxy:
    url = f"sqlite:///{tmp / 'lethe.db'}"
    ledger = Ledger(url)
    log = AuditLog(url, Signer.load_or_create(tmp / "key.pem"))
    settings = McpSettings(upstreams=[UpstreamSpec(name="fx", command=[sys.executable, str(FIXTURE)])],
                           call_timeout_s=10)
    guard = Guard(gate or Gate(), policy or PolicyEngine(), ledger, audit or log, settings.max_result_bytes)
    return Proxy(settings, guard, ledger)


def _call(proxy: Proxy, name: str, args: dict[str, Any]) -> tuple[Any, str | None]:
    async def go() -> tuple[Any, str | None]:
        async with proxy.running():
            async with Client(proxy.server(lambda _ctx: ACME)) as client:
                try:
                    return await client.call_tool(name, args), None
                except Exception as exc:
                    return None, str(exc)
    return anyio.run(go)


def test_gate_failure_on_the_tools_definition_refuses_the_call(tmp_path: Path) -> None:
    result, error = _call(_proxy(tmp_path, gate=FailingGate(good=0)), "fx__weather", {"city": "Paris"})
    assert result is None and "lethe could not screen the definition of 'fx__weather': the gate failed (RuntimeError)" in error


def test_gate_failure_on_arguments_refuses_the_call(tmp_path: Path) -> None:
    result, error = _call(_proxy(tmp_path, gate=FailingGate(good=DEFINITION)), "fx__weather", {"city": "Paris"})
    assert result is None and "lethe could not screen this call: the gate failed (RuntimeError)" in error


def test_gate_failure_on_the_result_passes_nothing_on(tmp_path: Path) -> None:
    result, error = _call(_proxy(tmp_path, gate=FailingGate(good=DEFINITION + ARGUMENTS)), "fx__weather",
                          {"city": "Paris"})
    assert result is None and "the gate failed" in error and "Paris: 18" not in error


def test_audit_failure_passes_nothing_on(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lethe.db'}"
    broken = FailingAudit(AuditLog(url, Signer.load_or_create(tmp_path / "key.pem")))
    result, error = _call(_proxy(tmp_path, audit=broken), "fx__read_file", {"path": "credentials"})
    assert result is None and "could not be recorded (OSError)" in error and "AKIA" not in error


def test_policy_error_on_results_withholds_them(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(Path(policies.__file__).parent, bundle, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    with (bundle / "decision.rego").open("a") as f:  # two values for one document: an evaluation error
        f.write('\ndecision := {"action": "allow", "reasons": ["conflict: x"]} if input.phase == "result"\n')
    result, error = _call(_proxy(tmp_path, policy=PolicyEngine(bundle)), "fx__weather", {"city": "Paris"})
    assert error is None and result.is_error
    assert result.content[0].text.startswith("[tool result withheld by policy: policy-error] Reasons: policy-error:")
