"""Hypothesis stateful test: random append/forget/amortize/truncate sequences against a list model.

The model is the obvious one: an ordered list of (state, length, content, replacement); a segment's
range is the running sum of the lengths of the segments before it that are still in the cache.
After every step the ledger must agree on ranges, states, token_count and which contents are still
stored (stored iff some non-forgotten segment references it), and its invariants must hold.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from ledger import Ledger, LedgerError, SegmentState, UnknownSegment
from ledger.content import sha256_hex

L, Q, F, A, S = (SegmentState.LIVE, SegmentState.QUARANTINED, SegmentState.FORGOTTEN,
                 SegmentState.AMORTIZED, SegmentState.SUPERSEDED)
IN_CACHE = {L, Q, A}


@dataclass
class ModelSeg:
    id: str
    state: SegmentState
    length: int
    content: bytes
    replacement: bytes | None = None


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self.sid = f"s_{secrets.token_hex(8)}"  # contents carry it, so examples never share blobs
        ledger.create_session(self.sid, "t")
        self.model: list[ModelSeg] = []
        self.pool: set[bytes] = set()

    # -- model helpers ----------------------------------------------------------------------------

    def blob(self, k: int) -> bytes:
        data = f"{self.sid}:{k}".encode()  # a small pool: contents repeat and are shared
        self.pool.add(data)
        return data

    def ranges(self) -> list[tuple[SegmentState, int, int]]:
        out, cursor = [], 0
        for seg in self.model:
            end = cursor + (seg.length if seg.state in IN_CACHE else 0)
            out.append((seg.state, cursor, end))
            cursor = end
        return out

    def total(self) -> int:
        return sum(s.length for s in self.model if s.state in IN_CACHE)

    def boundaries(self) -> list[int]:
        return sorted({0} | {e for _, _, e in self.ranges()})

    # -- operations -------------------------------------------------------------------------------

    @rule(n=st.integers(0, 6), k=st.integers(0, 4), quarantined=st.booleans())
    def append(self, n: int, k: int, quarantined: bool) -> None:
        state = Q if quarantined else L
        seg = self.ledger.append(self.sid, role="tool" if quarantined else "user", tool=None,
                                 content=self.blob(k), n_tokens=n, state=state)
        assert (seg.start, seg.end, seg.seq) == (self.total(), self.total() + n, len(self.model))
        self.model.append(ModelSeg(seg.id, state, n, self.blob(k)))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        picks = data.draw(st.lists(st.sampled_from(self.model), min_size=1, max_size=4))
        out = self.ledger.forget(self.sid, [m.id for m in picks])
        # Superseded copies of forgotten content go too: otherwise they would keep its blob.
        contents = {m.content for m in picks}
        picks += [m for m in self.model if m.state is S and m.content in contents and m not in picks]
        for m in picks:
            m.state = F
        assert sorted({m.id for m in picks}) == sorted(s.id for s in out)
        assert all(s.state is F and s.start == s.end for s in out)

    @precondition(lambda self: any(m.state in (L, A) for m in self.model))
    @rule(data=st.data(), r=st.integers(0, 8), k=st.integers(0, 4))
    def amortize(self, data: st.DataObject, r: int, k: int) -> None:
        m = data.draw(st.sampled_from([m for m in self.model if m.state in (L, A)]))
        out = self.ledger.amortize(self.sid, m.id, r, self.blob(k))
        m.state, m.length, m.replacement = A, r, self.blob(k)
        assert out.n_tokens == r and out.content_sha256 == sha256_hex(m.content)

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        n = data.draw(st.sampled_from(self.boundaries()))
        out = self.ledger.truncate(self.sid, n)
        expected = [m.id for m, (state, start, _) in zip(self.model, self.ranges()) if state in IN_CACHE and start >= n]
        for m in self.model:
            if m.id in expected:
                m.state = S
        assert [s.id for s in out] == expected

    # -- refused operations leave everything as it was (checked by the invariants) ---------------

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def forget_with_unknown_id(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from(self.model))
        try:
            self.ledger.forget(self.sid, [m.id, "seg_" + "0" * 24])
        except UnknownSegment:
            return
        raise AssertionError("forget of an unknown segment must fail")

    @precondition(lambda self: any(m.state in (F, S, Q) for m in self.model))
    @rule(data=st.data())
    def amortize_refused(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from([m for m in self.model if m.state in (F, S, Q)]))
        try:
            self.ledger.amortize(self.sid, m.id, 1, b"never-stored")
        except LedgerError:
            return
        raise AssertionError(f"amortize of a {m.state.value} segment must fail")

    @precondition(lambda self: any(e - s > 1 for st_, s, e in self.ranges() if st_ in IN_CACHE))
    @rule(data=st.data())
    def truncate_inside_segment(self, data: st.DataObject) -> None:
        s, e = data.draw(st.sampled_from([(s, e) for st_, s, e in self.ranges() if st_ in IN_CACHE and e - s > 1]))
        try:
            self.ledger.truncate(self.sid, data.draw(st.integers(s + 1, e - 1)))
        except LedgerError:
            return
        raise AssertionError("truncate inside a segment must fail")

    # -- agreement --------------------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        segs = self.ledger.segments(self.sid)
        assert [s.id for s in segs] == [m.id for m in self.model]
        assert [(s.state, s.start, s.end) for s in segs] == self.ranges()
        assert self.ledger.token_count(self.sid) == self.total()
        self.ledger.check_invariants(self.sid, cache_len=self.total())

    @invariant()
    def stored_iff_referenced(self) -> None:
        referenced = {d for m in self.model if m.state is not F for d in (m.content, m.replacement) if d}
        for data in self.pool:
            assert self.ledger.content.exists(sha256_hex(data)) == (data in referenced), data
        assert not self.ledger.content.exists(sha256_hex(b"never-stored"))


def _run(ledger: Ledger, examples: int) -> None:
    run_state_machine_as_test(
        lambda: LedgerMachine(ledger),
        settings=settings(max_examples=examples, stateful_step_count=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


def test_ledger_agrees_with_model_sqlite() -> None:
    ledger = Ledger("sqlite://")
    _run(ledger, examples=40)
    ledger.close()


@pytest.mark.postgres
def test_ledger_agrees_with_model_postgres(pg_url: str) -> None:
    ledger = Ledger(pg_url)
    _run(ledger, examples=12)
    ledger.close()
