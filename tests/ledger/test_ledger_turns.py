"""A chat turn's ledger writes are one transaction, undoable exactly, and a rewritten history
leaves no dead segment in the middle of the conversation."""
from __future__ import annotations

from ledger import Ledger, NewSegment, SegmentState


def _rows(ledger: Ledger, sid: str) -> list[tuple]:
    return [(s.id, s.seq, s.state.value, s.start, s.end) for s in ledger.segments(sid)]


def _msg(text: str, n: int, state: SegmentState = SegmentState.LIVE) -> NewSegment:
    return NewSegment(role="user", tool=None, content=text.encode(), n_tokens=n, state=state)


def test_write_turn_appends_all_rows_in_one_go_and_undo_restores_exactly(ledger: Ledger) -> None:
    ledger.create_session("s", "t")
    first = ledger.write_turn("s", keep=0, new=[_msg("a", 3), _msg("b", 4)])
    before, count = _rows(ledger, "s"), ledger.token_count("s")
    rewrite = ledger.write_turn("s", keep=1, new=[_msg("c", 5), _msg("secret", 2, SegmentState.QUARANTINED)])
    assert [s.state for s in ledger.segments("s")][:2] == [SegmentState.LIVE, SegmentState.SUPERSEDED]
    assert ledger.token_count("s") == 3 + 5 + 2
    ledger.undo_turn(rewrite)
    assert _rows(ledger, "s") == before and ledger.token_count("s") == count
    assert not ledger.content.exists(rewrite.appended[1].content_sha256)
    assert ledger.content.exists(first.appended[1].content_sha256)
    ledger.check_invariants("s")


def test_a_rewrite_retires_forgotten_segments_after_the_cut(ledger: Ledger) -> None:
    ledger.create_session("s", "t")
    written = ledger.write_turn("s", keep=0, new=[_msg("u", 3), _msg("tool", 4), _msg("u2", 2)])
    ledger.forget("s", [written.appended[1].id])
    ledger.write_turn("s", keep=1, new=[_msg("other", 6)])
    conversation = [s for s in ledger.segments("s") if s.state is not SegmentState.SUPERSEDED]
    assert [s.content_sha256 for s in conversation] == [written.appended[0].content_sha256,
                                                       ledger.segments("s")[-1].content_sha256]
    assert ledger.token_count("s") == 3 + 6
    ledger.check_invariants("s")
