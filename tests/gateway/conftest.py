"""A real gateway on loopback (uvicorn in a thread) over the session's one real model."""
from __future__ import annotations

import json
import shutil
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
                        retention_sweep_s=3600, log_json=True, debug=True)
    with local_gateway(settings, model=real_model) as gw:
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
