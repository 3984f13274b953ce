"""The proxy's MCP handlers: the list methods re-export the upstreams' tools, resources and prompts;
tools/call, resources/read and prompts/get run the one gated path (arguments, upstream, result,
durable records, then the agent's answer).

Routing is the proxy's own: an exported name `<upstream>__<tool>` is split by the proxy, and only
names of configured upstreams are served, so the tool name the policy sees is the route the
proxy took, not a name the client asserted. Who is calling comes from the transport (the API key
over HTTP, the tenant named at start over stdio), never from the request's arguments.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import mcp.types as types
import structlog
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from ledger import Crossing, Ledger
from policies import Decision

from .. import __version__
from ..tenants import Principal
from .guard import (Call, Called, Document, Guard, Outcome, Pending, ScreeningError, actor_of, call_unrecorded,
                    reason_label)
from .settings import (PROMPT_GET, RESOURCE_READ, URI_SCHEME, McpSettings, exported_name, exported_template,
                       exported_uri, split_uri)
from .upstream import Upstreams, UpstreamError

log = structlog.get_logger(__name__)

META_KEY = "io.lethe/decision"
UPSTREAM_FAILED = -32001  # JSON-RPC server-error range: the upstream failed, the proxy did not
# Documents up to this size are screened on the event loop (the gate reads ~30 bytes a
# microsecond, so about a millisecond): a worker thread would cost more, since under load it waits
# for the GIL behind the loop for up to a switch interval (5 ms) and then for the loop to take its
# answer back. Larger ones go to a guard thread, so the loop keeps serving other agents meanwhile.
INLINE_BYTES = 32 * 1024
PAGES_SCANNED = 10  # pages of the crossings listing read to fill one page of a per-user caller's own


@dataclass(frozen=True)
class Caller:
    principal: Principal
    session_id: str | None
    mcp_session: str | None = None  # the MCP session id (HTTP; the SDK binds it to its opener)


CallerOf = Callable[[Any], Caller]  # ServerRequestContext -> Caller; raises MCPError


class Proxy:
    """Upstreams plus the guard, served as one MCP server."""

    def __init__(self, settings: McpSettings, guard: Guard, ledger: Ledger) -> None:
        self.settings = settings
        self.guard = guard
        self.ledger = ledger
        self._upstreams: Upstreams | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator["Proxy"]:
        """Hold the upstream connections open for the lifetime of the block."""
        # Few guard threads: each thread compiles its own copy of the policy bundle (~20 ms), and on
        # a CPU host more threads than cores only queue for them.
        self._limiter = anyio.CapacityLimiter(4)
        async with self.guard.recorder.running(), anyio.create_task_group() as tg:
            self._upstreams = Upstreams(self.settings, tg)
            await self._upstreams.start()
            try:
                yield self
            finally:
                await self._upstreams.aclose()
                self._upstreams = None
                tg.cancel_scope.cancel()

    @property
    def upstreams(self) -> Upstreams:
        if self._upstreams is None:
            raise MCPError(types.INTERNAL_ERROR, "the proxy is not running; use `async with proxy.running()`")
        return self._upstreams

    def server(self, caller_of: CallerOf) -> Server[Any]:
        async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
            return types.ListToolsResult(tools=await self._shown(
                caller_of(ctx), await self.upstreams.tools(), lambda name, _t: name,
                lambda name, t: t.model_copy(update={"name": name})))

        async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
            return await self.call(caller_of(ctx), params.name, dict(params.arguments or {}))

        def input_schema(name: str) -> dict[str, Any] | None:
            # The SDK checks a call's `Mcp-Param-*` headers against the tool's input schema; without
            # this look-up it runs the whole tools/list handler (every definition) on every call.
            tool = self._upstreams.known(name) if self._upstreams is not None else None
            return tool.input_schema if tool is not None else None

        async def list_resources(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
            return types.ListResourcesResult(resources=await self._shown(
                caller_of(ctx), await self.upstreams.resources(), _read_route,
                lambda up, r: r.model_copy(update={"uri": exported_uri(up, r.uri), "name": exported_name(up, r.name)})))

        async def list_templates(ctx: Any,
                                 params: types.PaginatedRequestParams | None) -> types.ListResourceTemplatesResult:
            return types.ListResourceTemplatesResult(resource_templates=await self._shown(
                caller_of(ctx), await self.upstreams.templates(), _read_route,
                lambda up, t: t.model_copy(update={"uri_template": exported_template(up, t.uri_template),
                                                   "name": exported_name(up, t.name)})))

        async def read_resource(ctx: Any, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
            return await self.read(caller_of(ctx), params.uri)

        async def list_prompts(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListPromptsResult:
            return types.ListPromptsResult(prompts=await self._shown(
                caller_of(ctx), await self.upstreams.prompts(), lambda up, p: exported_name(up, PROMPT_GET + p.name),
                lambda up, p: p.model_copy(update={"name": exported_name(up, p.name)})))

        async def get_prompt(ctx: Any, params: types.GetPromptRequestParams) -> types.GetPromptResult:
            return await self.prompt(caller_of(ctx), params.name, dict(params.arguments or {}))

        return Server("lethe-mcp", version=__version__, on_list_tools=list_tools, on_call_tool=call_tool,
                      on_list_resources=list_resources, on_list_resource_templates=list_templates,
                      on_read_resource=read_resource, on_list_prompts=list_prompts, on_get_prompt=get_prompt,
                      get_tool_input_schema=input_schema,
                      instructions="Lethe screens every tool result and every call's arguments; "
                                   "a withheld result names the reason.")

    async def _shown(self, caller: Caller, listed: list[tuple[str, Any]], route: Callable[[str, Any], str],
                     export: Callable[[str, Any], Any]) -> list[Any]:
        """The listed definitions whose text passes the gate, exported. `listed` holds (key, item)
        pairs; `route(key, item)` is the tool name the item is screened under (the one its use
        goes by), `export(key, item)` what the agent is shown."""
        return [export(key, item) for key, item in listed
                if (await self._definition_decision(caller, route(key, item), item)).action == "allow"]

    async def _definition_decision(self, caller: Caller, name: str, item: Any) -> Decision:
        call = Call(caller.principal, None, name.split("__", 1)[0], name)
        try:
            decision = self.guard.known_definition(call, item) or \
                await self._off_loop(self.guard.screen_definition, call, item)
        except ScreeningError as exc:
            raise MCPError(types.INTERNAL_ERROR, f"lethe could not screen the definition of {name!r}: {exc}") from exc
        return decision

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def sees_session(self, principal: Principal, session_id: str) -> bool:
        """Whether the caller may see this chat session: its tenant's, and its own where the tenancy
        is per user (the chat API's rule, `Principal.may_see`)."""
        record = self.ledger.get_session(session_id, principal.tenant)
        return record is not None and principal.may_see(self.guard.policy, record)

    def crossings_seen(self, principal: Principal, session_id: str | None, after: str | None = None,
                       limit: int = 100) -> tuple[list[Crossing], str | None]:
        """A page of the caller's tenant's crossings (one session's when given), and the cursor of
        the next page (None at the end); only its own calls' where the tenancy is per user
        (`owner_only`, the chat API's rule): a red team's user listed another user's tools, digests
        and redaction offsets. A crossing recorded without its actor counts as another's (the
        closed side). Pages, because a red team's listing of a busy tenant was 12.9 MB in one
        response. The filter runs over `limit` rows at a time, so a page of another user's calls
        reads `PAGES_SCANNED` pages at most, and may come back short with a cursor to go on from."""
        own = actor_of(principal) if principal.user is not None else None
        mine = principal.owner_only(self.guard.policy)
        shown: list[Crossing] = []
        for _ in range(PAGES_SCANNED):
            rows = self.ledger.crossings.list(principal.tenant or "", session_id, after=after, limit=limit)
            after = rows[-1].id if len(rows) == limit else None
            shown += [r for r in rows if not mine or (own is not None and r.meta.get("actor") == own)]
            if len(shown) >= limit or after is None:
                break
        return shown[:limit], after if len(shown) <= limit else shown[limit - 1].id

    async def _guarded(self, doc: Document, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, a guard step over `doc`: on the loop if the document is small, else off it."""
        if len(doc.data) <= INLINE_BYTES:
            return fn(*args)
        return await self._off_loop(fn, *args)

    def linked_session(self, principal: Principal, session_id: str | None) -> str | None:
        """The chat session to link results to; one the caller cannot see (or an unknown id) is refused."""
        if session_id is None:
            return None
        if not self.sees_session(principal, session_id):
            raise MCPError(types.INVALID_PARAMS, f"session {session_id!r} is not one of this caller's chat "
                                                 "sessions (another tenant's, another user's where the tenant is "
                                                 "scoped per user, or unknown); send the x-lethe-session the chat "
                                                 "endpoint returned to this key (stdio: start with --user, the "
                                                 "session's owner)")
        return session_id

    async def call(self, caller: Caller, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        started = time.perf_counter()
        route = self.upstreams.route(name)
        if route is None:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {name!r}: this proxy serves only the "
                                                 "`<upstream>__<tool>` names that tools/list returns")
        try:
            definition = await self.upstreams.definition(*route)
        except UpstreamError as exc:
            raise MCPError(UPSTREAM_FAILED, str(exc)) from exc
        decision = await self._definition_decision(caller, name, definition)
        if decision.action != "allow":
            raise MCPError(types.INVALID_PARAMS, f"tool {name!r} is withheld by policy: {reason_label(decision)} "
                                                 f"({'; '.join(decision.reasons)}); its definition is not shown or "
                                                 "callable (see the audit log's definition record)")
        call = await self._call(caller, route[0], route[1])
        outcome = await self._screened(call, arguments, lambda: self.upstreams.call(route[0], route[1], arguments),
                                       "call")
        return _stamped(outcome, call, started)

    async def read(self, caller: Caller, uri: str) -> types.ReadResourceResult:
        """resources/read through the same path as a tool call: the URI screened as the call's
        arguments, the contents (text, or blobs by the policy's `non_text`) as its result, under
        the tool name `<upstream>__resources/read`; recorded before the agent sees anything."""
        started = time.perf_counter()
        route = split_uri(uri)
        if route is None or self.upstreams.route(exported_name(route[0], RESOURCE_READ)) != (route[0], RESOURCE_READ):
            raise MCPError(types.INVALID_PARAMS, f"unknown resource {uri!r}: this proxy serves only the "
                                                 f"`{URI_SCHEME}<upstream>/...` URIs that resources/list returns")
        call = await self._call(caller, route[0], RESOURCE_READ)
        got: list[types.ReadResourceResult] = []

        async def fetch() -> types.CallToolResult:
            got.append(await self.upstreams.read(*route))
            return types.CallToolResult(content=[types.EmbeddedResource(type="resource", resource=c)
                                                 for c in got[0].contents])
        outcome = await self._screened(call, {"uri": route[1]}, fetch, "read")
        return _as_contents(outcome, call, started, route[0], uri, got[0].contents if got else [])

    async def prompt(self, caller: Caller, name: str, arguments: dict[str, str]) -> types.GetPromptResult:
        """prompts/get through the same path: the arguments screened, then the filled prompt's
        description and messages as one result, under the tool name `<upstream>__prompts/get:<name>`."""
        started = time.perf_counter()
        route = self.upstreams.route(name)
        if route is None:
            raise MCPError(types.INVALID_PARAMS, f"unknown prompt {name!r}: this proxy serves only the "
                                                 "`<upstream>__<prompt>` names that prompts/list returns")
        call = await self._call(caller, route[0], PROMPT_GET + route[1])
        got: list[types.GetPromptResult] = []

        async def fetch() -> types.CallToolResult:
            got.append(await self.upstreams.prompt(route[0], route[1], arguments))
            described = [types.TextContent(type="text", text=got[0].description)] if got[0].description else []
            return types.CallToolResult(content=described + [m.content for m in got[0].messages])
        outcome = await self._screened(call, arguments, fetch, "prompt")
        return _as_prompt(outcome, call, started, got[0] if got else None)

    async def _call(self, caller: Caller, upstream: str, what: str) -> Call:
        session = None if caller.session_id is None else \
            await self._off_loop(self.linked_session, caller.principal, caller.session_id)
        return Call(caller.principal, session, upstream, exported_name(upstream, what), mcp_session=caller.mcp_session)

    async def _screened(self, call: Call, arguments: dict[str, Any],
                        fetch: Callable[[], Awaitable[types.CallToolResult]], what: str) -> Outcome:
        """Arguments screened, the call's record made durable, then `fetch` from the upstream, then
        its blocks screened; durable before returned."""
        try:
            doc = Document.of_arguments(arguments)
            refusal, record = await self._guarded(doc, self.guard.screen_arguments, call, doc)
            if refusal is not None:
                return await _durable(refusal, call)
            called = await _call_recorded(self.guard, call, record)
            return await _durable(await self._answered(call, called, fetch), call)
        except ScreeningError as exc:
            raise MCPError(types.INTERNAL_ERROR, f"lethe could not screen this {what}: {exc}") from exc

    async def _answered(self, call: Call, called: Called,
                        fetch: Callable[[], Awaitable[types.CallToolResult]]) -> Pending:
        """The upstream's answer to a recorded call, screened and queued; or, if there is none to
        give, the reason queued as the call's outcome: an upstream failure (the agent's error waits
        for its record), or a caller gone or a screening failed (queued, not waited for: the
        handler is ending)."""
        upstream_started = time.perf_counter()
        try:
            blocks = await fetch()
            call.spent["upstream"] = time.perf_counter() - upstream_started
            doc = Document.of_result(blocks)
            return await self._guarded(doc, self.guard.decide_result, call, blocks, doc, called)
        except UpstreamError as exc:
            await _durable(self.guard.unanswered(call, called, "upstream_error", str(exc)), call)
            raise MCPError(UPSTREAM_FAILED, str(exc)) from exc
        except BaseException as exc:  # cancelled (the caller went away: not an Exception), or a failure here
            self.guard.unanswered(call, called, "screening_failed" if isinstance(exc, Exception) else "caller_gone",
                                  type(exc).__name__)
            raise


async def _call_recorded(guard: Guard, call: Call, record: dict[str, Any]) -> Called:
    """Wait, on the event loop, until an allowed call's record is durable; before then nothing goes upstream."""
    queued_at = time.perf_counter()
    try:
        return Called(record, await _committed(guard.record_call(record)))
    except Exception as exc:
        raise call_unrecorded(call, exc) from exc
    finally:
        _spent_committing(call, queued_at)


def _spent_committing(call: Call, queued_at: float) -> None:
    call.spent["commit"] = call.spent.get("commit", 0.0) + time.perf_counter() - queued_at


def _read_route(upstream: str, _item: Any) -> str:
    """Resources and templates are screened under the tool name their reads go by."""
    return exported_name(upstream, RESOURCE_READ)


def _as_prompt(outcome: Outcome, call: Call, started: float,
               original: types.GetPromptResult | None) -> types.GetPromptResult:
    """The screened blocks back as the prompt's description and messages. A refusal or a
    quarantine is one user message naming the reason (the prompt's text is not sent)."""
    shown = outcome.result.content
    described = bool(original and original.description)
    if original is None or outcome.result.is_error or len(shown) != described + len(original.messages):
        messages = [types.PromptMessage(role="user", content=b) for b in shown]
        return types.GetPromptResult(messages=messages, meta=_meta(outcome, call, started))
    description = _text_of(shown[0]) if described else None
    messages = [m.model_copy(update={"content": b}) for m, b in zip(original.messages, shown[described:])]
    return types.GetPromptResult(description=description, messages=messages, meta=_meta(outcome, call, started))


def _as_contents(outcome: Outcome, call: Call, started: float, upstream: str, uri: str,
                 original: list[Any]) -> types.ReadResourceResult:
    """The screened blocks back as resource contents, each under its exported URI. A stub (a
    refusal, a quarantine, a withheld blob) is a text content naming the reason: never silence."""
    shown = outcome.result
    if shown.is_error or len(shown.content) != len(original):
        contents: list[Any] = [types.TextResourceContents(uri=uri, mime_type="text/plain", text=_text_of(b))
                               for b in shown.content]
    else:
        # a stub (a withheld blob) goes under the URI the agent asked for: the upstream's own for it
        # was screened as part of a block that is not shown
        contents = [b.resource.model_copy(update={"uri": exported_uri(upstream, b.resource.uri)})
                    if isinstance(b, types.EmbeddedResource) else
                    types.TextResourceContents(uri=uri, mime_type="text/plain", text=_text_of(b))
                    for b in shown.content]
    return types.ReadResourceResult(contents=contents, meta=_meta(outcome, call, started))


def _text_of(block: Any) -> str:
    """A block the screening made text (a description, a stub, a text resource's screened text);
    anything else there is a bug, and the agent gets an error rather than a guess."""
    if not isinstance(block, types.TextContent):
        raise MCPError(types.INTERNAL_ERROR, f"lethe expected a text block here, not {type(block).__name__}; "
                                             "nothing was passed on")
    return block.text


async def _durable(pending: Pending, call: Call) -> Outcome:
    """Wait, on the event loop rather than a guard thread, until the decision's records are
    committed: the guard's few threads stay free, so every call waiting at a commit joins the next
    one. The agent gets the outcome only after that; a failed commit is a ScreeningError. The
    commit's time runs from the records' submission (a commit on the loop is over by now)."""
    try:
        index = await _committed(pending.committed)
    except Exception as exc:
        raise pending.failed(exc) from exc
    finally:
        _spent_committing(call, pending.queued_at)
    return pending.outcome(index)


def _committed(future: Future[int]) -> Awaitable[int]:
    """`asyncio.wrap_future`, less a turn of the loop when the future is resolved on the loop's own
    thread (the `LoopRecorder`'s driver): there the waiter is set at once, where `wrap_future`
    would schedule the setting as one more callback behind everything the loop has queued."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[int] = loop.create_future()
    here = threading.get_ident()

    def copy(done: Future[int]) -> None:
        if waiter.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(done.result())

    def resolved(done: Future[int]) -> None:
        if threading.get_ident() == here:
            copy(done)
        else:
            loop.call_soon_threadsafe(copy, done)
    future.add_done_callback(resolved)
    return waiter


def _stamped(outcome: Outcome, call: Call, started: float) -> types.CallToolResult:
    """The result with the decision in `_meta` (the crossing id an auditor looks up, and the proxy's
    own time: the handler's wall time less the upstream's and the gate's; of it, the wait for the
    durable commits of the call's and the decision's records)."""
    return outcome.result.model_copy(update={"meta": {**(outcome.result.meta or {}), **_meta(outcome, call, started)}})


def _meta(outcome: Outcome, call: Call, started: float) -> dict[str, Any]:
    own = time.perf_counter() - started - call.spent.get("upstream", 0.0) - call.spent.get("gate", 0.0)
    return {META_KEY: {
        "action": outcome.decision.action, "crossing": outcome.crossing_id, "audit_index": outcome.audit_index,
        "overhead_ms": round(own * 1e3, 3), "gate_ms": round(call.spent.get("gate", 0.0) * 1e3, 3),
        "commit_ms": round(call.spent.get("commit", 0.0) * 1e3, 3)}}
