"""The answers the policies give, as frozen values that carry the bundle hash that decided them."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

ACTIONS = frozenset({"allow", "quarantine", "redact", "forget", "amortize"})
NON_TEXT = frozenset({"pass", "withhold"})
SCOPES = frozenset({"tenant", "tenant_user", "public"})


TOOL_SOURCES = frozenset({"gateway", "mcp", "client"})


def tool_identity(name: str, *, source: str, claimed_name: str | None = None, verified: bool = False,
                  folded: tuple[str, ...] = ()) -> dict[str, Any]:
    """The decision policy's `input.tool`: who produced a tool result, and whether the client's word
    is all there is. `name` is the trust-relevant name (the gateway's record, or the MCP route);
    `claimed_name` what the client said; `verified` only when a server-side record backs `name` and
    the claim agrees with it. Trusted tools apply to verified identities only (decision.rego).
    `folded` holds the names' Unicode folds where they differ, which blocking also matches."""
    if source not in TOOL_SOURCES:
        raise ValueError(f"tool source {source!r} is not one of {sorted(TOOL_SOURCES)}")
    identity: dict[str, Any] = {"name": name, "claimed_name": claimed_name, "verified": verified, "source": source}
    if folded:
        identity["folded"] = list(folded)
    return identity


class PolicyError(Exception):
    """A policy could not give a well-formed answer (bad bundle, engine error, OPA down, malformed result)."""


@dataclass(frozen=True)
class Decision:
    """What happens to one tool result: allow, quarantine, redact, forget or amortize, and why.

    `redact_kinds` (redact only) names the finding kinds to cut out; `non_text` (MCP only) says
    whether content the gate cannot read (images, audio, blobs) passes or is withheld.
    """

    action: str
    reasons: tuple[str, ...]
    bundle_hash: str
    redact_kinds: tuple[str, ...] = ()
    non_text: str = "withhold"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"action": self.action, "reasons": list(self.reasons), "bundle_hash": self.bundle_hash}
        if self.action == "redact":
            out["redact_kinds"] = list(self.redact_kinds)
        return out


@dataclass(frozen=True)
class Tenancy:
    """The cache-salt scope of a request; `derive_salt` turns it into a salt with the server's secret."""

    scope: str
    scope_key: str
    epoch: int
    bundle_hash: str


@dataclass(frozen=True)
class Retention:
    """How long a stored segment may live; `ttl_seconds` None means keep until erased explicitly."""

    data_class: str
    ttl_seconds: float | None
    bundle_hash: str


@dataclass(frozen=True)
class KvPriority:
    """How dearly each segment's KV is kept (0-100), for how long (None: for ever) before it
    reverts to `default`, and the lowest priority whose evicted session is offloaded, not dropped."""

    default: int
    offload_min: int
    segments: tuple[tuple[int, float | None], ...]
    bundle_hash: str


@dataclass(frozen=True)
class ErasureDecision:
    """Whether an actor may forget a session, with the rules that granted or denied it."""

    allowed: bool
    reasons: tuple[str, ...]
    bundle_hash: str


def derive_salt(server_secret: bytes, tenancy: Tenancy) -> str:
    """HMAC-SHA256(server_secret, "scope|scope_key|epoch") as hex.

    The secret stays in Python so that neither a client nor a policy author can compute
    another scope's salt. The message is unambiguous: scope never contains "|" and epoch is
    digits, so the first and last "|" delimit scope_key whatever it contains.
    """
    if not server_secret:
        raise ValueError("server secret for cache salts is empty; configure a random secret of at least 32 bytes")
    message = f"{tenancy.scope}|{tenancy.scope_key}|{tenancy.epoch}".encode()
    return hmac.new(server_secret, message, hashlib.sha256).hexdigest()
