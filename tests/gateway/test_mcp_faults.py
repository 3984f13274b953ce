"""Fail closed: when the gate, the policy or the audit log fails, the agent gets an error or a stub, never content.

The proxy runs in process (the SDK's client drives its server object directly) so that one
component can be broken on purpose; the upstream is still the fixture server as a real process.
"""
from __future__ import annotations

import shutil
import sys
import time
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
# what only one phase of fx__weather's screening reads: its definition, its arguments, its result
DEFINITION, ARGUMENTS, RESULT = b"Current weather.", b'"Paris"', b"light rain"
ACME = Caller(Principal("acme", "agent"), None)


class FailingGate(Gate):
    """Raises on any document holding `marker` (a corrupt rule database, an OOM...), scans the rest.
    By content, not by count: the client's own list calls screen other tools' definitions at
    moments of its choosing (a count once made the result's test fail on another definition)."""

    def __init__(self, marker: bytes) -> None:
        super().__init__()
        self.marker = marker

    def scan(self, data: bytes, **kw: Any):  # type: ignore[override]
        if self.marker in data:
            raise RuntimeError("hyperscan scratch lost")
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
    result, error = _call(_proxy(tmp_path, gate=FailingGate(DEFINITION)), "fx__weather", {"city": "Paris"})
    assert result is None and "lethe could not screen the definition of 'fx__weather': the gate failed (RuntimeError)" in error


def test_gate_failure_on_arguments_refuses_the_call(tmp_path: Path) -> None:
    result, error = _call(_proxy(tmp_path, gate=FailingGate(ARGUMENTS)), "fx__weather", {"city": "Paris"})
    assert result is None and "lethe could not screen this call: the gate failed (RuntimeError)" in error


def test_gate_failure_on_the_result_passes_nothing_on(tmp_path: Path) -> None:
    result, error = _call(_proxy(tmp_path, gate=FailingGate(RESULT)), "fx__weather",
                          {"city": "Paris"})
    assert result is None and "lethe could not screen this call: the gate failed (RuntimeError)" in error
    assert "Paris: 18" not in error
    # the call was made (its record came first), so its outcome is recorded: the screening failed
    ledger = Ledger(f"sqlite:///{tmp_path / 'lethe.db'}")
    for _ in range(50):  # queued as the handler ended, committed by the recorder's thread
        crossings = [c for c in ledger.crossings.list("acme") if c.tool == "fx__weather" and c.action != "allow"]
        if crossings:
            break
        time.sleep(0.1)
    [crossing] = crossings
    assert crossing.action == "quarantine" and crossing.meta["decision"]["reasons"] == ["screening_failed: ScreeningError"]


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
