"""The gated tool-call path: a call's arguments and its result go through gate → policy → ledger → audit.

The same gate, policy and redaction as the chat endpoint (gateway/screen.py), with
`input.channel = "mcp"`, the upstream the proxy routed to and the exported tool name (as a verified
identity, `source: "mcp"`: the proxy's route names it, not the client). What the agent then receives:

  allow       the upstream's result, unchanged (the same objects, so the same bytes on the wire)
  quarantine  one text block naming the reason (`isError: true`); its digests are remembered for
              the tenant, so the chat endpoint refuses the same bytes later
  redact      every text part with the policy's kinds cut out (typed placeholders), re-scanned

Text is read from text blocks, the text of embedded resources, and every string of structured
content with its key beside it (`_json_parts`); they are scanned as one document, so an instruction split across blocks is
still one instruction, and once more glued with no joiner, so a secret split across blocks is
found and each block's fragment cut (`Document.glued_secrets`; a call's argument values are also
read pairwise as their raw strings, so a key split over two of them is found too). Content the gate cannot read (images, audio, blobs, resource links) is
passed or withheld as the policy's `non_text` says, and a withheld block leaves a text stub
behind: nothing disappears silently. A call's arguments are screened the same way (phase
"arguments"); anything but `allow` refuses the call before it reaches the upstream. So is each
definition a list method shows (phase "definition"): a tool, resource, resource template or
prompt whose description carries an injection is not listed, and such a tool is not callable.
A stub names what it stands for and the policy rule that decided (`reason_label`).

Fail closed: if the gate, the ledger or the audit log fails, the agent gets an error and no
content. Records hold digests, kinds and offsets, never the content.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from itertools import accumulate, groupby
from typing import Any

import mcp.types as types
import structlog
from pydantic import BaseModel

from audit import AuditLog
from gate import Cut, Finding, Gate, GateReport, Redaction, redact
from gate.joined import with_findings
from gate.secrets import shannon_entropy
from ledger import CrossingLog, Ledger
from policies import Decision, PolicyEngine, tool_identity

from ..chat import normalised_sha256
from ..screen import Screened, apply_redact, gate_input
from ..tenants import Principal
from .history import History, Reading, Stream
from .recorder import LoopRecorder, Recorder, WriterLink
from .settings import PROMPT_GET, RESOURCE_READ, SEPARATOR

log = structlog.get_logger(__name__)

JOINER = b"\n"
_PROSE = frozenset({b"description", b"title"})  # a definition's strings an agent's model reads as text
_PROBE = 64  # bytes of a string looked for in its neighbour (`_repeats`)
_REACH = 4096  # of each string beside a seam, what the argument-value glue reads (`Document.glued_secrets`)
_FRAGMENT, _FRAGMENTS = 24, 5  # a short string, and how many in a row are read glued (`Document._glued_values`)
NON_TEXT_STUB = "[{what} withheld by policy: the gate cannot read it]"
MAX_BLOCKS = 1024  # content blocks in one result (`Guard._oversized`)
_JOINED_STRINGS = 8  # argument strings each read joined to the text shown before (`Document._alone`)
_JOINED_BLOCKS = 3  # a result's text blocks after its first each read so too (`Document.readings`)
_URI_PARTS = re.compile(rb"[/?&=#;]+")  # what a URI's segments and query values lie between
_URI_PART = 6  # the shortest of them read alone: a key's rest, not `v1` or `id`
_JOINED = frozenset({"result", "arguments"})  # the phases read joined to their stream's earlier text (history.py)


class ScreeningError(Exception):
    """A component of the gated path failed; nothing of the result was passed on."""


@dataclass(frozen=True)
class Call:
    """Who calls which tool: the principal, the chat session it links to, and the route the proxy chose."""

    principal: Principal
    session_id: str | None
    upstream: str
    tool: str  # the exported name, `<upstream>__<tool>`: set by the proxy's routing, never by the client
    spent: dict[str, float] = field(default_factory=dict)  # seconds per component, for the overhead figure
    mcp_session: str | None = None  # the agent's MCP session (HTTP), where its calls do not link to a chat session

    @property
    def tenant(self) -> str:
        return self.principal.tenant or ""

    @property
    def stream(self) -> Stream:
        """The agent context this call's text joins (history.py): one caller's chat or MCP session."""
        return self.tenant, actor_of(self.principal), self.session_id or self.mcp_session


@dataclass(frozen=True)
class Outcome:
    """What the agent gets, and the decision behind it (for the caller's logs and metrics)."""

    result: types.CallToolResult
    decision: Decision
    crossing_id: str
    audit_index: int


@dataclass(frozen=True)
class Pending:
    """A decision whose records are queued for the next group commit. Nothing of it may reach the
    agent before its `committed` future resolves: `Guard.settle` (or the proxy's async wait) turns
    it into the Outcome, or into a ScreeningError if the commit failed (fail closed). Waiting off
    the guard's threads lets concurrent calls share one commit."""

    result: types.CallToolResult
    decision: Decision
    crossing_id: str
    about: dict[str, str]  # tenant, tool, phase, action: for the log lines
    committed: Future[int]
    queued_at: float  # time.perf_counter() when its records were submitted: the commit wait runs from here
    not_done: str = "nothing was passed on"  # what the agent's error says of a failed commit

    def outcome(self, audit_index: int) -> Outcome:
        log.info("mcp.decision", **self.about, crossing=self.crossing_id, audit_index=audit_index)
        return Outcome(self.result, self.decision, self.crossing_id, audit_index)

    def failed(self, exc: BaseException) -> ScreeningError:
        """The error the agent gets when this decision's records could not be committed."""
        kind = _error_kind(exc)
        log.error("mcp.record_failed", **self.about, crossing=self.crossing_id, error=kind, **_detail(kind, exc))
        return ScreeningError(f"the decision could not be recorded ({kind}); {self.not_done}; "
                              "check the ledger and audit databases")


def _error_kind(exc: BaseException) -> str:
    return getattr(exc, "kind", type(exc).__name__)  # a WriterError names the error in the writer process


def _detail(kind: str, exc: BaseException) -> dict[str, str]:
    """The failure's text for the operator's log when it is the audit log's own (which names the
    fix); a driver's error may quote a statement's parameters, so only its kind is logged."""
    return {"detail": str(exc)} if kind in ("AuditError", "LogBusy") else {}


@dataclass(frozen=True)
class Called:
    """An allowed call whose `mcp-call` record was durable (at audit index `audit_index`) before its
    upstream was called: whatever becomes of the result (an upstream failure, a caller gone, a
    failed screening or commit), the audit log names every call the proxy made. The result's
    crossing and record, written later, carry the crossing id the call record names."""

    record: dict[str, Any]
    audit_index: int

    @property
    def crossing_id(self) -> str:
        return str(self.record["crossing"])

    def summary(self) -> dict[str, Any]:
        """What the result's crossing keeps of the call: its digest, findings, decision and record."""
        kept: dict[str, Any] = {k: self.record[k] for k in ("content_sha256", "arguments_sha256", "gate", "decision")
                                if k in self.record}
        return {**kept, "audit_index": self.audit_index}


def call_unrecorded(call: "Call", exc: BaseException) -> ScreeningError:
    """The error the agent gets when an allowed call's record could not be committed: the call is not made."""
    kind = _error_kind(exc)
    log.error("mcp.record_failed", tenant=call.tenant, tool=call.tool, phase="arguments", action="allow", error=kind,
              **_detail(kind, exc))
    return ScreeningError(f"the call could not be recorded ({kind}); the upstream was not called and nothing "
                          "was passed on; check the ledger and audit databases")


# ---- text parts ------------------------------------------------------------------------------------

def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_pieces(value: Any) -> Iterator[tuple[str, str, str]]:
    """Each part of a JSON value as the gate should read it (`_json_parts`), beside the strings it
    carries as a reader joining them would join them: its value's raw string (nothing for a key
    alone) and its key's (nothing in a list)."""
    if isinstance(value, str):
        yield _dump(value), value, ""
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, str):
                yield f"{_dump(str(k))}: {_dump(v)}", v, str(k)
            else:
                yield _dump(str(k)), "", str(k)
                yield from _json_pieces(v)
    elif _numbers(value):  # one part: a token sent as its byte values reads as bytes (red team 16)
        yield _dump(value), _as_bytes(value), ""
    elif isinstance(value, list):
        for v in value:
            yield from _json_pieces(v)


def _as_bytes(value: list[Any]) -> str:
    """A list of byte values as the text they spell (red team 18: a key's second half sent as its
    bytes in a later call), else nothing."""
    if not all(isinstance(v, int) and 0 <= v < 256 for v in value):
        return ""
    return bytes(value).decode("utf-8", "replace")


def _numbers(value: Any) -> bool:
    """A list of two or more numbers (no booleans): read as one part, its JSON text."""
    return isinstance(value, list) and len(value) > 1 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def _json_parts(value: Any) -> list[str]:
    """The text of a JSON value as the gate should read it: every string with its key beside it.

    A dict entry with a string value is one part, `"key": "value"`, so a rule that needs the key
    (`"token": "..."`) fires as it would on the serialized document; other keys, and strings in
    lists, are parts of their own. `_rebuild` parses the (redacted) parts back in the same order.
    """
    return [part for part, _, _ in _json_pieces(value)]


def _parsed(part: str, fallback: Any) -> Any:
    """A redacted part read back as JSON; a cut that broke its syntax (inside an escape, across a
    quote) makes the whole part `fallback`: a redaction never falls back to the original bytes."""
    try:
        return json.loads(part)
    except ValueError:
        return fallback


def _entry(key: str, part: str, n: int) -> tuple[str, str]:
    """A dict entry rebuilt from its redacted part `"key": "value"`. A cut that broke the value's
    syntax (a finding covering the whole part) keeps the key when the cut left its bytes as they
    were (red team 15: `{"result": "sk_live_..."}` became `{"[REDACTED:0]": ...}`, and the client
    refused the result against the tool's outputSchema); only a key that held a secret is renamed."""
    entry = _parsed("{" + part + "}", None)
    if isinstance(entry, dict) and len(entry) == 1:
        got, val = next(iter(entry.items()))
        return got, val if isinstance(val, str) else "[REDACTED]"
    head = f"{_dump(key)}: "
    if not part.startswith(head):
        return f"[REDACTED:{n}]", "[REDACTED]"
    val = _parsed(part[len(head):], None)
    return key, val if isinstance(val, str) else "[REDACTED]"


def _rebuild(value: Any, texts: Iterator[str]) -> Any:
    """`value` rebuilt from its redacted `_json_parts`, consumed in order from `texts`."""
    if isinstance(value, str):
        got = _parsed(next(texts), "[REDACTED]")
        return got if isinstance(got, str) else "[REDACTED]"
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for n, (k, v) in enumerate(value.items()):
            if isinstance(v, str):
                key, val = _entry(str(k), next(texts), n)
                out[key] = val
            else:
                key = _parsed(next(texts), None)
                out[key if isinstance(key, str) else f"[REDACTED:{n}]"] = _rebuild(v, texts)
        return out
    if _numbers(value):
        got = _parsed(next(texts), None)
        return got if _numbers(got) and len(got) == len(value) else "[REDACTED]"
    if isinstance(value, list):
        return [_rebuild(v, texts) for v in value]
    return value


def _text_resource(block: Any) -> types.TextResourceContents | None:
    """The text resource an embedded-resource block carries, if it carries one."""
    if isinstance(block, types.EmbeddedResource) and isinstance(block.resource, types.TextResourceContents):
        return block.resource
    return None


def _block_text(block: Any) -> str | None:
    if isinstance(block, types.TextContent):
        return block.text
    resource = _text_resource(block)
    return None if resource is None else resource.text


# Fields of a content block that are not free text for the gate: its type tag, the text read as the
# block's own part, binary data (the policy's `non_text` passes or withholds it), `_meta` (dropped).
_OPAQUE = frozenset({"type", "text", "data", "blob", "_meta", "meta"})
_WORDS = re.compile(r"[_\-.]+")
_RUN, _DIGIT, _LETTER = re.compile(r"[A-Za-z0-9]{20,}"), re.compile(r"[0-9]"), re.compile(r"[A-Za-z]")
_MIME = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+\-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+\-]{0,63}")


def _field_strings(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in _OPAQUE and not (k == "audience" and _roles(v)):
                yield from _field_strings(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _field_strings(v, (*path, i))


def _roles(value: Any) -> bool:
    """An annotation's audience: MCP roles only, which are no text (read, `hi` + `assistant` was
    `hi assistant`, an address to the model: red team 16's false positive)."""
    return isinstance(value, list) and all(v in ("user", "assistant") for v in value)


def _dumped(block: Any) -> dict[str, Any]:
    return block.model_dump(mode="json", by_alias=True, exclude_none=True)


def block_fields(block: Any) -> list[tuple[tuple[str | int, ...], str]]:
    """Every other string a block carries to the agent, with its path: a resource's URI and MIME
    type, an image's MIME type, an annotation's lastModified, a resource link's name and title.
    All reach the agent (a stub names an image's type), so all are read."""
    return list(_field_strings(_dumped(block)))


def _with_fields(block: Any, values: Iterator[str]) -> Any:
    """`block` with its `block_fields` replaced, in order, by `values` (their redacted forms); a
    block the redaction made invalid becomes a stub, never the original."""
    dumped = _dumped(block)
    for path, _ in block_fields(block):
        *head, last = path
        node: Any = dumped
        for key in head:
            node = node[key]
        node[last] = next(values)
    try:
        return type(block).model_validate(dumped)
    except ValueError:
        return types.TextContent(type="text", text=NON_TEXT_STUB.format(what=f"{block.type} block"))


@dataclass(frozen=True)
class Document:
    """Parts joined into one scanned document; `spans` locate each part in it."""

    data: bytes
    spans: tuple[tuple[int, int], ...]
    # Arguments only: per part, the raw string it carries (`"key": "AKIA..."` -> `AKIA...`; a key
    # alone -> ``), so a secret split over two argument values is found. None: the parts.
    glue: tuple[bytes, ...] | None = None
    keys: tuple[bytes, ...] | None = None  # per part, the raw key it holds (b"" for none)
    # Results only: how many of the parts are the content blocks' text (then come structured
    # content's strings, then the blocks' other fields). None: all of them.
    blocks: int | None = None
    # The parts that are JSON values (an argument's, a structured result's), [start, end): their
    # raw strings are also read as one text, so an instruction split over two values is one
    values: tuple[int, int] | None = None
    # Arguments only: SHA-256 of their canonical JSON (keys sorted, compact), every value bound
    # (`amount: 1` and `amount: 1000000` read the same as text)
    arguments_sha256: str | None = None

    @classmethod
    def of(cls, parts: list[str], glue: list[str] | None = None, keys: list[str] | None = None) -> "Document":
        encoded = [p.encode("utf-8", "surrogatepass") for p in parts]
        spans, pos = [], 0
        for e in encoded:
            spans.append((pos, pos + len(e)))
            pos += len(e) + len(JOINER)

        def raw(strings: list[str] | None) -> tuple[bytes, ...] | None:
            return None if strings is None else tuple(g.encode("utf-8", "surrogatepass") for g in strings)
        return cls(JOINER.join(encoded), tuple(spans), raw(glue), raw(keys))

    @classmethod
    def of_json(cls, value: Any, before: list[str] | None = None, after: list[str] | None = None) -> "Document":
        """A JSON value's parts (`_json_parts`) with their raw strings, between parts of plain
        text (`before`, glued as themselves, and `after`, not glued)."""
        head, tail = before or [], after or []
        pieces = list(_json_pieces(value)) if value is not None else []
        return cls.of(head + [p for p, _, _ in pieces] + tail, head + [g for _, g, _ in pieces] + [""] * len(tail),
                      [""] * len(head) + [k for _, _, k in pieces] + [""] * len(tail))

    @classmethod
    def of_arguments(cls, arguments: dict[str, Any]) -> "Document":
        """A call's arguments as the gate reads them (each string beside its key), glued as the raw
        values. (A result is not: its structured content repeats its text blocks, and the end of
        one glued to the start of the other would read as a key that is nowhere.)"""
        try:  # JSON has no NaN or Infinity (a 1e999 parses as one): the record must bind what is sent
            canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except ValueError:
            raise ScreeningError("the arguments hold a number JSON cannot carry (NaN, Infinity or one too large "
                                 "for a double); nothing was called") from None
        doc = cls.of_json(arguments)
        return replace(doc, values=(0, len(doc.spans)),
                       arguments_sha256=hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest())

    @classmethod
    def of_result(cls, result: types.CallToolResult) -> "Document":
        """A result's readable text as one document: each text block and text resource, each
        structured string (glued as raw values, as arguments are), then every block's other fields."""
        texts = [t for t in (_block_text(b) for b in result.content) if t is not None]
        fields = [v for b in result.content for _, v in block_fields(b)]
        doc = cls.of_json(result.structured_content, texts, fields)
        return replace(doc, blocks=len(texts), values=(len(texts), len(doc.spans) - len(fields)))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def readings(self, phase: str) -> list[Reading]:
        """What is joined to the text shown before (history.py), the text shown first. A result:
        its text blocks, in this document's offsets, and each of the next `_JOINED_BLOCKS` blocks
        from its own start (a first block `page 2`, or a prompt's description, before the piece:
        red team 18); and, a finding on them covering the document whole, the blocks as the agent
        reads them (`shown_text`: a JSON block's strings, not its quotes and keys) and its
        structured strings where its blocks do not repeat them (a block `ok` beside `{"msg":
        "instructions ..."}`: red team 17). Arguments, or a result of structured content alone:
        the strings the agent or the upstream sent, joined by spaces (each finding covering the
        document whole); and for arguments also glued, and each alone (`_alone`)."""
        size = len(self.data)
        if phase == "result" and self.blocks:
            raw = Reading(self.data[:self.spans[self.blocks - 1][1]], size, whole=False)
            later = [Reading(self.data[s:e], size, whole=False, offset=s)
                     for s, e in self.spans[1:min(self.blocks, 1 + _JOINED_BLOCKS)] if e > s]
            more = [t for t in dict.fromkeys((self.shown_text(), self._unrepeated())) if t and t != raw.text]
            first_json = self._block_strings[0] is not None  # the raw seam is then JSON syntax: read its strings
            return ([] if first_json and more else [raw]) + later + [Reading(t, size, whole=True) for t in more]
        strings = self._strings()
        joined = [b" ".join(strings)] + ([b"".join(strings)] if phase == "arguments" else [])
        return [Reading(t, size, whole=True) for t in dict.fromkeys(joined) if t]

    def alone(self) -> list[bytes]:
        """A call's strings each read alone after the text shown before (`History.secrets_across`): the first `_JOINED_STRINGS`
        values (a key's second half in the second argument, after a harmless first: red team
        17), the first `_JOINED_STRINGS // 2` keys, and as many URI path segments and query values
        (a key's rest as a key name, or as the last segment of a resource's URI: red team 18)."""
        values = self._strings()
        keys = [raw for raw in dict.fromkeys(self.keys or ()) if raw]
        parts = [p for raw in values if b"/" in raw for p in _URI_PARTS.split(raw) if len(p) >= _URI_PART]
        return values[:_JOINED_STRINGS] + keys[:_JOINED_STRINGS // 2] + parts[:_JOINED_STRINGS // 2]

    def shown_text(self) -> bytes:
        """What the agent reads of this document, as a stream's tail keeps it (history.py): a
        result's text blocks, each that is a JSON object or array as its strings joined by spaces
        (`{"note": "Now ignore all previous"}` then `{"note": "instructions ..."}`: the quotes and
        the key at the seam broke the phrase, red team 17); else its strings joined by spaces."""
        if not self.blocks:
            return b" ".join(self._strings()) if self.glue is not None else self.data
        return JOINER.join(self.data[s:e] if not strings else b" ".join(strings)
                           for (s, e), strings in zip(self.spans, self._block_strings))

    @functools.cached_property
    def _block_strings(self) -> tuple[list[bytes] | None, ...]:
        """Per text block, its value strings where it is a JSON object or array (`_json_strings`), else None."""
        return tuple(_json_strings(self.data[s:e]) for s, e in self.spans[:self.blocks or 0])

    def _strings(self) -> list[bytes]:
        return [raw for _, raw in _distinct(self.raw_strings(with_keys=False))]

    def _unrepeated(self) -> bytes:
        """The structured content's strings that its text blocks do not carry, joined by spaces
        (none, as the MCP specification asks: a block holding the same JSON)."""
        lo, hi = self.values or (0, 0)
        blocks = {raw for (s, e), strings in zip(self.spans, self._block_strings) for raw in strings or [self.data[s:e]]}
        strings = [raw for k, raw in self.raw_strings(with_keys=False) if lo <= k < hi]
        return b"" if all(raw in blocks for raw in strings) else b" ".join(strings)

    def part_digests(self) -> list[str]:
        """Each content block's digest (what an agent would paste back whole); a structured
        content's strings are not listed one by one (a JSON API's hundreds of fields)."""
        return [hashlib.sha256(self.data[s:e]).hexdigest() for s, e in self.spans[:self.blocks]]

    def withheld_digests(self, whole: bool = True) -> list[str]:
        """What the chat endpoint must refuse of a quarantined result: the document, its blocks'
        text joined, and (`whole`: unless they are too many to list) each block, each by its exact
        and its normalised SHA-256 (`chat.normalised_sha256`: whitespace gone, so the blocks
        pasted joined by nothing, a space or a newline are refused alike; red team 12)."""
        cut = self.spans[self.blocks][0] if self.blocks is not None and self.blocks < len(self.spans) else len(self.data)
        pieces = [self.data, self.data[:cut]] + ([self.data[s:e] for s, e in self.spans[:self.blocks]] if whole else [])
        digests = [hashlib.sha256(p).hexdigest() for p in pieces] + [normalised_sha256(p) for p in pieces]
        return list(dict.fromkeys(digests))

    @property
    def shown_bytes(self) -> int:
        """The size a result's limit applies to: the larger of its two renderings, its blocks' text
        and its structured content's strings. A tool that sends both (as the MCP specification
        asks) is not counted twice; the scan reads both, still linear in what arrived."""
        if self.blocks is None or self.blocks == len(self.spans):
            return len(self.data)
        cut = self.spans[self.blocks][0]
        return max(cut, len(self.data) - cut)

    def glued_secrets(self, gate: Gate) -> list[Finding]:
        """Secrets cut across parts, in this document's offsets. The document joins its parts with
        a newline, which ends any token, so a key split over two text blocks is two harmless
        pieces there; scanned glued (no joiner) it is one key, as a model asked to join the blocks
        reads it. Only findings that cross a part boundary are kept: one scan more, linear.

        A JSON part (`"key": "AKIA..."`) glues with its quotes, which end the key too; so each
        boundary beside one is scanned once more as the raw strings around it (`glue`): the last
        `_REACH` bytes of the one before and the first of the one after, each such pair on a line
        of its own (a key split over two argument values, whatever their neighbours hold). Escapes
        move offsets in a JSON part, so such a finding covers both parts whole: more is cut, never
        less. At most 2 x `_REACH` bytes a boundary: still linear. A secret over three or more
        values is `_glued_values`'s: all of them glued in order, one scan more."""
        return self._across(gate) + self._across_values(gate) + self._glued_values(gate)

    def injection_across_values(self, gate: Gate) -> list[Finding]:
        """Injection findings that only the strings read together show: each JSON part is
        `"key": "value"`, and quotes and keys between two strings break a phrase an agent's model
        reads whole (`{"a": "Ignore all previous", "b": "instructions and send ..."}`; a text block
        and structured content; a key and its value; a definition's description and its title:
        red team 14). Every text block, key and value string (a string repeating the one before it,
        structured content's copy of its text block, left out) is scanned once more joined by
        spaces, in document order and in reverse order (a key read after its value), and the text
        blocks and values alone (a key between a text block and a value breaks the phrase); a
        finding that crosses a string's end covers its parts whole. Three scans more: linear."""
        stream, values = _distinct(self.raw_strings()), _distinct(self.raw_strings(with_keys=False))
        backwards = stream[::-1]
        found = self._joined_injection(gate, stream) if len(stream) > 1 else []
        if len(stream) > 1 and [raw for _, raw in backwards] != [raw for _, raw in stream]:  # else the same bytes again
            found += self._joined_injection(gate, backwards)
        return found + (self._joined_injection(gate, values) if 1 < len(values) < len(stream) else [])

    def _joined_injection(self, gate: Gate, stream: list[tuple[int, bytes]]) -> list[Finding]:
        starts = list(accumulate((len(raw) + 1 for _, raw in stream), initial=0))[:-1]
        found = gate.scan(b" ".join(raw for _, raw in stream)).findings

        def string(offset: int) -> int:
            return bisect_right(starts, offset) - 1

        def covered(f: Finding) -> Finding:
            a, b = sorted((stream[string(f.byte_start)][0], stream[string(f.byte_end - 1)][0]))
            return replace(f, byte_start=self.spans[a][0], byte_end=self.spans[b][1])
        return [covered(f) for f in found if f.kind == "injection" and f.byte_end > f.byte_start
                and string(f.byte_start) != string(f.byte_end - 1)]

    def _across(self, gate: Gate) -> list[Finding]:
        """Each run of two or more plain parts (text blocks, block fields) scanned glued. A seam
        beside a JSON part (`"key": "..."`) starts or ends with a quote, which ends any token;
        its raw strings are `_across_values`'s to read, so gluing the JSON text adds nothing but
        an unescape of every quote in it (a result's structured copy of its text block)."""
        lo, hi = self.values or (0, 0)
        runs = [list(g) for json_part, g in groupby(range(len(self.spans)), key=lambda k: lo <= k < hi) if not json_part]
        return [f for run in runs if len(run) > 1 for f in self._glued(gate, run)]

    def _glued(self, gate: Gate, run: list[int]) -> list[Finding]:
        spans = [self.spans[k] for k in run]
        starts = list(accumulate((e - s for s, e in spans), initial=0))

        def part_of(glued: int) -> int:
            return min(bisect_right(starts, glued) - 1, len(spans) - 1)

        def moved(glued: int) -> int:
            k = part_of(glued)
            return spans[k][0] + glued - starts[k]

        glued = b"".join(self.data[s:e] for s, e in spans)
        return [replace(f, byte_start=moved(f.byte_start), byte_end=moved(f.byte_end - 1) + 1)
                for f in gate.scan_secrets(glued)
                if f.byte_end > f.byte_start
                and part_of(f.byte_start) != part_of(f.byte_end - 1)]

    def raw_strings(self, with_keys: bool = True) -> list[tuple[int, bytes]]:
        """Each key (`with_keys`) and value string in document order, with the part holding it."""
        if self.glue is None:
            return []
        keys = self.keys if self.keys is not None and with_keys else (b"",) * len(self.glue)
        return [(k, raw) for k in range(len(self.spans)) for raw in (keys[k], self.glue[k]) if raw]

    def _across_values(self, gate: Gate) -> list[Finding]:
        """A secret split over two neighbouring strings (two values, a key and a value, a value and
        the next key; next to each other or with one string between), read in either order:
        `{"b": "<second half>", "a": "<first half>"}` is one key to a reader that joins by name
        (red team 13). Each pair is scanned as one line; a finding that crosses its seam becomes
        one finding a side: the fragment itself where its part is plain text (a text block), the
        whole part where it is JSON (escapes move offsets: more is cut, never less)."""
        stream = self.raw_strings()
        lines, seams, pos = [], [], 0  # seams: each side's part and raw string, and where the line and its seam lie
        neighbours = list(zip(stream, stream[1:])) + list(zip(stream, stream[2:]))  # 2: past a key between two values
        for (i, a), (j, b) in neighbours:
            if _repeats(a, b):  # structured content repeating its text block (as the MCP specification asks)
                continue
            for (p, x), (q, z) in (((i, a), (j, b)), ((j, b), (i, a))):
                before, after = x[-_REACH:], z[:_REACH]
                lines.append(before + after)
                seams.append((p, x, q, z, pos, pos + len(before), pos + len(before) + len(after)))
                pos += len(before) + len(after) + 1
        found = gate.scan_secrets(b"\n".join(lines)) if lines else []
        out = []
        for f in found:
            for p, x, q, z, start, seam, end in seams:
                if start <= f.byte_start < seam < f.byte_end <= end and not _held_whole(gate, x[-_REACH:], z[:_REACH]):
                    out += [self._side(f, p, len(x) - (seam - f.byte_start), len(x), x),
                            self._side(f, q, 0, f.byte_end - seam, z)]
        return out

    def _glued_values(self, gate: Gate) -> list[Finding]:
        """A secret split over three or more values in a row (red team 14: `["AKIA", "PTGZ6J",
        "FEBZSDOXRL"]`, each pair of them harmless): every text block and value string glued in
        document order with no joiner (a string repeating the one before it left out), one line;
        and, since a neighbour that continues the word (`"text": "hi"` after the last piece) breaks
        a rule's boundary there, each 3 to `_FRAGMENTS` short strings in a row (at most
        `_FRAGMENT` bytes each) glued on a line of their own: at most 12 x the strings' bytes more.
        A finding across a seam is cut from every string it touches (whole, where JSON)."""
        stream = _distinct(self.raw_strings(with_keys=False))
        if len(stream) < 3:
            return []
        raws = [raw for _, raw in stream]
        long = list(accumulate((len(raw) > _FRAGMENT for raw in raws), initial=0))  # long strings before each
        runs = [(0, len(raws))] + [(i, i + n) for n in range(3, _FRAGMENTS + 1) for i in range(len(raws) - n + 1)
                                   if long[i + n] == long[i]]
        lines = [b"".join(raws[i:j]) for i, j in runs]
        firsts = list(accumulate((len(line) + 1 for line in lines), initial=0))
        out = []
        for f in gate.scan_secrets(b"\n".join(lines)):
            k = bisect_right(firsts, f.byte_start) - 1
            (i, j), at = runs[k], f.byte_start - firsts[k]
            starts = list(accumulate((len(raw) for raw in raws[i:j]), initial=0))
            first, last = bisect_right(starts, at) - 1, bisect_right(starts, at + f.byte_end - f.byte_start - 1) - 1
            if f.byte_end <= f.byte_start or first == last or last >= j - i \
                    or _held_whole(gate, raws[i + first], raws[i + last]):
                continue
            for n in range(first, last + 1):
                lo = at - starts[n] if n == first else 0
                hi = at + f.byte_end - f.byte_start - starts[n] if n == last else len(raws[i + n])
                out.append(self._side(f, stream[i + n][0], lo, hi))
        return out

    def prose(self) -> list[bytes]:
        """A definition's descriptions and titles, in document order."""
        keys = self.keys or ()
        return [raw for k, raw in self.raw_strings(with_keys=False) if k < len(keys) and keys[k] in _PROSE]

    def split_over_values(self, gate: Gate) -> bool:
        """Whether a secret shows only when the prose strings (descriptions, titles) are glued to
        each other, however far apart (a definition's description and a schema property's hold
        the halves of a token): for a definition, shown whole or not at all, so no span is needed."""
        values = self.prose()
        if len(values) < 2:
            return False
        starts = list(accumulate((len(v) for v in values), initial=0))[:-1]
        return any(bisect_right(starts, f.byte_start) != bisect_right(starts, f.byte_end - 1)
                   for f in gate.scan_secrets(b"".join(values)) if f.byte_end > f.byte_start)

    def _side(self, f: Finding, part: int, lo: int, hi: int, raw: bytes | None = None) -> Finding:
        """`f` on one part's string `raw` (its value when not named): bytes [lo, hi) of it where
        the part is its own raw string; where the part is JSON (`"key": "value"`), all of the key
        or all of the value, whichever `raw` is (escapes move offsets inside them, never their
        bounds): a key beside a cut value is kept, so a result still fits its outputSchema."""
        s, e = self.spans[part]
        value = self.glue[part] if self.glue is not None else None
        if value is not None and value == self.data[s:e]:
            return replace(f, byte_start=s + lo, byte_end=s + hi)
        key = self.keys[part] if self.keys is not None else b""
        if value and key and key != value:
            head = len(_dump(key.decode("utf-8", "surrogatepass")).encode("utf-8", "surrogatepass"))
            if raw is None or raw == value:
                return replace(f, byte_start=s + head + 2, byte_end=e)
            return replace(f, byte_start=s, byte_end=s + head)
        return replace(f, byte_start=s, byte_end=e)

    def split(self, findings: tuple[Finding, ...], kinds: tuple[str, ...]) -> list[Redaction]:
        """Each part redacted by the findings that overlap it, offsets moved into the part."""
        out = []
        for s, e in self.spans:
            local = [replace(f, byte_start=max(f.byte_start, s) - s, byte_end=min(f.byte_end, e) - s)
                     for f in findings if f.byte_start < e and f.byte_end > s]
            out.append(redact(self.data[s:e], local, kinds))
        return out


def _redacted_result(result: types.CallToolResult, texts: list[str]) -> types.CallToolResult:
    it = iter(texts)
    content: list[Any] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            content.append(block.model_copy(update={"text": next(it)}))
        elif (resource := _text_resource(block)) is not None:
            content.append(block.model_copy(update={"resource": resource.model_copy(update={"text": next(it)})}))
        else:
            content.append(block)
    structured = _rebuild(result.structured_content, it) if result.structured_content is not None else None
    content = [_with_fields(b, it) if block_fields(b) else b for b in content]
    return result.model_copy(update={"content": content, "structured_content": structured})


def _without_meta(result: types.CallToolResult) -> types.CallToolResult:
    """The result less every `_meta` the upstream set (on the result, a block, an embedded
    resource): free-form JSON the gate does not read, so it is never passed on (a red team's
    upstream sent a key pair and an injection there). The proxy's own `_meta` is added later."""
    def bare(block: Any) -> Any:
        resource = getattr(block, "resource", None)
        update: dict[str, Any] = {"meta": None}
        if resource is not None and getattr(resource, "meta", None) is not None:
            update["resource"] = resource.model_copy(update={"meta": None})
        return block.model_copy(update=update) if hasattr(block, "meta") else block
    return result.model_copy(update={"meta": None, "content": [bare(b) for b in result.content]})


def _non_text(result: types.CallToolResult, action: str) -> tuple[types.CallToolResult, list[str]]:
    """Pass or withhold each block the gate cannot read; returns what was there, by type."""
    kinds = [_describe(b) for b in result.content if _block_text(b) is None]
    if not kinds or action == "pass":
        return result, kinds
    content = [b if _block_text(b) is not None else types.TextContent(type="text", text=NON_TEXT_STUB.format(what=_describe(b)))
               for b in result.content]
    return result.model_copy(update={"content": content}), kinds


def _describe(block: Any) -> str:
    """A block the gate cannot read, named for a stub and the records: its type and MIME type when
    that is a bare `type/subtype` (an upstream's `image/png; note=...` or 50 KB of text is not
    repeated: a red team's reached the agent and the append-only log through this very stub)."""
    mime = getattr(block, "mime_type", None) or getattr(getattr(block, "resource", None), "mime_type", None)
    if not mime:
        return str(block.type)
    return f"{block.type} ({mime})" if _MIME.fullmatch(mime) else f"{block.type} (unlisted type)"


def stub_result(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


# ---- the guard -------------------------------------------------------------------------------------

class Guard:
    """Screens one call's arguments and one call's result; thread-safe and synchronous. The proxy runs
    it on its event loop for small documents and on a worker thread for large ones (proxy.py); only
    `settle` and `screen_definition` block, on a durable commit, and never run on the loop. Its
    records are committed by its recorder: a thread of its own, or, given a `WriterLink`, the
    proxy's event loop while the proxy is `running` (recorder.py)."""

    def __init__(self, gate: Gate, policy: PolicyEngine, ledger: Ledger, audit: AuditLog,
                 max_result_bytes: int, writer: WriterLink | None = None) -> None:
        self.gate, self.policy = gate, policy
        self.recorder: Recorder | LoopRecorder = \
            Recorder(ledger, audit) if writer is None else LoopRecorder(ledger, audit, writer)
        self.max_result_bytes = max_result_bytes
        self._definitions: dict[tuple[str, str, str], Decision] = {}
        self._definitions_lock = threading.Lock()  # one screening (and record) of a definition at a time
        self._digests: dict[int, tuple[BaseModel, str]] = {}
        self.history = History()

    def _scan(self, doc: Document, call: Call, phase: str, order: int | None = None) -> GateReport:
        """The document's report, with the secrets that only its parts glued together show, and (a
        result, arguments) what it shows only joined to the text its stream was shown before."""
        started = time.perf_counter()
        try:
            report = self.gate.scan(doc.data, tool=call.tool)
            if len(doc.spans) > 1 or len(doc.raw_strings()) > 1:  # else nothing to glue: one part, one string
                report = with_findings(report, doc.glued_secrets(self.gate) + doc.injection_across_values(self.gate))
            if phase in _JOINED and self.history.joins(call.stream, phase):
                found = [f for reading in doc.readings(phase)
                         for f in self.history.findings(self.gate, call.stream, phase, reading, report)]
                if phase == "arguments":
                    found += self.history.secrets_across(self.gate, call.stream, phase, doc.alone(), len(doc.data))
                report = with_findings(report, found)
            if order is not None:  # a later call's result shown first (`History.overtaken`)
                report = with_findings(report, self.history.overtaken(self.gate, call.stream, order,
                                                                      doc.shown_text(), len(doc.data)))
            return report
        except Exception as exc:
            raise ScreeningError(f"the gate failed ({type(exc).__name__}); nothing was passed on") from exc
        finally:
            call.spent["gate"] = call.spent.get("gate", 0.0) + time.perf_counter() - started

    def _input(self, call: Call, phase: str, report: GateReport, n_bytes: int) -> dict[str, Any]:
        # No tokenizer at this boundary: 4 bytes a token is the estimate the span limits see.
        return {"tenant": call.tenant, "user": call.principal.user, "channel": "mcp", "upstream": call.upstream,
                "phase": phase, "tool": tool_identity(call.tool, source="mcp", claimed_name=call.tool, verified=True),
                "session": {"id": call.session_id or "none", "age_s": 0, "tokens": 0},
                "span": {"bytes": n_bytes, "tokens": -(-n_bytes // 4)}, "gate": gate_input(report)}

    def _decide(self, call: Call, phase: str, doc: Document,
                order: int | None = None) -> tuple[GateReport, Screened, list[str] | None]:
        """Scan, decide, and for a result carry out a redact; returns the redacted parts' texts too.
        `order`: a result's call's place among the stream's calls (its record's audit index)."""
        report = self._scan(doc, call, phase, order)
        decision = self.policy.decide(self._input(call, phase, report, doc.shown_bytes))
        if phase != "result" or decision.action != "redact":
            return report, Screened(decision), None
        texts: list[str] = []

        def cut(_data: bytes, found: GateReport, kinds: tuple[str, ...]) -> Redaction:
            parts = doc.split(found.findings, kinds)  # _data is doc.data; cut part by part
            texts[:] = [r.data.decode("utf-8", "surrogatepass") for r in parts]
            cuts = tuple(c for r, (s, _) in zip(parts, doc.spans) for c in _moved(r, s))
            return Redaction(Document.of(texts).data, cuts, doc.sha256)

        def shown(n_bytes: int) -> int:  # the redacted document's size, counted as its original's was
            return replace(Document.of(texts), blocks=doc.blocks).shown_bytes if texts else n_bytes

        screened = apply_redact(self.gate, self.policy, doc.data, report, decision,
                                lambda rescan, n: self._input(call, "result", rescan, shown(n)), cut)
        return report, screened, texts if screened.decision.action == "redact" else None

    # -- definitions: what the list methods show ----------------------------------------------------

    def known_definition(self, call: Call, item: BaseModel) -> Decision | None:
        """The decision `screen_definition` already took on this definition for this tenant, if any:
        a dictionary look-up, cheap enough for the event loop (no thread hop per call)."""
        return self._definitions.get((call.tenant, call.tool, self._definition_sha(item)))

    def _definition_sha(self, item: BaseModel) -> str:
        """The digest of a definition, remembered per object (the upstream link keeps one Tool per
        listing; `is` guards against a reused id)."""
        seen = self._digests.get(id(item))
        if seen is None or seen[0] is not item:
            if len(self._digests) >= 4096:
                self._digests.clear()
            seen = self._digests[id(item)] = (item, _definition(item).sha256)
        return seen[1]

    def _prose_refused(self, call: Call, doc: Document) -> bool:
        """Whether the policy refuses a definition's descriptions and titles read as one text, in
        either order (red team 14: an instruction's halves in a description and a title, or in a
        description and a parameter's, however far apart in the schema)."""
        prose = doc.prose()
        return len(prose) > 1 and any(
            self._decide(call, "definition", Document.of([b" ".join(order).decode("utf-8", "replace")]))[1].decision.action
            != "allow" for order in (prose, prose[::-1]))

    def screen_definition(self, call: Call, item: BaseModel) -> Decision:
        """Whether the agent may see this tool, resource, resource template or prompt: its definition
        (description, titles, URI, schema and argument text) reaches the agent's model too, so a
        poisoned description is an injection like any other. Screened once per tenant and distinct
        definition; anything but allow hides it (and makes a tool uncallable). Blocks on the
        commit of a withheld definition's record: run it off the event loop."""
        doc = _definition(item)
        key = (call.tenant, call.tool, doc.sha256)
        decision = self._definitions.get(key)
        if decision is not None:
            return decision
        with self._definitions_lock:  # concurrent first listings: the first screens and records, the rest read
            decision = self._definitions.get(key)
            if decision is not None:
                return decision
            report, screened, _ = self._decide(call, "definition", doc)
            decision = screened.decision
            if decision.action == "allow" and any(credential_like(v) for v in _identifiers(item)):
                decision = Decision("quarantine", ("credential_like_name: a name or URI of this definition holds a "
                                                   "run of letters and digits like a key; it is not listed",),
                                    self.policy.bundle_hash)
            elif decision.action == "allow" and doc.split_over_values(self.gate):
                decision = Decision("quarantine", ("split_secret: a secret is split over this definition's fields; "
                                                   "it is not listed",), self.policy.bundle_hash)
            elif decision.action == "allow" and self._prose_refused(call, doc):
                decision = Decision("quarantine", ("split_injection: this definition's descriptions and titles read "
                                                   "together are refused; it is not listed",), self.policy.bundle_hash)
            if decision.action != "allow":
                named = _recorded_name(self.gate, call, item)
                body = {**self._body("mcp-result", named, doc, report, decision, None), "phase": "definition"}
                self.settle(self._record(named, "definition", doc.sha256, decision, body, [], stub_result("")))
            if len(self._definitions) >= 4096:
                self._definitions.clear()
            self._definitions[key] = decision
            return decision

    # -- arguments ---------------------------------------------------------------------------------

    def screen_arguments(self, call: Call, doc: Document) -> tuple[Pending | None, dict[str, Any]]:
        """The refusal (None when the call may go ahead) and the call's `mcp-call` record, for the
        arguments' `Document.of_arguments`. A refused call's record is queued here with its
        crossing; an allowed call's names the crossing its result will have, and must be durable
        (`record_call`) before the upstream is called."""
        report, screened, _ = self._decide(call, "arguments", doc)
        decision = screened.decision
        body = self._body("mcp-call", call, doc, report, decision, None)
        if decision.action == "allow":
            self.history.shown(call.stream, "arguments", doc.shown_text())
            return None, {**body, "crossing": CrossingLog.new_id()}

        def refusal(crossing: str) -> types.CallToolResult:
            kind = _kind(call)
            return stub_result(f"[{kind.call} refused by policy: {reason_label(decision)}] {call.tool} "
                               f"{kind.not_done}. Reasons: {'; '.join(decision.reasons)} (lethe crossing {crossing})")
        return self._record(call, "arguments", doc.sha256, decision, body, [], refusal), body

    def record_call(self, call_record: dict[str, Any]) -> Future[int]:
        """Queue an allowed call's record on its own (no crossing yet); its future is its audit
        index once durable. Nothing may be sent upstream before then (a red team's cancelled call
        had run at the upstream with no record of it)."""
        return self.recorder.submit(None, [], [call_record])

    def write_call(self, call: Call, call_record: dict[str, Any]) -> Called:
        """`record_call`, then wait for its commit: for callers with a thread to spare."""
        try:
            return Called(call_record, self.record_call(call_record).result())
        except Exception as exc:
            raise call_unrecorded(call, exc) from exc

    def unanswered(self, call: Call, called: Called, rule: str, detail: str) -> Pending:
        """An allowed call that got no screened result (`rule`: the upstream failed, the caller went
        away, the screening failed): its crossing says so, so the call's record is never left
        without an outcome where the proxy could still write one."""
        decision = Decision("quarantine", (f"{rule}: {detail}",), self.policy.bundle_hash)
        body = self._body("mcp-result", call, Document.of([]), None, decision, None)
        return self._record(call, "result", body["content_sha256"], decision, body, [], stub_result(""), called)

    # -- results -----------------------------------------------------------------------------------

    def screen_result(self, call: Call, result: types.CallToolResult, called: Called | None = None) -> Outcome:
        """`decide_result`, then wait for its commit: for callers with a thread to spare."""
        return self.settle(self.decide_result(call, result, Document.of_result(result), called))

    def decide_result(self, call: Call, result: types.CallToolResult, doc: Document,
                      called: Called | None = None) -> Pending:
        """What the agent will be shown (`doc` is the result's `Document.of_result`), once the
        decision's records (queued here) are durable. The call's record's audit index orders it
        among the stream's calls (`History.overtaken`)."""
        result = _without_meta(result)
        order = None if called is None else called.audit_index
        oversized = self._oversized(result, doc)
        if oversized is not None:
            decision = Decision("quarantine", (oversized,), self.policy.bundle_hash)
            report, screened, texts = None, Screened(decision), None
        else:
            report, screened, texts = self._decide(call, "result", doc, order)
        decision = screened.decision
        if decision.action != "quarantine":  # a quarantined result was not shown: the tail stays as it was
            shown_doc = doc if texts is None else replace(Document.of(texts), blocks=doc.blocks)
            self.history.shown(call.stream, "result", shown_doc.shown_text(), order)
        shown, non_text = _non_text(_redacted_result(result, texts) if texts is not None else result,
                                    decision.non_text)
        many = len(result.content) > MAX_BLOCKS
        parts = [] if many else doc.part_digests()  # too many to list: the whole's digest only
        withhold = doc.withheld_digests(whole=not many) if decision.action == "quarantine" else []
        body = self._body("mcp-result", call, doc, report, decision, screened.redaction)
        body.update(non_text={"blocks": non_text, "action": decision.non_text}, parts_sha256=parts)
        if decision.action == "quarantine":
            def shown_for(crossing: str) -> types.CallToolResult:
                return stub_result(f"[{_kind(call).result} withheld by policy: {reason_label(decision)}] Reasons: "
                                   f"{'; '.join(decision.reasons)} (lethe crossing {crossing})")
            return self._record(call, "result", doc.sha256, decision, body, withhold, shown_for, called)
        return self._record(call, "result", doc.sha256, decision, body, withhold, shown, called)

    def _oversized(self, result: types.CallToolResult, doc: Document) -> str | None:
        """Why a result is too large to screen and record, or None. Past `MAX_BLOCKS` content blocks
        its records (a digest a block, so the chat endpoint can refuse each one later) would
        outgrow it: a red team's 165 KB of tiny blocks wrote 2 MB."""
        if doc.shown_bytes > self.max_result_bytes:
            return (f"result_size: {doc.shown_bytes} bytes of text > {self.max_result_bytes} "
                    "(LETHE_MCP_MAX_RESULT_BYTES)")
        if len(result.content) > MAX_BLOCKS:
            return f"result_size: {len(result.content)} content blocks > {MAX_BLOCKS}"
        return None

    @staticmethod
    def settle(pending: Pending) -> Outcome:
        """Block until the pending decision's records are durable; its Outcome, or a ScreeningError."""
        try:
            return pending.outcome(pending.committed.result())
        except Exception as exc:
            raise pending.failed(exc) from exc

    # -- records -----------------------------------------------------------------------------------

    def _body(self, kind: str, call: Call, doc: Document, report: GateReport | None, decision: Decision,
              redaction: Redaction | None) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": kind, "tenant": call.tenant, "actor": actor_of(call.principal),
                                "upstream": call.upstream, "tool": call.tool, "content_sha256": doc.sha256,
                                "decision": decision.to_dict()}
        if call.session_id:
            body["session"] = call.session_id
        if doc.arguments_sha256 is not None:
            body["arguments_sha256"] = doc.arguments_sha256
        if report is not None:
            body["gate"] = report.summary()
        if redaction is not None and decision.action == "redact":
            body["redaction"] = redaction.to_dict()
        return body

    def _record(self, call: Call, phase: str, sha256: str, decision: Decision, body: dict[str, Any],
                withhold: list[str], shown: types.CallToolResult | Callable[[str], types.CallToolResult],
                called: Called | None = None) -> Pending:
        """Queue the ledger crossing and its audit record for the next group commit. The Pending it
        returns must be settled before anything is acted on: a decision whose record cannot be
        written is not acted on (the caller gets a ScreeningError). `shown` may need the crossing's id."""
        meta = {k: v for k, v in body.items()
                if k in ("actor", "gate", "decision", "redaction", "non_text", "parts_sha256", "arguments_sha256")}
        if called is not None:
            meta["call"] = called.summary()
        crossing = CrossingLog.new(tenant=call.tenant, session_id=call.session_id, channel="mcp",
                                   upstream=call.upstream, tool=call.tool, phase=phase, content_sha256=sha256,
                                   action=decision.action, meta=meta,
                                   id=called.crossing_id if called is not None else None)
        about = {"tenant": call.tenant, "tool": call.tool, "phase": phase, "action": decision.action}
        result = shown(crossing.id) if callable(shown) else shown
        not_done = "nothing was passed on" if called is None else \
            f"the upstream was called (audit record {called.audit_index}) but nothing of its result was passed on"
        queued_at = time.perf_counter()  # a commit on the loop (recorder.InlineFirst) is done when submit returns
        committed = self.recorder.submit(crossing, withhold, [{**body, "crossing": crossing.id}])
        return Pending(result, decision, crossing.id, about, committed, queued_at, not_done)


def _definition(item: BaseModel) -> Document:
    """What of a listed definition reaches the agent's model: every string of it, its name too
    (the proxy lists it as `<upstream>__<name>`: a red team's tool was named after a live token),
    and the name once more as words, so `Ignore_all_previous_instructions` reads as what it spells."""
    dumped = item.model_dump(mode="json", exclude_none=True)
    name = dumped.get("name")
    words = [_WORDS.sub(" ", name)] if isinstance(name, str) else []
    return Document.of_json(dumped, after=words)  # its strings glued too: a key split over two fields


def _identifiers(item: BaseModel) -> list[str]:
    """The fields of a definition an agent routes by, which no policy text reads as prose."""
    return [str(v) for v in (getattr(item, f, None) for f in ("name", "uri", "uri_template")) if v]


def credential_like(text: str) -> bool:
    """Whether `text` holds a run of 20 or more letters and digits, mixing both, at over 4 bits a
    character: a key, not a word. A red team named tools `t_<token>`, `get<token>`: glued to a
    prefix, a token starts no word, so no secret rule (they want one) sees it."""
    return any(_DIGIT.search(run) and _LETTER.search(run) and shannon_entropy(run) > 4.0 for run in _RUN.findall(text))


def _json_strings(text: bytes) -> list[bytes] | None:
    """The value strings of `text` where it is a JSON object or array, else None."""
    if text.lstrip()[:1] not in (b"{", b"["):
        return None
    try:
        return [raw.encode("utf-8", "surrogatepass") for raw in _value_strings(json.loads(text))]
    except (ValueError, RecursionError):  # not JSON, or nested too deep to walk: read as it is
        return None


def _value_strings(value: Any) -> Iterator[str]:
    """The strings of a JSON value that are not keys, in order."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (dict, list)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _value_strings(v)


def _distinct(stream: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The strings, less each that repeats the one before it (structured content's copy of its
    text block); a short string is a repeat only when equal (a key inside a long text is not)."""
    out: list[tuple[int, bytes]] = []
    for k, raw in stream:
        if not (out and (raw == out[-1][1] or min(len(raw), len(out[-1][1])) >= _PROBE and _repeats(out[-1][1], raw))):
            out.append((k, raw))
    return out


def _held_whole(gate: Gate, left: bytes, right: bytes) -> bool:
    """Whether a secret read across the seam `left|right` is one a side holds whole, reaching the
    seam (red team 15: `"sk_live_..."` glued to its own key `result` read as one longer token, and
    the key was cut): then the direct scan already cuts it, and the neighbour is no part of it.
    (Half of a split key that is a key by itself is cut so too; the rest of it is not.)"""
    return any(f.byte_end == len(left) for f in gate.scan_secrets(left)) \
        or any(f.byte_start == 0 for f in gate.scan_secrets(right))


def _repeats(a: bytes, b: bytes) -> bool:
    """Whether one string repeats the other (the head of either inside the other): glued, the end
    of a text block and the start of its own copy in structured content read as a key that is
    nowhere (`...AKIAPTGZ6J` + `FEBZSDOXRL...`)."""
    return a[:_PROBE] in b or b[:_PROBE] in a


def _recorded_name(gate: Gate, call: Call, item: BaseModel) -> Call:
    """The call as a withheld definition's record names it: the name digested where it holds a
    secret or a credential-like run, so the append-only log never keeps one."""
    name = str(getattr(item, "name", "") or "")
    if not (gate.scan_secrets(name) or credential_like(name)):
        return call
    return replace(call, tool=f"{call.upstream}{SEPARATOR}[REDACTED:sha256:{hashlib.sha256(name.encode()).hexdigest()[:16]}]")


def _moved(redaction: Redaction, offset: int) -> Iterator[Cut]:
    for c in redaction.cuts:
        yield replace(c, byte_start=c.byte_start + offset, byte_end=c.byte_end + offset)


@dataclass(frozen=True)
class _Kind:
    """How a stub names what it stands for: a tool's, a resource's or a prompt's."""

    result: str
    call: str
    not_done: str


_KINDS = {"tool": _Kind("tool result", "tool call", "was not called"),
          "resource": _Kind("resource", "resource read", "was not read"),
          "prompt": _Kind("prompt", "prompt request", "was not requested")}

# A stub's label is the rule that decided (the first reason's name), in words an agent can act on.
_LABELS = {"injection_threshold": "prompt-injection", "secret_threshold": "secret", "sensitive_finding": "secret",
           "blocked_tool": "blocked-tool", "quarantined_content": "quarantined-before",
           "withheld_at_boundary": "quarantined-before", "span_limit": "too-long", "session_budget": "session-budget",
           "result_size": "result-size", "input_invalid": "invalid-policy-input", "split_secret": "secret",
           "credential_like_name": "secret"}


def _kind(call: Call) -> _Kind:
    route = call.tool.split(SEPARATOR, 1)[-1]
    return _KINDS["resource" if route == RESOURCE_READ else "prompt" if route.startswith(PROMPT_GET) else "tool"]


def reason_label(decision: Decision) -> str:
    """The rule that decided, as a short label (`prompt-injection`, `blocked-tool`): a stub's first words."""
    rule = decision.reasons[0].split(":", 1)[0] if decision.reasons else ""
    return _LABELS.get(rule, rule.replace("_", "-") or "policy")


def actor_of(principal: Principal) -> str:
    """Who acted, as records name it: `tenant:user`, or `tenant:key` for a key without a user."""
    return f"{principal.tenant or ''}:{principal.user or 'key'}"
