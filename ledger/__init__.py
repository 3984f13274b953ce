"""Segment ledger: which message of a session occupies which token range of its KV cache.

Forget and amortize renumber every later segment; the segments always tile [0, token_count)
and token_count equals the kernel's cache length. Persisted through SQLAlchemy (SQLite or
PostgreSQL), content stored content-addressed so that a forget also erases stored content.
"""
from .content import ContentStore
from .crossings import Crossing, CrossingLog
from .errors import ErasureIncomplete, LedgerError, LedgerInvariantError, UnknownSegment, UnknownSession
from .ledger import Intent, Ledger, NewSegment, TurnWrite
from .records import CONTENT_RETIRED, Segment, SegmentState, SessionRecord
from .toolcalls import ToolCallLog

__all__ = [
    "CONTENT_RETIRED",
    "ContentStore",
    "Crossing",
    "CrossingLog",
    "ErasureIncomplete",
    "Intent",
    "Ledger",
    "LedgerError",
    "LedgerInvariantError",
    "NewSegment",
    "Segment",
    "SegmentState",
    "SessionRecord",
    "ToolCallLog",
    "TurnWrite",
    "UnknownSegment",
    "UnknownSession",
]
