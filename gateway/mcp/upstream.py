"""Connections to the upstream MCP servers, through the SDK's own client.

Each upstream is held open by a task of its own (the SDK's client is an async context that must
be entered and left by one task); callers only send requests through it. A call is bounded by
`call_timeout_s`, and every way an upstream can fail (it crashes, hangs, closes the connection,
answers with something that is not a tool result) becomes one `UpstreamError` whose message the
agent can read. A link that failed is dropped and reopened on the next call, so one crash does not
take the upstream away for good. Nothing here looks at content: screening is guard.py's job.
"""
from __future__ import annotations

import hashlib

from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import mcp.types as types
import structlog
from anyio.abc import TaskGroup, TaskStatus
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from .settings import McpSettings, UpstreamSpec, exported_name, split_name

log = structlog.get_logger(__name__)


class UpstreamError(Exception):
    """An upstream failed; the message says which one, how, and what to check."""


def withheld(exc: BaseException) -> str:
    """An exception from an upstream link as the agent and the records may see it. Its text is the
    upstream's own words (an error's message) or its reply's bytes quoted by a parser, none of it
    screened (a red team's upstream put a key pair and an injection there, and both reached the
    agent and the append-only audit log): only its type, its JSON-RPC code, and a digest of the
    text to match against the upstream's own logs."""
    text = str(exc).encode("utf-8", "replace")
    code = getattr(getattr(exc, "error", None), "code", None)
    coded = f" (code {code})" if isinstance(code, int) else ""
    return (f"{type(exc).__name__}{coded}, its text withheld unscreened ({len(text)} bytes, "
            f"sha256 {hashlib.sha256(text).hexdigest()[:16]})")


@dataclass
class Link:
    """One open connection: the client, the tools it listed, and the event that closes it."""

    client: Client
    tools: dict[str, types.Tool]
    closed: anyio.Event = field(default_factory=anyio.Event)
    broken: bool = False


def _target(spec: UpstreamSpec, stack: AsyncExitStack) -> Any:
    if spec.command is not None:
        return StdioServerParameters(command=spec.command[0], args=spec.command[1:], env=spec.env or None)
    return spec.url if not spec.headers else _http_transport(spec, stack)


def _http_transport(spec: UpstreamSpec, stack: AsyncExitStack) -> Any:
    http = httpx2.AsyncClient(headers=spec.headers, timeout=httpx2.Timeout(30, read=300))
    stack.push_async_callback(http.aclose)
    return streamable_http_client(spec.url or "", http_client=http)


class Upstreams:
    """Every configured upstream, each held by its own task in the caller's task group."""

    def __init__(self, settings: McpSettings, tg: TaskGroup) -> None:
        self._specs = {u.name: u for u in settings.upstreams}
        self._settings = settings
        self._tg = tg
        self._links: dict[str, Link] = {}
        self._locks = {name: anyio.Lock() for name in self._specs}

    async def start(self) -> None:
        """Connect to every upstream; one that cannot be reached is logged and retried on use."""
        async with anyio.create_task_group() as tg:
            for name in self._specs:
                tg.start_soon(self._try_link, name)

    async def aclose(self) -> None:
        for link in self._links.values():
            link.closed.set()
        self._links.clear()

    async def _try_link(self, name: str) -> None:
        try:
            await self.link(name)
        except UpstreamError as exc:
            log.warning("mcp.upstream_unavailable", upstream=name, error=str(exc))

    async def link(self, name: str) -> Link:
        """The open link to `name`, (re)connecting when there is none or the last one failed.

        A healthy link is returned without taking the lock: an anyio lock yields to the loop even
        when free, and on a loaded proxy every yield waits behind every other agent's work."""
        link = self._links.get(name)
        if link is not None and not link.broken:
            return link
        async with self._locks[name]:
            link = self._links.get(name)
            if link is not None and not link.broken:
                return link
            if link is not None:
                link.closed.set()
            try:
                with anyio.fail_after(self._settings.connect_timeout_s):
                    link = await self._tg.start(self._hold, self._specs[name])
            except TimeoutError as exc:
                raise UpstreamError(f"upstream {name!r} did not finish connecting within "
                                    f"{self._settings.connect_timeout_s:g}s (LETHE_MCP_CONNECT_TIMEOUT_S)") from exc
            except Exception as exc:
                raise UpstreamError(f"upstream {name!r} could not be reached ({withheld(exc)}); "
                                    "check its command or URL in the MCP settings") from exc
            self._links[name] = link
            return link

    async def _hold(self, spec: UpstreamSpec, *, task_status: TaskStatus[Link]) -> None:
        started = False
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    Client(_target(spec, stack), read_timeout_seconds=self._settings.call_timeout_s))
                listed = await client.list_tools()
                link = Link(client, {t.name: t for t in listed.tools})
                log.info("mcp.upstream_connected", upstream=spec.name, transport=spec.transport, tools=len(link.tools))
                task_status.started(link)
                started = True
                await link.closed.wait()
        except Exception as exc:  # a dying upstream must not take the proxy's task group with it
            if not started:
                raise
            log.info("mcp.upstream_closed", upstream=spec.name, error=type(exc).__name__)

    async def tools(self) -> list[tuple[str, types.Tool]]:
        """(exported name, upstream tool) for every reachable upstream, in configuration order."""
        out: list[tuple[str, types.Tool]] = []
        for name in self._specs:
            try:
                link = await self.link(name)
            except UpstreamError as exc:
                log.warning("mcp.upstream_unavailable", upstream=name, error=str(exc))
                continue
            out += [(exported_name(name, t.name), t) for t in link.tools.values()]
        return out

    def route(self, exported: str) -> tuple[str, str] | None:
        """(upstream, tool) that the proxy itself serves under `exported`; None for any other name."""
        parts = split_name(exported)
        if parts is None or parts[0] not in self._specs:
            return None
        return parts

    def known(self, exported: str) -> types.Tool | None:
        """The definition behind `exported` as last listed, without connecting or listing: None if
        the proxy has none at hand (for the SDK's per-call header check, which skips on None)."""
        route = self.route(exported)
        link = self._links.get(route[0]) if route else None
        return link.tools.get(route[1]) if link and route else None

    async def definition(self, upstream: str, tool: str) -> types.Tool:
        """The tool as the upstream lists it (listing again once if it is not there yet)."""
        link = await self.link(upstream)
        if tool not in link.tools:
            link = await self._refresh(upstream, link)
            if tool not in link.tools:
                raise UpstreamError(f"upstream {upstream!r} has no tool {tool!r}; list the tools again")
        return link.tools[tool]

    async def call(self, upstream: str, tool: str, arguments: Mapping[str, Any]) -> types.CallToolResult:
        """The upstream's result, or UpstreamError; never waits longer than the call timeout."""
        await self.definition(upstream, tool)
        return await self._request(upstream, repr(tool), types.CallToolResult,
                                   lambda client: client.call_tool(tool, dict(arguments)))

    async def resources(self) -> list[tuple[str, types.Resource]]:
        """(upstream, resource) for every reachable upstream's listed resources, in configuration order."""
        return await self._listed("resources", "resources/list", types.ListResourcesResult,
                                  lambda client: client.list_resources(), lambda r: r.resources)

    async def templates(self) -> list[tuple[str, types.ResourceTemplate]]:
        """(upstream, resource template) for every reachable upstream's listed templates, in configuration order."""
        return await self._listed("resources", "resources/templates/list", types.ListResourceTemplatesResult,
                                  lambda client: client.list_resource_templates(), lambda r: r.resource_templates)

    async def prompts(self) -> list[tuple[str, types.Prompt]]:
        """(upstream, prompt) for every reachable upstream's listed prompts, in configuration order."""
        return await self._listed("prompts", "prompts/list", types.ListPromptsResult,
                                  lambda client: client.list_prompts(), lambda r: r.prompts)

    async def _listed(self, capability: str, what: str, result: type[Any], request: Any,
                      items: Callable[[Any], list[Any]]) -> list[tuple[str, Any]]:
        """One listing from every upstream that offers `capability` and answers; one that fails is
        logged and skipped. One that does not offer it is not asked (it would answer an error,
        and an error drops the link)."""
        out: list[tuple[str, Any]] = []
        for name in self._specs:
            try:
                link = await self.link(name)
                if getattr(link.client.server_capabilities, capability, None) is None:
                    continue
                listed = await self._request(name, what, result, request)
            except UpstreamError as exc:
                log.warning("mcp.upstream_unavailable", upstream=name, error=str(exc))
                continue
            out += [(name, item) for item in items(listed)]
        return out

    async def prompt(self, upstream: str, name: str, arguments: dict[str, str]) -> types.GetPromptResult:
        """The upstream's prompt `name` filled with `arguments`, or UpstreamError (within the call timeout)."""
        return await self._request(upstream, f"prompt {name!r}", types.GetPromptResult,
                                   lambda client: client.get_prompt(name, arguments))

    async def read(self, upstream: str, uri: str) -> types.ReadResourceResult:
        """The upstream's contents of `uri`, or UpstreamError; never waits longer than the call timeout."""
        return await self._request(upstream, f"resource {uri!r}", types.ReadResourceResult,
                                   lambda client: client.read_resource(uri))

    async def _request(self, upstream: str, what: str, expected: type[Any], send: Any) -> Any:
        """`send(client)` on the upstream's link within the call timeout; an `expected` reply or UpstreamError."""
        link = await self.link(upstream)
        limit = self._settings.call_timeout_s
        try:
            with anyio.fail_after(limit):
                result = await send(link.client)
        except TimeoutError as exc:
            link.broken = True  # a hung upstream may answer late into the next call: reconnect
            raise UpstreamError(f"upstream {upstream!r} did not answer {what} within {limit:g}s "
                                "(LETHE_MCP_CALL_TIMEOUT_S)") from exc
        except Exception as exc:
            link.broken = True
            raise UpstreamError(f"upstream {upstream!r} failed on {what}: {withheld(exc)}") from exc
        if not isinstance(result, expected):
            raise UpstreamError(f"upstream {upstream!r} answered {what} with {type(result).__name__}, "
                                f"not a {expected.__name__}")
        return result

    async def _refresh(self, name: str, link: Link) -> Link:
        try:
            listed = await link.client.list_tools()
        except Exception as exc:
            link.broken = True
            raise UpstreamError(f"upstream {name!r} failed to list its tools: {withheld(exc)}") from exc
        link.tools = {t.name: t for t in listed.tools}
        return link
