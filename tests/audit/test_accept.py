"""``audit.accept`` vouches only for bodies the rules pass, and for the log's own bodies of every kind.

It is the verifier's fast path for step 2, a column at a time; the rules (``records.body_errors``,
``rules.witness_errors``) stay the verdict. A body it wrongly vouched for would be a forged record
accepted, so the property is checked on random mutations of valid bodies, in batches of mixed
kinds and shapes: a value replaced by a nasty one (a bool for a number, a float for an integer,
a span out of order, a digest of the wrong case), a name deleted or added.
"""
from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from audit.accept import accepted
from audit.bench import _record as bench_record
from audit.records import body_errors, format_time
from audit.rules import witness_errors
from tests.audit.conftest import make_record

TIME = "2026-11-24T01:43:50.123456Z"


def _valid() -> list[dict[str, Any]]:
    bodies = [make_record(i, kind=kind) for i, kind in enumerate(
        ["forget", "retention-forget", "amortize", "quarantine", "policy-bundle", "redact", "content-erase"])]
    several = make_record(9)  # a forget of three spans at once: one record per span, each witness lists all three
    several["span"], several["witness"]["spans"] = [20, 25], [[3, 8], [20, 25], [30, 31]]
    late = make_record(90)  # a span far into the cache: the witness's tokens must reach it
    bodies += [several, late, bench_record(5)]
    return [json.loads(json.dumps({**body, "time": TIME})) for body in bodies]


VALID = _valid()
NASTY = st.sampled_from([
    None, True, False, 0, 1, -1, 5, 25, 100, 4096, 2**53, 2**64, 0.0, -0.0, 0.5, 1.0, 1e-7, "", "x", "forget",
    "never-saw", "amortize", "0" * 64, "A" * 64, "e3b0c442", TIME, TIME.replace("T", " "), TIME[:-1] + "\n",
    [], {}, [20, 25], [25, 20], [20.0, 25], [True, 25], [[20, 25]], [[3, 8], [20, 25]], [[20, 25], [3, 8]],
    [[20, 25], [22, 30]], [[20, 20]], [[-1, 25]], {"content": "x"}, ["secret"], {"action": "forget"},
])


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value: object names and array positions."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [p for k, v in items for p in [(*prefix, k), *_paths(v, (*prefix, k))]]


def _at(body: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        body = body[step]
    return body


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    body = copy.deepcopy(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 3))):
        paths = _paths(body)  # the witness and the span, where the rules relate values, drawn more often
        path = draw(st.sampled_from(paths + [p for p in paths if p[0] in ("witness", "span", "token_count")] * 3))
        parent, name = _at(body, path[:-1]), path[-1]
        action = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if action == "set":
            parent[name] = copy.deepcopy(draw(NASTY))
        elif action == "delete":
            del parent[name]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "span", "witness", "kind", "argmax_equal", "never_saw", "key"]))] = copy.deepcopy(draw(NASTY))
    return body


def _entry(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@settings(max_examples=5000, deadline=None)
@given(bodies=st.lists(mutated(), min_size=1, max_size=6))
def test_every_body_vouched_for_passes_the_rules(bodies):
    for body, ok in zip(bodies, accepted(bodies, [_entry(b) for b in bodies])):
        if ok:
            assert "time" in body and body_errors(body) == [] and witness_errors(body) == [], body


def test_the_logs_own_bodies_of_every_kind_are_vouched_for_in_any_mix():
    assert accepted(VALID, [_entry(b) for b in VALID]) == [True] * len(VALID)
    renamed = [{**body, "tenant": f"t{i}", "time": format_time_of(i)} for i, body in enumerate(VALID * 3)]
    assert all(accepted(renamed, [_entry(b) for b in renamed]))


def format_time_of(i: int) -> str:
    from datetime import datetime, timedelta, timezone

    return format_time(datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=i, microseconds=7 * i))


def test_what_the_rules_refuse_is_not_vouched_for():
    body, several, late = VALID[0], VALID[7], VALID[8]
    refused = [
        {**body, "span": [1, 6]},  # the witness erased another span
        {**body, "token_count": 4},  # not the span's length
        {**body, "witness": {**body["witness"], "max_abs_dk": 0.5}},
        {**body, "witness": {**body["witness"], "argmax_equal": False}},
        {**body, "witness": {**body["witness"], "equal": 1}},  # 1 is not true
        {**body, "witness": {k: v for k, v in body["witness"].items() if k != "max_abs_dlogits"}},
        {**body, "time": TIME.replace("T", " ")},
        {**body, "content_sha256": "A" * 64},
        {**body, "gate": {"content": "the secret"}},
        {**VALID[2], "kind": "forget"},  # an amortize witness is no erasure witness
        {**VALID[3], "witness": VALID[0]["witness"]},  # a quarantine carries no witness
        {**body, "span": [3, 3], "token_count": 0, "witness": {**body["witness"], "spans": [[3, 3]]}},  # an empty span
        {**late, "witness": {**late["witness"], "tokens": 25}},  # the span lies past the cache
        {**several, "witness": {**several["witness"], "tokens": 10}},
        {**several, "span": [40, 45]},  # not among the witness's spans
        {**several, "witness": {**several["witness"], "spans": [[20, 25], [3, 8], [30, 31]]}},  # out of order
        {**several, "witness": {**several["witness"], "spans": [[3, 21], [20, 25], [30, 31]]}},  # overlapping
    ]
    for bad in refused:
        assert body_errors(bad) + witness_errors(bad), bad
        assert accepted([bad], [_entry(bad)]) == [False], bad
        assert not accepted([*VALID, bad], [_entry(b) for b in (*VALID, bad)])[-1], bad  # (nor, maybe, its like)
