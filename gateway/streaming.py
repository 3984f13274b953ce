"""A chat completion over HTTP: one turn running in a worker thread, seen from the event loop.

The turn runs start to end in its worker thread (`Gateway.run_turn`), so nothing the event loop
does — a client disconnect, a cancelled task, a response that is never started — can skip its end
or keep its session lock. The loop side only reads what the turn produces and, when the client
goes away, asks it to stop (`TurnRun.cancel`); the turn then ends at its next token.

Wire format as OpenAI sends it: a streamed completion is `chat.completion.chunk` events, the
last content chunk carries `finish_reason`, and `usage` comes only with
`stream_options.include_usage`, in its own final chunk whose `choices` is empty.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvkernel import GenerationConfig, Model

from .chat import ChatRequest
from .decoding import TextStream, parse_tool_calls
from .errors import GatewayError, internal
from .service import Gateway
from .tenants import Principal
from .turn import Turn

log = structlog.get_logger(__name__)

_END = object()


class TurnRun:
    """One turn in flight: the worker side is a `TurnChannel`, the loop side reads pieces of text."""

    def __init__(self, gateway: Gateway, model: Model, req: ChatRequest, cfg: GenerationConfig) -> None:
        self.gateway, self.model, self.req, self.cfg = gateway, model, req, cfg
        self.loop = asyncio.get_running_loop()
        self.pieces: asyncio.Queue[object] = asyncio.Queue()
        self.ready: asyncio.Future[Turn] = self.loop.create_future()
        self.work: asyncio.Future[Turn] | None = None
        self.text = TextStream(model.tokenizer, req.stops)
        self.count = 0
        self._cancel = threading.Event()
        self._watcher: asyncio.Future[None] | None = None
        self._reply: tuple[str, list[dict[str, Any]]] | None = None  # content and tool calls, parsed once
        self.id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    # ---- worker side (TurnChannel) ------------------------------------------------------------

    def prepared(self, turn: Turn) -> None:
        self._post(_resolve, self.ready, turn)

    def token(self, token: int) -> bool:
        self.count += 1
        piece = self.text.push(token)
        if piece:
            self._post(self.pieces.put_nowait, piece)
        return not self.text.stopped

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def tool_calls(self) -> list[dict[str, Any]]:
        return self._parsed(self.text.text)[1]

    def _parsed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The reply split into content and tool calls once: the call ids the gateway records are
        the ids the client receives."""
        if self._reply is None:
            self._reply = parse_tool_calls(text) if self.req.tools else (text, [])
        return self._reply

    def _post(self, fn: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is gone (shutdown): nobody reads, so stop
            self._cancel.set()

    # ---- loop side ----------------------------------------------------------------------------

    def cancel(self) -> None:
        self._cancel.set()

    def watch(self, receive: Receive) -> None:
        """Stop the turn when the client disconnects, from now until `close`."""
        self._watcher = asyncio.ensure_future(_watch_disconnect(receive, self))

    def close(self) -> None:
        """The response is done with this turn (sent, failed or abandoned): stop watching, and stop
        the turn if it still runs (a no-op once it has ended)."""
        self.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    def start(self, executor: Executor, principal: Principal, session_id: str | None) -> None:
        self.work = self.loop.run_in_executor(executor, self.gateway.run_turn, principal, session_id,
                                              self.req.messages, self.req.tools, self.cfg, self)
        self.work.add_done_callback(self._finished)

    def _finished(self, work: asyncio.Future[Turn]) -> None:
        error = GatewayError(500, "turn_cancelled", "the turn was cancelled") if work.cancelled() else work.exception()
        if not self.ready.done():
            self.ready.set_exception(error or GatewayError(500, "turn_error", "the turn ended before it started"))
            self.ready.exception()  # retrieved: an abandoned request must not warn about it
        self.pieces.put_nowait(_END)

    async def prepared_turn(self) -> Turn:
        """Wait until the prompt is staged (or the turn failed before that, raising its error)."""
        return await asyncio.shield(self.ready)

    async def outcome(self) -> Turn:
        assert self.work is not None
        return await asyncio.shield(self.work)

    @property
    def finish_reason(self) -> str:
        return "length" if self.count >= self.cfg.max_new_tokens and not self.text.stopped else "stop"

    def usage(self, turn: Turn) -> dict[str, int]:
        return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": self.count,
                "total_tokens": turn.prompt_tokens + self.count}

    def message(self, text: str) -> tuple[dict[str, Any], str]:
        content, calls = self._parsed(text)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message, ("tool_calls" if calls else self.finish_reason)

    @staticmethod
    def lethe(turn: Turn) -> dict[str, Any]:
        return {"session_id": turn.session_id, "actions": [a.to_dict() for a in turn.actions],
                "erasures": turn.erasures}

    async def text_pieces(self) -> AsyncIterator[str]:
        while (piece := await self.pieces.get()) is not _END:
            yield piece  # type: ignore[misc]
        rest = self.text.flush()
        if rest:
            yield rest


def _resolve(future: asyncio.Future[Turn], turn: Turn) -> None:
    if not future.done():
        future.set_result(turn)


def turn_headers(turn: Turn) -> dict[str, str]:
    return {"x-lethe-session": turn.session_id,
            "x-lethe-actions": ",".join(f"{a.message_index}:{a.action}" for a in turn.actions) or "none"}


async def _watch_disconnect(receive: Receive, run: TurnRun) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    log.info("turn.client_disconnected")
    run.cancel()


async def whole_completion(run: TurnRun) -> dict[str, Any]:
    """A non-streamed completion."""
    turn = await run.outcome()
    text = "".join([piece async for piece in run.text_pieces()])
    message, reason = run.message(text)
    return {"id": run.id, "object": "chat.completion", "created": run.created, "model": run.model.name,
            "choices": [{"index": 0, "message": message, "finish_reason": reason}], "usage": run.usage(turn),
            "lethe": run.lethe(turn)}


class CompletionStream(Response):
    """The ASGI response of a streamed completion (server-sent events)."""

    def __init__(self, run: TurnRun, headers: dict[str, str]) -> None:  # noqa: super().__init__ renders a body
        self.run = run
        self.status_code = 200
        self.background = None
        self.raw_headers = [(k.encode(), v.encode()) for k, v in
                        {**headers, "content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
                        .items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self._events():
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client is gone; the turn is told to stop below
            pass
        finally:
            self.run.close()

    def _chunk(self, delta: dict[str, Any] | None, reason: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason}]
        body = {"id": self.run.id, "object": "chat.completion.chunk", "created": self.run.created,
                "model": self.run.model.name, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    async def _events(self) -> AsyncIterator[str]:
        run = self.run
        yield self._chunk({"role": "assistant", "content": ""})
        pieces: list[str] = []
        async for piece in run.text_pieces():
            pieces.append(piece)
            if not run.req.tools:
                yield self._chunk({"content": piece})
        try:
            turn = await run.outcome()
        except Exception as exc:  # after the headers: the error goes out as an event, in the OpenAI shape
            err = exc if isinstance(exc, GatewayError) else internal(exc)
            if not isinstance(exc, GatewayError):
                log.error("stream.failed", error=f"{type(exc).__name__}: {exc}")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        message, reason = run.message("".join(pieces))
        delta = {k: v for k, v in message.items() if k != "role"} if run.req.tools else {}
        yield self._chunk(delta, reason, lethe=run.lethe(turn))
        if run.req.include_usage:
            yield self._chunk(None, usage=run.usage(turn))
        yield "data: [DONE]\n\n"
