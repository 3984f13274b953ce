"""The gate's time bound: work grows linearly with the input on every crafted worst case.

Wall-clock budgets are for the benchmark (`python -m gate.bench bound`, JSON); these tests assert
shapes that hold on any machine: bounded callback counts, bounded windows, and a 256 KB / 32 KB
CPU-time ratio near 8 (a quadratic confirmation gives ~64; the bound allows 2.5x noise over 8).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gate import Gate
from gate._text import decode
from gate.bench import scan_seconds
from gate.engine import Pattern, SpanMatcher
import gate.secrets as secrets_module
from gate.secrets import load_gitleaks
from gate.heuristics import _attribute_values, _comments, _css_hidden, HIDDEN_SCORED
from gate.unwrap import word_readings
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
    data = WORST_CASES["html-comments-closed"](TOOL_RESULT_LIMIT)
    report = gate.scan(data)
    # the text itself: at most HIDDEN_SCORED hidden regions and the whole; its reading without
    # markup is read by the phrase rules alone (`word_readings`): no scoring of its own
    assert word_readings(data) and len(calls) == HIDDEN_SCORED + 1
    assert any(f.rule_id == "hidden-html" for f in report.findings)


def test_the_gate_refuses_to_start_without_hyperscan() -> None:
    """No silent fallback to a backtracking engine: the import failure is named with its fix."""
    code = "import sys; sys.modules['hyperscan'] = None\nfrom gate import Gate\nGate(learned=False)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("gate.errors.GateError: hyperscan cannot be imported"), run.stderr
    assert "pip install hyperscan" in last


class _Warnings:
    """Records `log.warning` calls (structlog's capture_logs misses loggers an earlier test cached)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def warning(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})


def test_gitleaks_rules_that_are_not_linear_safe_are_skipped_naming_the_fix(tmp_path: Path, monkeypatch) -> None:
    config = tmp_path / "gitleaks.toml"
    config.write_text(
        "[[rules]]\nid = 'bounded'\nregex = '''acme_[a-z0-9]{32}'''\n"
        "[[rules]]\nid = 'nested'\nregex = '''(?:[a-z]+_)*acme_[a-z0-9]{32}'''\n"
        "[[rules]]\nid = 'nested-bounded'\nregex = '''(?:acme_[a-z0-9]{1,4})+x'''\n")
    monkeypatch.setattr(secrets_module, "log", warnings := _Warnings())
    rules, _ = load_gitleaks(config)
    logs = warnings.events
    assert [r.id for r in rules] == ["gitleaks:bounded"]
    skipped = {e["rule_id"]: e["reason"] for e in logs if e["event"] == "gitleaks_rule_skipped"}
    assert set(skipped) == {"gitleaks:nested", "gitleaks:nested-bounded"}
    assert all(r.startswith("not linear-safe: a repeat inside an unbounded repeat") and "bound the" in r
               for r in skipped.values())


def test_user_gitleaks_rules_keep_the_scan_linear(tmp_path: Path) -> None:
    config = tmp_path / "gitleaks.toml"
    config.write_text("[[rules]]\nid = 'acme'\nregex = '''acme_(?:live|test)_[A-Za-z0-9]{24,}'''\nentropy = 3.0\n")
    gate = Gate(gitleaks_config=config)
    build = _repeat_unit("acme_live_aB3xY9kQ2mN7pL5rT8vW4zC6 ")
    small, large = build(SMALL), build(TOOL_RESULT_LIMIT)
    assert any(f.rule_id == "gitleaks:acme" for f in gate.scan(small).findings)
    t_small = scan_seconds(gate, small, repeats=5)
    t_large = scan_seconds(gate, large, repeats=3)
    assert t_large <= LINEAR_RATIO_BOUND * max(t_small, 2e-3), (t_small, t_large)


def _repeat_unit(unit: str):
    return lambda n: (unit.encode() * (n // len(unit) + 1))[:n]
