"""A real gateway on loopback (uvicorn in a thread) over the session's one real model."""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import AppState
from gateway.config import Settings
from gateway.demo import local_gateway
from policies import PolicyEngine


PORT = int(os.environ.get("LETHE_TEST_PORT", "18121"))  # loopback port: issue 12; override per worktree


@dataclass
class Live:
    base: str
    key: str  # the demo tenant's admin key (user alice)
    state: AppState
    data_dir: Path

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key or self.key}"}, timeout=300)

    def new_key(self, tenant: str, **kw: object) -> str:
        if tenant not in self.state.tenants.tenants():
            self.state.tenants.create_tenant(tenant)
        return self.state.tenants.create_key(tenant, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def live_gateway(real_model, tmp_path_factory) -> Iterator[Live]:
    settings = Settings(max_body_bytes=300_000, max_tool_result_bytes=64_000, max_new_tokens=8,
                        retention_sweep_s=1.0, lock_timeout_s=3.0, log_json=True, debug=True)
    with local_gateway(settings, model=real_model, port=PORT) as gw:
        state: AppState = gw.app.state.lethe
        yield Live(gw.base, gw.key, state, Path(state.settings.data_dir))


@contextmanager
def tenant_policy(engine: PolicyEngine, tmp: Path, tenants: dict[str, Any]) -> Iterator[Path]:
    """Reload `engine` with `tenants` merged into data.lethe.tenants; restore the old bundle after."""
    original = engine.bundle_dir
    bundle = tmp / "bundle"
    shutil.copytree(original, bundle)
    path = bundle / "data" / "tenants.json"
    data = json.loads(path.read_text()) if path.exists() else {"lethe": {"tenants": {}}}
    data["lethe"]["tenants"].update(tenants)
    path.write_text(json.dumps(data))
    engine.reload(bundle)
    try:
        yield bundle
    finally:
        engine.reload(original)


@pytest.fixture
def with_tenant_policy() -> Callable[..., Any]:
    return tenant_policy


# ---- helpers shared by the lifecycle, fail-closed and wire tests ---------------------------------

def tool_turn(content: str, tool: str = "read_file") -> list[dict]:
    return [{"role": "user", "content": "look at this"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": tool, "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": content}]


def raw_request(port: int, path: str, body: bytes = b"", *, key: str, method: str = "POST",
                headers: dict[str, str] | None = None, chunked: bool = False) -> socket.socket:
    """Send a request on a raw socket (Content-Length or chunked framing) and return the open socket."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Authorization: Bearer {key}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in _parts(body)) + b"0\r\n\r\n"
    else:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + payload)
    return sock


def _parts(body: bytes, size: int = 97) -> list[bytes]:
    return [body[i:i + size] for i in range(0, len(body), size)] or []


def wait_until(predicate, timeout_s: float = 120.0, what: str = "condition") -> None:
    """Liveness bound, not a timing assertion: the machine is shared and slow."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.05)


def turns_settled(live: "Live") -> bool:
    gw = live.state.gateway
    return gw.running == 0 and not any(s.lock.locked() for s in gw.sessions.all())


def snapshot(live: "Live", sid: str) -> dict:
    """What a failed turn must leave exactly as it was."""
    gw, ledger = live.state.gateway, live.state.ledger
    segments = [(s.id, s.state.value, s.start, s.end, s.content_sha256) for s in ledger.segments(sid)]
    ledger.check_invariants(sid, cache_len=len(gw.cache(sid)))
    return {"digest": gw.cache(sid).digest(), "tokens": len(gw.cache(sid)), "segments": segments,
            "audit": live.state.audit.size}
