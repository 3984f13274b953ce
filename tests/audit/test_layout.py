"""The verifier's fast reader of the log's own export layout proves what the strict reader proves.

``verify._as_written`` parses with the C scanner (no duplicate-name hook) and spells bodies with
the C encoder; it may answer only when the file is the log's layout of its own parse, with every
body in RFC 8785 bytes. These properties pin that down: whatever it accepts, the strict reader
parses to the same document and RFC 8785 spells the same bodies; a duplicated name anywhere sends
the file to the strict reader, which refuses it; and the fast canonical encoder equals RFC 8785 on
nasty JSON (control characters, U+2028, DEL, astral characters, lone surrogates, every float,
integers past 64 bits, which orjson reads as floats and refuses to write).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audit import layout
from audit.merkle import hash_leaf
from audit.records import canonical, canonical_parsed, compact_sorted, spelling_doubts
from audit.strict import Malformed, load_json
from audit.verify import _as_written, verify_export

NASTY = st.sampled_from(["\x00", "\x1f", "\x7f", "\u2028", "\u2029", "\ud800", "\udfff", "\ue000", "\uffff",
                         "\U0001f600", "\U00010000", "é", '"', "\\", "/", "e-", "e+", ".0,", "1234567890123456"])
TEXT = st.text(st.characters(exclude_categories=()), max_size=6) | st.lists(NASTY, max_size=3).map("".join)
NUMBER = (
    st.integers(-(2**60), 2**60) | st.sampled_from([2**53 - 1, 2**53, -(2**53), 10**15, 10**16 - 1])
    | st.sampled_from([2**63, -(2**63) - 1, 2**64 - 1, 2**64, -(2**64), 10**30])  # past orjson's 64 bits
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, -0.0, 1.0, 1e-4, 9.99e-5, 1e-6, 1e-7, 1e15, 1e16, 1e21, 5e-324, 1.5, 0.1])
)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBER | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=20,
)
BODY = st.dictionaries(TEXT, JSON, max_size=6)


def _parsed(body: dict[str, Any]) -> Any:
    """The body as a verifier gets it: through JSON text (surrogates pass as escapes)."""
    return json.loads(json.dumps(body))


@settings(max_examples=1500, deadline=None)
@given(body=BODY)
def test_the_fast_canonical_form_is_rfc8785_on_nasty_json(body):
    parsed = _parsed(body)
    try:
        expected = canonical(parsed)
    except Exception as e:  # noqa: BLE001 - RFC 8785 refuses it: so must the fast path
        with pytest.raises(type(e)):
            canonical_parsed(parsed)
        return
    assert canonical_parsed(parsed) == expected


@settings(max_examples=400, deadline=None)
@given(body=BODY)
def test_a_body_without_spelling_doubts_is_rfc8785(body):
    parsed = _parsed(body)
    fast = compact_sorted(parsed)
    if next(spelling_doubts(fast), None) is None:
        assert canonical(parsed) == fast


def _laid_out(bodies: list[Any], spelling: list[bool]) -> bytes:
    """An export in the log's layout; each body in RFC 8785 bytes, or (where ``spelling`` says, or
    RFC 8785 refuses it) in Python's compact sorted spelling, as a forger might write it."""
    header = {"format": layout.EXPORT_FORMAT, "origin": "o", "size": len(bodies), "keys": []}
    pieces = []
    for i, (body, rfc) in enumerate(zip(bodies, spelling)):
        try:
            entry = canonical(body) if rfc else compact_sorted(body)
        except Exception:  # noqa: BLE001
            entry = compact_sorted(body)
        pieces.append(layout.record(i, hash_leaf(entry).hex(), entry))
    return layout.head(header, ["a note\n"]).encode() + layout.RECORD_SEPARATOR.join(pieces) + layout.TAIL


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(BODY, max_size=5), spelling=st.lists(st.booleans(), min_size=5, max_size=5))
def test_what_the_layout_reader_accepts_the_strict_reader_reads_alike_with_rfc8785_bodies(bodies, spelling):
    data = _laid_out([_parsed(b) for b in bodies], spelling)
    fast = _as_written(data)
    if fast is None:
        return
    doc, entries = fast
    assert doc == load_json(data, "export")
    assert entries == [canonical(rec["body"]) for rec in doc["records"]]


def test_the_log_export_is_read_by_the_layout_reader_and_any_other_spelling_by_the_strict_one(honest, signer, tmp_path):
    _, doc, path = honest
    assert _as_written(path.read_bytes()) is not None
    indented = tmp_path / "indented.json"
    indented.write_text(json.dumps(doc, indent=1))
    assert _as_written(indented.read_bytes()) is None
    fast, strict = (verify_export(p, public_key_pem=signer.public_key_pem) for p in (path, indented))
    assert fast.ok and (fast.errors, fast.checked, fast.anchor) == (strict.errors, strict.checked, strict.anchor)


def _members(value: Any) -> list[str]:
    """The compact spelling of every member of every object in ``value``, as the layout writes it."""
    if isinstance(value, dict):
        own = [compact_sorted({k: v})[1:-1].decode() for k, v in value.items()]
        return own + [m for v in value.values() for m in _members(v)]
    if isinstance(value, list):
        return [m for v in value for m in _members(v)]
    return []


def test_a_member_duplicated_in_any_body_object_is_refused(honest, tmp_path):
    _, doc, path = honest
    text = path.read_text()
    members = sorted({m for rec in doc["records"] for m in _members(rec["body"])})
    assert len(members) > 100
    for member in members:
        forged = text.replace(member, f"{member},{member}", 1)
        assert forged != text
        assert _as_written(forged.encode()) is None, member
        with pytest.raises(Malformed, match="duplicate name"):
            load_json(forged, "export")
    report = verify_export(_write(tmp_path / "dup.json", text.replace(members[0], f"{members[0]},{members[0]}", 1)), no_anchor=True)
    assert report.exit_code == 2 and "duplicate name" in report.errors[0]


@pytest.mark.parametrize("member", ['"format": "lethe-audit-export/1"', '"size": 20', '"from_size": 0', '"index": 3'])
def test_a_member_duplicated_in_the_header_or_a_record_is_refused(honest, tmp_path, member):
    _, _, path = honest
    text = path.read_text()
    forged = text.replace(member, f"{member}, {member}", 1)
    assert forged != text and _as_written(forged.encode()) is None
    report = verify_export(_write(tmp_path / "dup.json", forged), no_anchor=True)
    assert report.exit_code == 2 and "duplicate name" in report.errors[0]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("index", ["18446744073709551616", "18446744073709551617", "-9223372036854775809"])
def test_an_index_past_64_bits_is_read_exactly_by_the_strict_reader(honest, signer, tmp_path, index):
    _, _, path = honest
    forged = path.read_text().replace('"index": 3,', f'"index": {index},', 1)
    assert _as_written(forged.encode()) is None
    report = verify_export(_write(tmp_path / "big.json", forged), public_key_pem=signer.public_key_pem)
    assert f"record 3: index {index} found at position 3" in report.errors[0]
