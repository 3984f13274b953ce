"""Immutable records handed out by the ledger. They are snapshots: mutate through `Ledger` only."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any


class SegmentState(str, Enum):
    """Where a segment's content stands with respect to the KV cache.

    LIVE: the content's tokens are in the cache over [start, end).
    QUARANTINED: the original content never entered the cache; [start, end) covers the stub text
        that took its place.
    FORGOTTEN: erased (exact forget); the range is empty [s, s) at the position it had. Kept for history.
    AMORTIZED: [start, end) covers replacement tokens. Later tokens still carry the original's
        influence, so this is NOT erasure.
    SUPERSEDED: the client rewrote history and the tail was dropped; empty range, kept for history.
    """

    LIVE = "live"
    QUARANTINED = "quarantined"
    FORGOTTEN = "forgotten"
    AMORTIZED = "amortized"
    SUPERSEDED = "superseded"

    @property
    def in_cache(self) -> bool:
        """True when the segment occupies tokens of the cache (its range may be non-empty)."""
        return self in IN_CACHE


IN_CACHE = frozenset({SegmentState.LIVE, SegmentState.QUARANTINED, SegmentState.AMORTIZED})
CONTENT_RETIRED = "content_retired"  # meta flag set by Ledger.retire_content


@dataclass(frozen=True)
class Segment:
    """One message or tool result of a session and the token range [start, end) it holds in the cache.

    `content_sha256` always names what the client sent (also after amortize), so a re-sent history
    still finds its segment by content. `replacement_sha256` names the amortize replacement, if any.
    """

    id: str
    session_id: str
    seq: int
    role: str
    tool: str | None
    content_sha256: str
    start: int
    end: int
    state: SegmentState
    created_at: datetime
    data_class: str = "normal"
    meta: dict[str, Any] = field(default_factory=dict)
    replacement_sha256: str | None = None

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    @property
    def content_retired(self) -> bool:
        """A quarantined segment whose withheld content retention has erased (its stub stays)."""
        return self.state is SegmentState.QUARANTINED and bool(self.meta.get(CONTENT_RETIRED))


@dataclass(frozen=True)
class SessionRecord:
    id: str
    tenant: str
    user: str | None
    created_at: datetime
    salt_scope: str | None
