"""`lethe mcp`: build the proxy from the settings and serve it (no model, no kernel: the proxy needs none)."""
from __future__ import annotations

import anyio

from audit import AuditError, AuditLog
from ledger import Ledger
from policies import PolicyEngine

from ..config import Settings
from ..tenants import Principal, TenantStore
from .guard import Guard
from .recorder import InlineFirst, WriterLink, local_writer, shared_database
from .proxy import Proxy
from .settings import McpSettings, UpstreamConfigError
from .transport import http_app, serve_stdio
from .writer import WriterProcess, stores

KEY_CACHE_S = 10.0  # how long a found API key is remembered: a key deleted from the database works this much longer


def build(settings: Settings, upstream_flags: list[str] | None = None,
          writer_process: bool = False) -> tuple[Proxy, TenantStore]:
    """The proxy over this deployment's gate, policy, ledger and audit log. With `writer_process`
    its records are committed by a child process (writer.py: for a proxy serving many agents)."""
    s = settings
    try:
        mcp = McpSettings.from_settings(s, upstream_flags)
    except UpstreamConfigError as exc:  # a configuration slip: one line, no traceback
        raise SystemExit(f"lethe mcp: {exc}") from None
    try:
        ledger, audit = stores(s)  # before the writer starts: its stores open the same key and databases
    except AuditError as exc:  # e.g. a write lock held past its timeout: one line naming the fix
        raise SystemExit(f"lethe mcp: {exc}") from None
    policy = PolicyEngine(s.policy_dir, backend=s.policy_backend, opa_url=s.opa_url, timeout_s=s.opa_timeout_s,
                          retries=s.opa_retries)
    guard = Guard(s.gate(), policy, ledger, audit, mcp.max_result_bytes,
                  writer_link(s, ledger, audit) if writer_process else None)
    return Proxy(mcp, guard, ledger), TenantStore.from_url(s.db_url, s.admin_key, cache_s=KEY_CACHE_S)


def writer_link(settings: Settings, ledger: Ledger, audit: AuditLog) -> WriterLink:
    """The writer process, with commits on the loop first where both stores share one local SQLite
    file (recorder.InlineFirst: a network database would block the loop for a round trip)."""
    process = WriterProcess(settings)
    local = shared_database(ledger, audit) and audit.database.startswith("sqlite")
    if settings.mcp_inline_commit and local:
        return InlineFirst(local_writer(ledger, audit, wait=False), process)
    return process


def run_stdio(settings: Settings, flags: list[str], tenant: str, user: str | None, session: str | None) -> None:
    proxy, tenants = build(settings, flags)
    if tenant not in tenants.tenants():
        raise SystemExit(f"unknown tenant {tenant!r}; create it with `lethe tenant create {tenant}`")
    anyio.run(serve_stdio, proxy, Principal(tenant=tenant, user=user), session)


def run_http(settings: Settings, flags: list[str], host: str, port: int) -> None:
    import uvicorn

    proxy, tenants = build(settings, flags, writer_process=True)
    uvicorn.run(http_app(proxy, tenants, host), host=host, port=port, log_config=None, access_log=False)
