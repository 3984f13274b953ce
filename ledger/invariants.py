"""The tiling invariant, as a pure function over a session's segments in seq order."""
from __future__ import annotations

from collections.abc import Sequence

from .errors import LedgerInvariantError
from .records import Segment


def verify_tiling(session_id: str, ordered: Sequence[Segment], token_count: int, cache_len: int | None = None) -> None:
    """Raise LedgerInvariantError unless the segments tile [0, token_count) in seq order.

    Each segment starts where the previous one ended (no gap, no overlap), dead segments
    (forgotten, superseded) are empty, and the cache, when its length is given, agrees.
    """
    cursor, last_seq = 0, -1
    for seg in ordered:
        where = f"session {session_id}: segment {seg.id} (seq {seg.seq}, {seg.state.value}, [{seg.start}, {seg.end}))"
        if seg.seq <= last_seq:
            raise LedgerInvariantError(f"{where} is out of seq order after seq {last_seq}")
        if seg.start != cursor:
            kind = "gap" if seg.start > cursor else "overlap"
            raise LedgerInvariantError(f"{where}: {kind}, expected to start at {cursor}")
        if seg.end < seg.start:
            raise LedgerInvariantError(f"{where}: negative length")
        if not seg.state.in_cache and seg.end != seg.start:
            raise LedgerInvariantError(f"{where}: a dead segment must have an empty range")
        cursor, last_seq = seg.end, seg.seq
    if cursor != token_count:
        raise LedgerInvariantError(f"session {session_id}: segments end at {cursor} but token_count is {token_count}")
    if cache_len is not None and cache_len != token_count:
        raise LedgerInvariantError(
            f"session {session_id}: ledger holds {token_count} tokens but the KV cache holds {cache_len}; "
            "the ledger and the kernel disagree"
        )
