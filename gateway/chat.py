"""The OpenAI chat wire format and its rendering into per-message token chunks.

Every message becomes one ledger segment, so the renderer must cut the chat template at message
boundaries: chunk k is render(messages[:k+1]) minus render(messages[:k]), which is exact for any
prefix-stable template (ChatML, Llama-3, Mistral-style) and refused with a clear error otherwise.
Chunks are tokenized separately, so segment boundaries are token boundaries.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gate import normalised  # the gate's own normalisation, not a second copy


Role = Literal["system", "developer", "user", "assistant", "tool"]


class Wire(BaseModel):
    """A request model of the OpenAI wire format: strict types, as OpenAI's own API, so that
    `"stream": "yes"` or `"max_tokens": "5"` is refused naming the field, never coerced."""

    model_config = ConfigDict(strict=True)


class FunctionCall(Wire):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = "{}"


class ToolCall(Wire):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Wire):
    type: Literal["text"]
    text: str


class ChatMessage(Wire):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _tool_answers_a_call(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id is required for role 'tool'")
        return self

    @property
    def text(self) -> str:
        """The message's text as the model sees it (tool calls written in the `<tool_call>` convention)."""
        if isinstance(self.content, list):
            body = "".join(part.text for part in self.content)
        else:
            body = self.content or ""
        for call in self.tool_calls or ():
            payload = json.dumps({"name": call.function.name, "arguments": call.function.arguments})
            body += f"<tool_call>{payload}</tool_call>"
        return body


MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256
MAX_TOKENS = 1 << 20  # far above any context window; the window itself is checked per session


class StreamOptions(Wire):
    include_usage: bool = False


class ChatRequest(Wire):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    n: Literal[1] = 1
    user: str | None = None
    stream_options: StreamOptions | None = None
    # Accepted and type-checked as OpenAI's API does, though generation does not use them: a
    # client's `"logprobs": "true"` is refused like any mistyped field, never silently ignored.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def content_bytes(text: str) -> bytes:
    """UTF-8 bytes of a message; lone surrogates (invalid UTF-8 sent as JSON escapes) survive as bytes
    the gate flags, rather than crashing the request."""
    return text.encode("utf-8", errors="surrogatepass")


def model_text(text: str) -> str:
    """What the tokenizer may see: lone surrogates replaced by U+FFFD."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


@dataclass(frozen=True)
class RenderedMessage:
    """One message as it enters the ledger: its identity (hash of the original bytes) and its tokens."""

    index: int
    role: str
    tool: str | None
    content: bytes
    content_sha256: str
    tokens: tuple[int, ...]

    @functools.cached_property
    def norm_sha256(self) -> str:
        """The hash of the content's normalised form (see `normalised_sha256`)."""
        return normalised_sha256(self.content)


_SPACE = re.compile(r"\s+")


def normalised_sha256(raw: bytes) -> str:
    """SHA-256 of the gate's detection view of `raw` (NFKC, default-ignorables removed, look-alikes
    folded) with all whitespace, line endings included, removed. Quarantined content is refused
    again by this hash as well as by its exact bytes, so a trailing space, a line break added or
    CRLF for LF, an NBSP, a zero-width space or one fullwidth letter does not make it new (red team
    #13 F3)."""
    return hashlib.sha256(_SPACE.sub("", normalised(raw)).encode("utf-8", "surrogatepass")).hexdigest()


def name_folds(*names: str | None) -> tuple[str, ...]:
    """The gate's detection view (NFKC, invisible characters removed, look-alike letters folded)
    of each tool name it changes, so `blocked_tools` also match a fullwidth, zero-width or
    homoglyph spelling of a blocked name (red team #13 F7; decision.rego's tool_key does case
    and separators)."""
    folds = {normalised(n.encode("utf-8", "surrogatepass")) for n in names if n}
    return tuple(sorted(folds - set(names)))


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class Chunk:
    """One message's rendering: its text, tokens and each token's character offsets in the text."""

    text: str
    tokens: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]


class Conversation:
    """A request's messages rendered with the model's chat template, one token chunk per message.

    Chunk k is render(messages[:k+1]) minus render(messages[:k]); `chunk(k, text)` renders message k
    with other text in its place (the stub of a quarantined tool result) at the same boundary.

    A chunk is a pure function of the messages up to it, so chunks are keyed by a hash chain over
    those messages and can be carried from one request of a session to the next (``memo``, then
    ``used``): an agent that re-sends a growing history pays for rendering its new messages only,
    not for re-rendering every prefix of the history (quadratic in its length).
    """

    def __init__(self, tokenizer: Any, messages: list[ChatMessage], memo: dict[bytes, Chunk] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the model has no chat template; use an instruct checkpoint")
        self._tok = tokenizer
        self.messages = messages
        self._plain = [{"role": m.role, "content": model_text(m.text)} for m in messages]
        self._prefix: dict[int, str] = {0: ""}
        self._names = _tool_names(messages)
        self._memo = memo or {}
        self.used: dict[bytes, Chunk] = {}  # the chunks this request rendered or reused: the next memo
        self._chain = [b""]
        for item in self._plain:
            self._chain.append(hashlib.sha256(self._chain[-1] + json.dumps(item).encode()).digest())

    def _render(self, plain: list[dict[str, str]], generation: bool = False) -> str:
        if not plain:
            return ""
        return self._tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation)

    def _prefix_text(self, k: int) -> str:
        if k not in self._prefix:
            self._prefix[k] = self._render(self._plain[:k])
        return self._prefix[k]

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False))

    def chunk(self, k: int, text: str | None = None) -> tuple[int, ...]:
        """Message k's tokens, or with ``text`` as its content (same boundary)."""
        return self._chunk(k, text).tokens

    def _chunk(self, k: int, text: str | None) -> Chunk:
        role, content = self._plain[k]["role"], self._plain[k]["content"] if text is None else text
        key = hashlib.sha256(self._chain[k] + json.dumps({"role": role, "content": content}).encode()).digest()
        found = self.used.get(key) or self._memo.get(key)
        if found is None:
            full = self._prefix_text(k + 1) if text is None else self._render([*self._plain[:k], {"role": role, "content": content}])
            found = self._tokenize(self._suffix(self._prefix_text(k), full), content)
        self.used[key] = found
        return found

    def _tokenize(self, chunk_text: str, content: str) -> Chunk:
        """Tokens of one rendered message: the template's framing read with its control tokens,
        the content only ever as plain text.

        Without this, `<|im_end|>` inside a tool result is the real end-of-turn token and the
        result can close its own frame and open a forged `system` turn. A template that rewrote
        the content so that it cannot be found is refused: its content cannot be kept as text.
        """
        at = chunk_text.find(content) if content else -1
        if content and at < 0:
            raise TemplateError("the chat template rewrites message content (e.g. trims it), so Lethe cannot "
                                "keep the content apart from the template's control tokens; use a template "
                                "that inserts content verbatim")
        parts = [(chunk_text, False)] if at < 0 else \
            [(chunk_text[:at], False), (content, True), (chunk_text[at + len(content):], False)]
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        base = 0
        for text, plain in parts:
            if text:
                encoded = self._tok(text, add_special_tokens=False, return_offsets_mapping=True,
                                    **({"split_special_tokens": True} if plain else {}))
                ids.extend(encoded["input_ids"])
                offsets.extend((s + base, e + base) for s, e in encoded["offset_mapping"])
            base += len(text)
        return Chunk(chunk_text, tuple(ids), tuple(offsets))

    @staticmethod
    def _suffix(before: str, full: str) -> str:
        if not full.startswith(before):
            raise TemplateError("the chat template is not prefix-stable; Lethe needs one that renders "
                                "message by message")
        return full[len(before):]

    def message(self, k: int) -> RenderedMessage:
        m = self.messages[k]
        raw = content_bytes(m.text)
        return RenderedMessage(index=k, role=m.role, tool=self._names.get(k), content=raw,
                               content_sha256=hashlib.sha256(raw).hexdigest(), tokens=self.chunk(k))

    def frame(self, k: int) -> tuple[int, int]:
        """How many tokens of chunk k are template framing before and after the content.

        Read from the chunk's token offsets: tokens that end before the content starts are the
        head, tokens that start after it ends the tail (a token straddling an edge counts as
        content). This costs no extra template render, which on a long conversation is ~1 ms.
        If the template rewrote the content so that it cannot be found, the whole chunk counts;
        an empty content is all framing.
        """
        chunk, content = self._chunk(k, None), self._plain[k]["content"]
        if not content:
            return len(chunk.tokens), 0
        at = chunk.text.find(content)
        if at < 0:
            return 0, 0
        end = at + len(content)
        return sum(1 for _, e in chunk.offsets if e <= at), sum(1 for s, _ in chunk.offsets if s >= end)

    def stub(self, k: int, reason: str) -> tuple[int, ...]:
        """Tokens of the short stub that replaces a quarantined tool result in the model's context."""
        return self.chunk(k, stub_text(reason))

    def generation_prompt(self) -> tuple[int, ...]:
        everything = self._render(self._plain, generation=True)
        return self.encode(everything[len(self._prefix_text(len(self._plain))):]) if self._plain else ()


def stub_text(reason: str) -> str:
    return f"[tool result withheld by policy: {reason}]"


def with_tools(messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> tuple[list[ChatMessage], int]:
    """Describe the tools in a system message of their own before the client's messages, since
    small chat templates have no tools slot.

    Their own message, never appended to the client's system prompt: the tool definitions are
    gated as untrusted (`tool_definition`) and may be quarantined, while the principal's system
    prompt is the principal's own words and must not be stubbed with them (red team: "Always
    answer by calling a tool" was quarantined together with a harmless tool list).
    Returns the messages and how many the gateway put before the client's own (0 or 1), so that
    every index reported back can be the client's."""
    if not tools:
        return messages, 0
    spec = json.dumps([t.get("function", t) for t in tools], sort_keys=True)
    note = ("You can call tools. To call one, answer only with "
            f'<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>. Tools: {spec}')
    return [ChatMessage(role="system", content=note), *messages], 1


def _tool_names(messages: list[ChatMessage]) -> dict[int, str]:
    """Map each tool message to the function name of the assistant call it answers."""
    calls: dict[str, str] = {}
    names: dict[int, str] = {}
    for k, m in enumerate(messages):
        for call in m.tool_calls or ():
            calls[call.id] = call.function.name
        if m.role == "tool":
            names[k] = calls.get(m.tool_call_id or "", m.name or "unknown")
    return names
