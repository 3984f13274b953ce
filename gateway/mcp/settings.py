"""Which upstream MCP servers the proxy fronts, and its limits: from gateway/config.py and `--upstream`.

An upstream's name becomes the namespace of its tools (`<name>__<tool>`), so names are short,
lowercase and free of `_`: the first `__` of an exported tool name then always splits it back
into (upstream, tool) unambiguously, whatever the upstream calls its tools.
"""
from __future__ import annotations

import re
import shlex
from typing import Any
from urllib.parse import quote, unquote

from pydantic import BaseModel, Field, ValidationError, model_validator

from ..config import Settings

SEPARATOR = "__"
URI_SCHEME = "lethe-mcp://"
RESOURCE_READ = "resources/read"  # the `tool` a resource read is screened under: `<upstream>__resources/read`
PROMPT_GET = "prompts/get:"  # and a prompt: `<upstream>__prompts/get:<prompt>` (never a tool's name)


class UpstreamSpec(BaseModel):
    """One upstream: a stdio command (argv) or a streamable-HTTP URL."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,31}$")
    command: list[str] | None = None
    url: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_transport(self) -> "UpstreamSpec":
        if (self.command is None) == (self.url is None):
            raise ValueError(f"upstream {self.name!r}: give exactly one of `command` (stdio) or `url` (streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError(f"upstream {self.name!r}: `command` is an empty argv")
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


NAME_RULE = "1 to 32 characters of a-z, 0-9 and '-', starting with a letter or digit (no '_': '__' " \
            "separates the upstream from the tool in exported names)"


class UpstreamConfigError(ValueError):
    """An upstream given wrongly (an `--upstream` flag or lethe.toml): one line that names the fix."""


def _one_line(where: str, exc: ValidationError) -> UpstreamConfigError:
    """pydantic's report, one error per clause on one line, the name rule spelled out."""
    clauses = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        if field == "name" and err["type"] == "string_pattern_mismatch":
            clauses.append(f"upstream name {err['input']!r} must be {NAME_RULE}")
        else:
            clauses.append(f"{field + ': ' if field else ''}{err['msg'].removeprefix('Value error, ')}")
    return UpstreamConfigError(f"{where + ': ' if where else ''}{'; '.join(clauses)}")


def _spec(where: str, fields: Any) -> UpstreamSpec:
    try:
        return UpstreamSpec.model_validate(fields)
    except ValidationError as exc:
        raise _one_line(where, exc) from None


def parse_flag(flag: str) -> UpstreamSpec:
    """`NAME=COMMAND ARGS...` (stdio, split like a shell) or `NAME=http(s)://...` (streamable HTTP)."""
    where = f"--upstream {flag!r}"
    name, sep, target = flag.partition("=")
    if not sep or not target.strip():
        raise UpstreamConfigError(f"{where}: write NAME=COMMAND ARGS... or NAME=https://host/mcp")
    if target.startswith(("http://", "https://")):
        return _spec(where, {"name": name, "url": target})
    try:
        command = shlex.split(target)
    except ValueError as exc:
        raise UpstreamConfigError(f"{where}: cannot split the command ({exc}); quote it as a shell would") from None
    return _spec(where, {"name": name, "command": command})


class McpSettings(BaseModel):
    upstreams: list[UpstreamSpec]
    call_timeout_s: float = 30.0
    connect_timeout_s: float = 20.0
    max_result_bytes: int = 1_000_000
    session_idle_s: float = 1800.0
    max_body_bytes: int = 2_000_000  # an HTTP request's body (LETHE_MAX_BODY_BYTES, as the chat endpoint's)

    @model_validator(mode="after")
    def _unique(self) -> "McpSettings":
        names = [u.name for u in self.upstreams]
        if not names:
            raise ValueError("no upstream MCP server: add `--upstream NAME=COMMAND` or [[mcp_upstreams]] to lethe.toml")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"upstream names must be unique; {dupes} appear more than once")
        return self

    @classmethod
    def from_settings(cls, settings: Settings, flags: list[str] | None = None) -> "McpSettings":
        """Raises UpstreamConfigError (one line, naming the fix) for any upstream given wrongly."""
        specs = [_spec(f"lethe.toml [[mcp_upstreams]] #{i + 1}", u) for i, u in enumerate(settings.mcp_upstreams)]
        specs += [parse_flag(f) for f in flags or ()]
        try:
            return cls(upstreams=specs, call_timeout_s=settings.mcp_call_timeout_s,
                       connect_timeout_s=settings.mcp_connect_timeout_s,
                       max_result_bytes=settings.mcp_max_result_bytes,
                       session_idle_s=settings.mcp_session_idle_s, max_body_bytes=settings.max_body_bytes)
        except ValidationError as exc:
            raise _one_line("", exc) from None


def exported_name(upstream: str, tool: str) -> str:
    return f"{upstream}{SEPARATOR}{tool}"


def split_name(exported: str) -> tuple[str, str] | None:
    upstream, sep, tool = exported.partition(SEPARATOR)
    return (upstream, tool) if sep and upstream and tool else None


def exported_uri(upstream: str, uri: str) -> str:
    """An upstream's resource URI as the proxy serves it: `lethe-mcp://<upstream>/<uri, percent-encoded>`,
    so two upstreams' URIs cannot collide and a read is routed by the proxy, not by the URI's own scheme."""
    return f"{URI_SCHEME}{upstream}/{quote(uri, safe='')}"


def exported_template(upstream: str, template: str) -> str:
    """An upstream's URI template (RFC 6570) as the proxy serves it: `exported_uri`'s encoding of the
    literal text, the `{...}` expressions kept, so the client expands them and `split_uri` routes
    the result back to the upstream's own URI."""
    pieces = re.split(r"(\{[^{}]*\})", template)
    return f"{URI_SCHEME}{upstream}/" + "".join(p if p.startswith("{") else quote(p, safe="") for p in pieces)


def split_uri(exported: str) -> tuple[str, str] | None:
    if not exported.startswith(URI_SCHEME):
        return None
    upstream, sep, quoted = exported[len(URI_SCHEME):].partition("/")
    return (upstream, unquote(quoted)) if sep and upstream and quoted else None
