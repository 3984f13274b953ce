"""Which record bodies certainly pass the record rules, decided a column at a time. Pure: stdlib, orjson.

Why. The offline verifier must check 10^5 records in well under a second, and the rules
(``records.body_errors`` and ``rules.witness_errors``) cost microseconds of Python per record.
:func:`accepted` looks at a batch of bodies one column at a time instead (every span, every
digest, every time of the bodies that have the same kind and the same names), with a few calls
per column and none per value: a column of strings is joined, a column of numbers is spelt by
orjson and its spelling read as bytes (``_naturals``, ``_zeros``), flags are compared with
the spelling of as many ``true``.

It is a sufficient condition, not a second rule set: a body it does not vouch for goes to the
rules, which give the verdict and name the fault, so it may be stricter than they are (a
key-rotation, whose signature the key chain checks, is never vouched for; nor are bodies whose
witnesses differ in their names) but never looser. A property test requires that every body it
vouches for has no error under the rules.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate, chain, repeat
from operator import add, contains, ge, itemgetter, le, lt, sub
from typing import Any

import orjson

from .records import _DICT_FIELDS, _STR_FIELDS, KINDS  # the rules' own field lists
from .rules import DIVERGENCE, ERASURE_KINDS, MAX_DELTAS

__all__ = ["accepted"]

Columns = dict[str, tuple[Any, ...]]

_TIME_SHAPE = b"0000-00-00T00:00:00.000000Z"  # records._TIME, each digit read as 0
_DIGITS_TO_0 = bytes.maketrans(b"0123456789", b"0" * 10)
_HEX_TO_X = bytes.maketrans(b"0123456789abcdef", b"x" * 16)  # records._SHA256_HEX, each hex digit read as x


def accepted(bodies: Sequence[dict[str, Any]], texts: Iterable[bytes]) -> list[bool]:
    """For each body (a parsed JSON object): True only if the rules find nothing wrong with it and
    it holds ``time`` (see the module docstring). ``texts`` hold the bodies' canonical bytes (their
    own, or a layout of records around them) and no other quoted word "content"."""
    ok = [False] * len(bodies)
    if any(b'"content"' in text for text in texts):  # records.body_errors looks only where this is
        return ok  # a 'content' name, or that word in a string: the rules look closer
    for names, positions in _alike(list(map(tuple, bodies))):
        group = [bodies[i] for i in positions] if len(positions) < len(bodies) else bodies
        try:
            passes = _passes(names, group)
        except (TypeError, ValueError, KeyError):  # a value of a type no check expects (a list for a kind): the rules name it
            passes = False
        if passes:
            for i in positions:
                ok[i] = True
    return ok


def _alike(keys: list[Any]) -> list[tuple[Any, list[int]]]:
    """Each distinct key, and the positions where it is."""
    if len(set(keys)) == 1:
        return [(keys[0], list(range(len(keys))))]
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.items())


def _columns(objects: Sequence[dict[str, Any]], names: tuple[str, ...] | None = None) -> Columns | None:
    """Each name's values, if every object has the same names (``names``, if known) in the same
    order; else None. The values are read in the objects' order, not looked up by name."""
    if names is None:
        shapes = set(map(tuple, objects))
        if len(shapes) != 1:
            return None
        (names,) = shapes
    return dict(zip(names, zip(*map(dict.values, objects))))


def _passes(names: tuple[str, ...], bodies: Sequence[dict[str, Any]]) -> bool:
    """Whether every body with these names passes, kind by kind."""
    body = _columns(bodies, names)
    if body is None or "kind" not in body:  # (never None with names given: the type says it may be)
        return False
    kinds = _alike(list(body["kind"]))
    if len(kinds) > 1:
        return all((cols := _columns([bodies[i] for i in positions], names)) is not None
                   and _body(kind, cols, len(positions)) for kind, positions in kinds)
    return _body(kinds[0][0], body, len(bodies))


def _body(kind: Any, body: Columns, n: int) -> bool:
    """``records.body_errors``, ``rules.witness_errors`` and the 'time' a verifier requires, for
    ``n`` bodies of one kind given as columns."""
    if kind not in KINDS or kind == "key-rotation" or "time" not in body:
        return False
    if not all(_strings(body[name]) for name in _STR_FIELDS if name in body):
        return False
    if not all(_types(body[name]) == {dict} for name in _DICT_FIELDS if name in body):
        return False
    span = _pairs(body["span"]) if "span" in body else None
    if "span" in body and span is None:
        return False
    if "token_count" in body and not _naturals(body["token_count"]):
        return False
    if "content_sha256" in body and not _spelt_as(body["content_sha256"], _HEX_TO_X, b"x" * 64):
        return False
    if not _spelt_as(body["time"], _DIGITS_TO_0, _TIME_SHAPE) or ("decision" in body and not _decisions(body["decision"])):
        return False
    if kind in ERASURE_KINDS:
        return "witness" in body and span is not None and _erasures(body["witness"], span, body.get("token_count"))
    if kind == "amortize":
        return "witness" in body and span is not None and _amortizes(body["witness"], span)
    return "witness" not in body


def _types(values: Any) -> set[type]:
    return set(map(type, values))


def _strings(values: tuple[Any, ...]) -> bool:
    try:
        "".join(values)
    except TypeError:
        return False
    return True


def _spelt_as(values: tuple[Any, ...], table: bytes, shape: bytes) -> bool:
    """Every value a string that ``table`` turns into ``shape`` (all joined at once: the newlines
    between them keep each in its place, since ``table`` leaves newlines as they are)."""
    return _strings(values) and "\n".join(values).encode().translate(table) == b"\n".join(repeat(shape, len(values)))


def _naturals(values: Any) -> bool:
    """Every value an integer >= 0 (not a bool, a float or a string): orjson spells such a column with digits and commas only."""
    return not orjson.dumps(values)[1:-1].translate(None, b"0123456789,")


def _zeros(values: Any) -> bool:
    """Every value a number equal to 0: orjson spells it 0, 0.0 or -0.0, and anything else with another byte."""
    return not orjson.dumps(values)[1:-1].translate(None, b"0.-,")


def _numbers(values: Any) -> bool:
    """Every value a finite number (orjson spells an infinity or NaN as null, and no other value with these bytes only)."""
    return not orjson.dumps(values)[1:-1].translate(None, b"0123456789.e+-,")


def _flags(values: tuple[Any, ...], flag: bool) -> bool:
    """Every value ``flag`` itself (not 1 or 0)."""
    return orjson.dumps(values) == b"[" + b",".join(repeat(orjson.dumps(flag), len(values))) + b"]"


def _pairs(values: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Starts and ends, if every value is a [start, end] pair with 0 <= start <= end (``rules._span``)."""
    if not values or _types(values) != {list} or set(map(len, values)) != {2}:
        return None
    starts, ends = zip(*values)
    return (starts, ends) if _naturals(starts) and _naturals(ends) and all(map(le, starts, ends)) else None


def _decisions(values: tuple[Any, ...]) -> bool:
    """``records._type_errors`` on 'decision': an object with a string action, a list of reasons, a string bundle hash."""
    decision = _columns(values) if _types(values) == {dict} else None
    return (decision is not None and "action" in decision and _strings(decision["action"])
            and _types(decision.get("reasons", [[]])) == {list} and _strings(decision.get("bundle_hash", ())))


def _erasures(witnesses: tuple[Any, ...], span: tuple[tuple[int, ...], tuple[int, ...]], counts: tuple[Any, ...] | None) -> bool:
    """``rules._erasure_errors``, a column at a time: zero deltas, equal digests, true flags, and
    spans that are sorted, non-empty, include the record's span and fit in the tokens."""
    w = _columns(witnesses)
    required = (*MAX_DELTAS, "digest_edited", "digest_reference", "equal", "argmax_equal", "kind", "tokens", "spans")
    if w is None or not all(name in w for name in required):
        return False
    if set(w["kind"]) != {"never-saw"} or not all(_zeros(w[name]) for name in MAX_DELTAS):
        return False
    edited = w["digest_edited"]
    if not _strings(edited) or "" in edited or edited != w["digest_reference"]:
        return False
    if not all(_flags(w.get(name, (True,)), True) for name in ("equal", "argmax_equal", "never_saw")) or not _naturals(w["tokens"]):
        return False
    starts, ends = span
    if counts is not None and counts != tuple(map(sub, ends, starts)):
        return False
    return _spans(w["spans"], span, w["tokens"])


def _spans(lists: tuple[Any, ...], span: tuple[tuple[int, ...], tuple[int, ...]], tokens: tuple[int, ...]) -> bool:
    """``rules._spans`` and the checks on them: each list non-empty, sorted, non-overlapping, holding
    the record's span, and ending within the surviving plus erased tokens."""
    if _types(lists) != {list}:
        return False
    record_spans = list(map(list, zip(*span)))
    if set(map(len, lists)) == {1}:  # one span each (the usual erasure): the record's, non-empty, within the tokens
        starts, ends = span
        return (orjson.dumps(list(map(itemgetter(0), lists))) == orjson.dumps(record_spans)
                and all(map(lt, starts, ends)) and all(map(le, starts, tokens)))
    if min(map(len, lists)) == 0 or not all(map(contains, lists, record_spans)):
        return False
    pairs = _pairs(tuple(chain.from_iterable(lists)))
    if pairs is None:
        return False
    starts, ends = pairs
    lasts = list(accumulate(map(len, lists)))
    previous = [0, *ends[:-1]]  # each span starts at or after the one before it in its list...
    for first in lasts[:-1]:
        previous[first] = 0  # ...and the first of each list after nothing
    if not (all(map(lt, starts, ends)) and all(map(ge, starts, previous))):
        return False
    erased = [0, *accumulate(map(sub, ends, starts))]
    sums = map(sub, map(erased.__getitem__, lasts), map(erased.__getitem__, [0, *lasts[:-1]]))
    return all(map(le, [ends[i - 1] for i in lasts], map(add, tokens, sums)))


def _amortizes(witnesses: tuple[Any, ...], span: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """``rules._amortize_errors``, a column at a time: not an erasure, its divergence measured, its span the record's."""
    w = _columns(witnesses)
    if w is None or not all(name in w for name in (*DIVERGENCE, "never_saw", "span")):
        return False
    if not _flags(w["never_saw"], False) or set(w.get("kind", ("amortize",))) != {"amortize"}:
        return False
    if not all(_numbers(w[name]) and min(w[name]) >= 0 for name in DIVERGENCE) or max(w["argmax_agreement"]) > 1:
        return False
    return _pairs(w["span"]) == span
