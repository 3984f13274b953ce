"""The gate's time bound: work grows linearly with the input on every crafted worst case.

Wall-clock budgets are for the benchmark (`python -m gate.bench bound`, JSON); these tests assert
shapes that hold on any machine: bounded callback counts, bounded windows, and a 256 KB / 32 KB
CPU-time ratio near 8 (a quadratic confirmation gives ~64; the bound allows 2.5x noise over 8).
"""

from __future__ import annotations

import pytest

from gate import Gate
from gate._text import decode
from gate.bench import scan_seconds
from gate.engine import Pattern, SpanMatcher
from gate.heuristics import _attribute_values, _comments, _css_hidden, HIDDEN_SCORED
from gate.worst import TOOL_RESULT_LIMIT, WORST_CASES, every_rule_tail, with_tail

SMALL = 32 << 10
LINEAR_RATIO_BOUND = 8 * 2.5


@pytest.fixture(scope="module")
def gate() -> Gate:
    return Gate()


@pytest.fixture(scope="module")
def tail() -> bytes:
    return every_rule_tail()


@pytest.mark.parametrize("family", WORST_CASES)
def test_scan_time_grows_linearly_to_the_tool_result_limit(gate: Gate, tail: bytes, family: str) -> None:
    build = with_tail(WORST_CASES[family], tail)
    small, large = build(SMALL), build(TOOL_RESULT_LIMIT)
    assert len(large) == TOOL_RESULT_LIMIT
    t_small = scan_seconds(gate, small, repeats=5)
    t_large = scan_seconds(gate, large, repeats=3)
    assert t_large <= LINEAR_RATIO_BOUND * max(t_small, 2e-3), (family, t_small, t_large)


def test_every_rule_tail_fires_every_pattern_rule(gate: Gate, tail: bytes) -> None:
    """The tail is what makes the families worst cases: without it no confirmation would run."""
    fired = {f.rule_id for f in gate.scan(tail).findings}
    pattern_rules = {r.id for r in gate.heuristics.rules if r.regex} | {r.id for r in gate.secret_rules if r.examples}
    assert pattern_rules - fired == set()


def test_span_matcher_reports_at_most_its_limit() -> None:
    matcher = SpanMatcher([Pattern(0, r"ignore\s+previous", caseless=True)], limit=64)
    data = b"ignore previous " * 20_000
    assert len(matcher.reports(0, data)) == 64
    starts = [s for s, _ in matcher.spans(0, data)]
    assert starts == [16 * i for i in range(64)]


def test_hidden_html_regions_are_disjoint_and_read_once() -> None:
    """Each detector walks forward: its regions never overlap, so the text each reads sums to <= n."""
    text = decode(WORST_CASES["html-comments-closed"](TOOL_RESULT_LIMIT) + WORST_CASES["html-css-hidden"](8192)
                  + WORST_CASES["html-attr-openers"](8192) + b' alt="' + b"x" * 50 + b'"').text
    for regions in (list(_comments(text)), list(_css_hidden(text)), list(_attribute_values(text))):
        assert regions
        assert all(a[1] <= b[0] for a, b in zip(regions, regions[1:]))
        assert sum(e - s for s, e in regions) <= len(text)


def test_many_hidden_regions_cost_a_bounded_number_of_scorings(gate: Gate, monkeypatch) -> None:
    calls = []
    real = gate.heuristics.content_score
    monkeypatch.setattr(gate.heuristics, "content_score", lambda t: calls.append(len(t)) or real(t))
    report = gate.scan(WORST_CASES["html-comments-closed"](TOOL_RESULT_LIMIT))
    assert len(calls) == HIDDEN_SCORED + 1
    assert any(f.rule_id == "hidden-html" for f in report.findings)
