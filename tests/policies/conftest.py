"""Fixtures for the policies tests: bundle directories to break on purpose, and an OPA stand-in server.

No OPA binary can be installed here, so `OpaStandin` serves OPA's REST API (the subset Lethe and
opa-python-client use) on loopback. Its evaluator is OPA's own Go code, v1.20.2, through
`opa-golib-python-bindings` when that is installed, so answers, undefined documents and compile
errors are OPA's; without it the stand-in falls back to regorus and says so in `evaluator`.
What is ours and not OPA's: the HTTP layer (routing, status codes, error bodies), written from
OPA's REST API documentation.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest

from policies.bundle import SHIPPED_BUNDLE_DIR, bundle_files

try:
    from opa_bindings import OpaEngine, OpaUndefinedError
except ImportError:  # pragma: no cover - depends on the optional install step
    OpaEngine = None

TEST_TENANTS = {
    "acme": {
        "thresholds": {"injection": 0.8},
        "trusted_tools": ["search.internal"],
        "blocked_tools": ["browser.raw"],
        "retention": {"classes": {"normal": 86400}, "tools": {"search.internal": {"normal": 3600}}},
        "tenancy": {"epoch": 4},
    },
    "optin": {"amortize_opt_in": True, "sensitive_action": "amortize"},
    "strict": {"thresholds": {"injection": 0.2, "secret": 0.1}, "tenancy": {"scope": "tenant", "public_prefix_allowed": False}},
    "archive": {"retention": {"classes": {"normal": None}}},
}


def copy_bundle(dest: Path, *, tenants: dict | None = None, replace: dict[str, str] | None = None) -> Path:
    """Copy the shipped bundle to `dest`, optionally with other tenants and replaced/added files."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in bundle_files(SHIPPED_BUNDLE_DIR):
        target = dest / path.relative_to(SHIPPED_BUNDLE_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    if tenants is not None:
        (dest / "data" / "tenants.json").write_text(json.dumps({"lethe": {"tenants": tenants}}))
    for rel, text in (replace or {}).items():
        (dest / rel).write_text(text)
    return dest


@pytest.fixture
def make_bundle(tmp_path: Path) -> Callable[..., Path]:
    counter = iter(range(1000))
    return lambda **kw: copy_bundle(tmp_path / f"bundle{next(counter)}", **kw)


class OpaStandin:
    """OPA's Data and Policy REST API on loopback, evaluated by OPA's Go engine where installed."""

    def __init__(self, bundle_dir: Path | None = None) -> None:
        self.policies: dict[str, str] = {}
        self.data: dict[str, Any] = {}
        self.delay_s = 0.0  # fault injection: sleep before answering a data query
        self.fail_status: int | None = None  # fault injection: answer data queries with this status
        self.queries = 0
        self.evaluator = "opa-golib (OPA v1.20.2)" if OpaEngine is not None else "regorus (fallback)"
        self._lock = threading.Lock()
        self._engine: Any = None
        if bundle_dir is not None:  # like `opa run --server <files> <dir>/data`
            for path in bundle_files(bundle_dir):
                rel = path.relative_to(bundle_dir).as_posix()
                if rel.endswith(".rego"):
                    self.policies[rel] = path.read_text()
                else:
                    _deep_merge(self.data, json.loads(path.read_text()))
        self._engine = self._build(self.policies, self.data)
        self._server = HTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "OpaStandin":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _build(self, policies: dict[str, str], data: dict[str, Any]) -> Any:
        """Compile a whole policy set; raises on any error, like OPA refusing a PUT."""
        if OpaEngine is not None:
            engine = OpaEngine()
            for pid, raw in policies.items():
                engine.add_policy(pid, raw)
            engine.add_data(data)
            engine.eval_query("x := 1")  # forces OPA's compile ("bundle activation") now
            return engine
        import regorus

        engine = regorus.Engine()
        for pid, raw in policies.items():
            engine.add_policy(pid, raw)
        engine.add_data_json(json.dumps(data))
        return engine

    def _query(self, path: str, input: Any) -> Any:
        ref = ".".join(p for p in path.split("/") if p)
        if OpaEngine is not None:
            try:
                return self._engine.eval_document(ref, input)
            except OpaUndefinedError:
                return None
        if input is not None:
            self._engine.set_input_json(json.dumps(input))
        return self._engine.eval_rule(f"data.{ref}")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: Any = None) -> None:
                raw = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_GET(self) -> None:
                if self.path == "/health":
                    return self._send(200, {})
                if self.path.rstrip("/") == "/v1/policies":
                    return self._send(200, {"result": [{"id": k, "raw": v} for k, v in standin.policies.items()]})
                if self.path.startswith("/v1/data"):
                    return self._data_query(None)
                self._send(404, {"code": "resource_not_found", "message": f"{self.path} not found"})

            def do_POST(self) -> None:
                if not self.path.startswith("/v1/data"):
                    return self._send(404, {"code": "resource_not_found", "message": f"{self.path} not found"})
                try:
                    raw = self._body()
                    body = json.loads(raw) if raw else {}
                except json.JSONDecodeError as exc:
                    return self._send(400, {"code": "invalid_parameter", "message": f"body contains malformed input document: {exc}"})
                self._data_query(body.get("input"))

            def do_PUT(self) -> None:
                if self.path.startswith("/v1/policies/"):
                    pid = self.path.removeprefix("/v1/policies/")
                    policies = {**standin.policies, pid: self._body().decode()}
                    data = standin.data
                elif self.path.startswith("/v1/data"):
                    data = json.loads(json.dumps(standin.data))
                    _put_path(data, self.path.removeprefix("/v1/data"), json.loads(self._body()))
                    policies = standin.policies
                else:
                    return self._send(404, {"code": "resource_not_found", "message": f"{self.path} not found"})
                with standin._lock:
                    try:
                        engine = standin._build(policies, data)
                    except Exception as exc:
                        return self._send(400, {"code": "invalid_parameter", "message": "error(s) occurred while compiling module(s)", "errors": [str(exc)]})
                    standin.policies, standin.data, standin._engine = policies, data, engine
                self._send(200 if self.path.startswith("/v1/policies/") else 204, {} if self.path.startswith("/v1/policies/") else None)

            def _data_query(self, input: Any) -> None:
                standin.queries += 1
                if standin.delay_s:
                    time.sleep(standin.delay_s)
                if standin.fail_status:
                    return self._send(standin.fail_status, {"code": "internal_error", "message": "injected fault"})
                path = self.path.split("?")[0].removeprefix("/v1/data")
                with standin._lock:
                    try:
                        result = standin._query(path, input)
                    except Exception as exc:
                        return self._send(500, {"code": "internal_error", "message": str(exc)[:500]})
                self._send(200, {} if result is None else {"result": result})

        return Handler


def _deep_merge(into: dict, doc: dict) -> None:
    for key, value in doc.items():
        if isinstance(into.get(key), dict) and isinstance(value, dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _put_path(data: dict, path: str, value: Any) -> None:
    parts = [p for p in path.split("/") if p]
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if parts:
        node[parts[-1]] = value
    else:
        data.clear()
        data.update(value)


@pytest.fixture
def test_tenants() -> dict:
    return json.loads(json.dumps(TEST_TENANTS))


@pytest.fixture
def opa_standin(make_bundle: Callable[..., Path]):
    bundle = make_bundle(tenants=TEST_TENANTS)
    with OpaStandin(bundle) as server:
        server.bundle_dir = bundle
        yield server
