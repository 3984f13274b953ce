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


def test_a_turns_intents_are_written_with_its_rows_and_undone_with_them(ledger: Ledger) -> None:
    """What a turn owes is stored in the turn's own transaction, so a crash cannot separate them."""
    ledger.create_session("s", "t")
    owed = lambda appended: [("forget", {"segments": [appended[1].id]}), ("audit", {"records": []})]  # noqa: E731
    turn = ledger.write_turn("s", keep=0, new=[_msg("a", 3), _msg("secret", 2)], intents_of=owed)
    pending = ledger.pending_intents(session_id="s")
    assert sorted((i.kind, i.payload) for i in pending) == [("audit", {"records": []}),
                                                           ("forget", {"segments": [turn.appended[1].id]})]
    assert [i.id for i in ledger.pending_intents("audit")] == [turn.intents[1].id]
    ledger.intent_done(turn.intents[1].id)
    ledger.intent_done(turn.intents[1].id)  # idempotent
    assert [i.kind for i in ledger.pending_intents()] == ["forget"]
    ledger.undo_turn(turn)
    assert ledger.pending_intents() == [] and ledger.segments("s") == []


def test_a_refused_turn_stores_no_intent(ledger: Ledger) -> None:
    ledger.create_session("s", "t")
    bad = NewSegment(role="user", tool=None, content=b"x", n_tokens=-1)
    try:
        ledger.write_turn("s", keep=0, new=[_msg("a", 1), bad], intents_of=lambda _: [("forget", {"segments": []})])
    except Exception:
        pass
    else:
        raise AssertionError("a negative token count must be refused")
    assert ledger.pending_intents() == [] and ledger.segments("s") == []
