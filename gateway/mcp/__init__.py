"""`lethe mcp`: an MCP proxy that screens every tool call's arguments and every tool result.

settings.py (which upstreams, limits), upstream.py (the SDK client connections), guard.py (the
gated path: gate → policy → redact → ledger → audit), proxy.py (the MCP handlers and routing),
transport.py (stdio with one tenant, streamable HTTP with API keys). See README "MCP proxy".
"""
from .guard import Guard
from .proxy import Caller, Proxy
from .settings import McpSettings, UpstreamSpec, parse_flag
from .transport import http_app, serve_stdio

__all__ = ["Caller", "Guard", "McpSettings", "Proxy", "UpstreamSpec", "http_app", "parse_flag", "serve_stdio"]
