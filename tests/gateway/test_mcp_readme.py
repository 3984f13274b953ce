"""The README's MCP snippets work as written: the agent-client entry starts a working proxy, and the
trust data and Rego test do what the README says.

The one substitution: the snippet's upstream (`npx ... server-filesystem`) needs the npm registry,
so the test swaps that upstream's command for the fixture server; the `lethe` command, its
arguments and the environment variable are the README's own.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

import policies
from gateway.tenants import TenantStore
from policies import PolicyEngine, run_rego_tests

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIXTURE = Path(__file__).with_name("mcp_upstream.py")


def _block(marker: str, lang: str) -> str:
    found = re.search(rf"<!-- {marker} -->\s*```{lang}\n(.*?)```", README, re.S)
    assert found, f"README has no ```{lang} block after <!-- {marker} -->"
    return found.group(1)


def _rego_test_block() -> str:
    found = re.search(r"```rego\n(package lethe\.acme_mcp_test.*?)```", README, re.S)
    assert found, "README has no acme_mcp_test Rego block"
    return found.group(1)


def test_agent_client_snippet_starts_a_proxy_that_screens_results(tmp_path: Path) -> None:
    entry = json.loads(_block("mcp-snippet", "json"))["mcpServers"]["filesystem"]
    assert entry["command"] == "lethe"
    command = shutil.which("lethe") or str(Path(sys.executable).with_name("lethe"))
    args = list(entry["args"])
    upstream = args.index("--upstream") + 1
    assert args[upstream].startswith("fs=npx ")
    args[upstream] = f"fs={sys.executable} {FIXTURE}"  # the one substitution (no npm registry in tests)
    data = tmp_path / "lethe"
    env = {**entry["env"], "LETHE_DATA_DIR": str(data),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    assert set(entry["env"]) == {"LETHE_DATA_DIR"}
    data.mkdir()
    TenantStore.from_url(f"sqlite:///{data / 'lethe.db'}").create_tenant("acme")  # `lethe tenant create acme`

    async def agent() -> tuple[list[str], str]:
        async with Client(StdioServerParameters(command=command, args=args, env=env), read_timeout_seconds=120) as c:
            tools = [t.name for t in (await c.list_tools()).tools]
            result = await c.call_tool("fs__read_file", {"path": "/home/alice/.aws/credentials"})
            return tools, result.content[0].text

    tools, text = anyio.run(agent)
    assert "fs__read_file" in tools
    assert "aws_access_key_id = [REDACTED:aws_access_key_id]" in text and "AKIA" not in text


def test_trust_snippet_and_its_rego_test_hold(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(Path(policies.__file__).parent, bundle, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (bundle / "data" / "tenants.json").write_text(_block("mcp-trust", "json"))
    (bundle / "acme_mcp_test.rego").write_text(_rego_test_block())
    report = run_rego_tests(bundle)
    assert report.ok, report.format()
    assert any(r.name.endswith("test_acme_trusts_fs_read_file_over_mcp") for r in report.results)
    engine = PolicyEngine(bundle)
    base = {"tenant": "acme", "user": "alice", "session": {"id": "s", "age_s": 1, "tokens": 0},
            "span": {"bytes": 10, "tokens": 3}, "gate": {"injection": 0.98, "secret": 0, "findings": []}}
    mcp = {"channel": "mcp", "upstream": "fs", "phase": "result"}
    routed = {"name": "fs__read_file", "claimed_name": "fs__read_file", "verified": True, "source": "mcp"}
    assert engine.decide({**base, **mcp, "tool": routed}).action == "allow"
    assert engine.decide({**base, "tool": routed}).action == "quarantine"  # a chat name gains nothing
    assert engine.decide({**base, **mcp, "tool": "fs__read_file"}).action == "quarantine"  # a bare claim neither
    assert engine.decide({**base, **mcp, "tool": {**routed, "name": "fs__list_directory"}}).action == "quarantine"
    clean = {**base, **mcp, "tool": "fs__write_file", "gate": {"injection": 0, "secret": 0, "findings": []}}
    assert engine.decide(clean).reasons == ("blocked_tool: tool fs__write_file is blocked for tenant acme",)
