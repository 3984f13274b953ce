"""The verifier's fast reader of the log's own export layout proves what the strict reader proves.

``verify_records`` parses a block at a time with orjson (no duplicate-name hook) and spells bodies
with orjson; it may answer only when the file is the log's layout of its own parse, with every
body in RFC 8785 bytes. These properties pin that down: whatever it accepts, the strict reader
parses to the same header and finds the same leaves and the same faults in the records; a
duplicated name anywhere sends the file to the strict reader, which refuses it; the fast
canonical encoder equals RFC 8785 on nasty JSON (control characters, U+2028, DEL, astral
characters, lone surrogates, every float, integers past 64 bits, which orjson reads as floats and
refuses to write); and two processes give the report one gives, word for word, also when the
second process cannot be had.
"""
from __future__ import annotations

import copy
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit import AuditError, layout, verify_records
from audit.merkle import hash_leaf
from audit.records import canonical, canonical_parsed, canonical_record, compact_sorted, spelling_doubts
from audit.strict import Malformed, load_json
from audit.verify import verify_export
from audit.verify_records import Findings, findings, layout_findings, layout_head

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
    _same_as_rfc8785(canonical_parsed, _parsed(body))


def _same_as_rfc8785(fast, value) -> None:
    """`fast(value)` is RFC 8785's canonical form of `value`, or refused with the same error type."""
    try:
        expected = canonical(value)
    except Exception as e:  # noqa: BLE001 - RFC 8785 refuses it: so must the fast path
        with pytest.raises(type(e)):
            fast(value)
        return
    assert fast(value) == expected


@settings(max_examples=1500, deadline=None)
@given(body=BODY | st.dictionaries(TEXT, st.tuples(NUMBER, NUMBER) | st.just(float("nan")) | NUMBER, max_size=4))
def test_the_fast_canonical_form_of_a_callers_record_is_rfc8785_or_refused_alike(body):
    """The log's append path (``validate``): a caller's body, not parsed JSON: integral floats
    (every gate score 0.0), tuples, NaN (refused), surrogates, integers past 2**53."""
    _same_as_rfc8785(canonical_record, body)


@settings(max_examples=400, deadline=None)
@given(body=BODY)
def test_a_body_without_spelling_doubts_is_rfc8785(body):
    parsed = _parsed(body)
    try:
        fast = compact_sorted(parsed)
    except TypeError:  # orjson refuses it: so does the fast reader, which sends it to the strict one
        return
    if not spelling_doubts(fast):
        assert canonical(parsed) == fast


def _as_written(data: bytes, workers: int = 1) -> tuple[dict[str, Any], Findings] | None:
    """The fast reader's header and findings, or None where it leaves the file to the strict reader."""
    head = layout_head(data)
    if head is None:
        return None
    doc, start, end = head
    found = layout_findings(data, start, end, workers=workers, meanwhile=lambda: None)
    return None if found is None else (doc, found)


def _spelt(body: Any, rfc: bool) -> bytes:
    """A body in RFC 8785 bytes, or (where ``rfc`` is false, or RFC 8785 refuses it) in a compact sorted
    spelling, orjson's or Python's, as a forger might write it."""
    for spell in ((canonical,) if rfc else ()) + (compact_sorted,):
        try:
            return spell(body)
        except Exception:  # noqa: BLE001 - refused: the next spelling
            continue
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


def _laid_out(bodies: list[Any], spelling: list[bool], indices: list[int] | None = None) -> bytes:
    """An export in the log's layout, each body spelt as ``_spelt`` says, each record at its index
    (by default its position) with its body's leaf hash."""
    header = {"format": layout.EXPORT_FORMAT, "origin": "o", "size": len(bodies), "keys": []}
    pieces = []
    for i, (body, rfc) in enumerate(zip(bodies, spelling)):
        entry = _spelt(body, rfc)
        pieces.append(layout.record(i if indices is None else indices[i], hash_leaf(entry).hex(), entry))
    return layout.head(header, ["a note\n"]).encode() + layout.RECORD_SEPARATOR.join(pieces) + layout.TAIL


def _same(fast: Findings, strict: Findings) -> bool:
    return (fast.count, fast.leaves, fast.notes) == (strict.count, strict.leaves, strict.notes)


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(BODY, max_size=5), spelling=st.lists(st.booleans(), min_size=5, max_size=5),
       moved=st.lists(st.integers(0, 6), min_size=5, max_size=5))
def test_what_the_layout_reader_accepts_the_strict_reader_reads_alike(bodies, spelling, moved):
    data = _laid_out([_parsed(b) for b in bodies], spelling, moved[: len(bodies)])
    fast = _as_written(data)
    if fast is None:
        return
    doc, found = fast
    strict = load_json(data, "export")
    assert doc == {**strict, "records": []}
    assert _same(found, findings(strict["records"]))


def test_the_log_export_is_read_by_the_layout_reader_and_any_other_spelling_by_the_strict_one(honest, signer, tmp_path):
    _, doc, path = honest
    fast = _as_written(path.read_bytes())
    assert fast is not None and _same(fast[1], findings(doc["records"])) and not fast[1].notes
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


def test_the_layout_reader_spells_records_as_the_layout_does():
    entry = b'{"kind":"forget","time":"t"}'
    assert verify_records._laid_out([7, 8], [b"ab" * 32, b"cd" * 32], [entry, entry]) == layout.RECORD_SEPARATOR.join(
        [layout.record(7, "ab" * 32, entry), layout.record(8, "cd" * 32, entry)])


@pytest.fixture
def tampered(honest, forge, tmp_path) -> tuple[dict[str, Any], Path]:
    """The honest export with a forged witness and a deleted record, still in the log's layout."""
    doc = copy.deepcopy(honest[1])
    doc["records"][0]["body"]["witness"]["max_abs_dv"] = 0.25
    forge.rehash(doc["records"][0])
    del doc["records"][9]
    path = tmp_path / "tampered.json"
    path.write_bytes(forge.lay_out(doc))
    return doc, path


@pytest.mark.parametrize("block, batch", [(1, 1), (300, 2), (2000, 3), (verify_records.BLOCK, verify_records.BATCH)])
def test_block_and_batch_sizes_change_nothing_found(honest, tampered, monkeypatch, block, batch):
    monkeypatch.setattr(verify_records, "BLOCK", block)
    monkeypatch.setattr(verify_records, "BATCH", batch)
    for doc, path in (honest[1:], tampered):
        fast = _as_written(path.read_bytes())
        assert fast is not None and _same(fast[1], findings(doc["records"]))


def _reports(path: Path, signer: Any) -> tuple[Any, Any]:
    """One process and `workers=2` in this process (where a fault is injected here)."""
    one, two = (verify_export(path, public_key_pem=signer.public_key_pem, workers=w) for w in (1, 2))
    assert (two.errors, two.checked, two.anchor, two.exit_code) == (one.errors, one.checked, one.anchor, one.exit_code)
    return one, two


def test_two_processes_give_the_report_and_first_error_of_one(honest, tampered, signer, two_processes):
    for doc, path in (honest[1:], tampered):
        one = verify_export(path, public_key_pem=signer.public_key_pem, workers=1)
        two = two_processes(path, public_key_pem=signer.public_key_pem)
        assert (two["errors"], two["checked"], two["anchor"]) == (one.errors, one.checked, one.anchor)
        assert (one.processes, two["processes"]) == (1, 2)
    assert one.errors[0] == "record 0: witness: max_abs_dv = 0.25, expected exactly 0"
    assert "record 9: index 10 found at position 9 (records deleted, inserted or reordered)" in one.errors


def test_without_a_second_process_one_process_gives_the_same_report(tampered, signer, monkeypatch):
    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(verify_records.os, "fork", no_fork)
    _, two = _reports(tampered[1], signer)
    assert two.processes == 1 and not two.ok


def test_a_second_process_that_dies_is_replaced_by_this_one(tampered, signer, monkeypatch):
    read, parent = verify_records._read, os.getpid()

    def dies_if_forked(*args: Any) -> Any:
        if os.getpid() != parent:
            os._exit(3)  # killed, out of memory...: it sends nothing back
        return read(*args)

    monkeypatch.setattr(verify_records, "_read", dies_if_forked)
    _, two = _reports(tampered[1], signer)
    assert two.processes == 1 and not two.ok


def test_a_process_running_threads_is_not_forked(tampered, signer):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        _, two = _reports(tampered[1], signer)
    finally:
        stop.set()
        thread.join()
    assert two.processes == 1


NASTY = st.sampled_from([None, True, 0, -1, 2**53, 1.5, 1.0, "", "x", "é", [], {}, [1, 2], {"content": "x"}])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_tampering_in_the_layout_gets_one_report_from_either_reader_in_one_process_or_two(honest, forge, signer, tmp_path, data):
    """The strict reader (a dict), the fast one (the same export in the log's layout) and the fast
    one in two processes: the same verdict, the same errors in the same order, never a traceback."""
    doc = copy.deepcopy(honest[1])
    records = doc["records"]
    for _ in range(data.draw(st.integers(1, 3), label="tamperings")):
        r = data.draw(st.integers(0, len(records) - 1), label="record")
        how = data.draw(st.sampled_from(["field", "field", "drop", "swap", "index", "leaf", "rehash", "record"]), label="how")
        if how in ("field", "index", "leaf", "rehash") and not (isinstance(records[r], dict) and isinstance(records[r].get("body"), dict)):
            continue  # replaced by a non-record earlier
        if how == "field":
            body = records[r]["body"]
            # (an earlier tampering may have made the witness a list, a number or None: then only the body)
            in_witness = isinstance(body.get("witness"), dict) and data.draw(st.booleans(), label="in witness")
            target = body["witness"] if in_witness else body
            target[data.draw(st.sampled_from(sorted(target) + ["extra"]), label="name")] = data.draw(NASTY, label="value")
        elif how == "drop" and len(records) > 1:
            del records[r]
        elif how == "swap":
            s = data.draw(st.integers(0, len(records) - 1), label="with")
            records[r], records[s] = records[s], records[r]
        elif how == "index":
            records[r]["index"] = data.draw(st.integers(-1, len(records) + 1), label="index")
        elif how == "leaf":
            records[r]["leaf_hash"] = data.draw(st.sampled_from(["", "00" * 32, "AB" * 32]), label="leaf")
        elif how == "rehash":
            try:
                forge.rehash(records[r])
            except AuditError:  # RFC 8785 refuses the body: its leaf hash stays as it was
                pass
        elif how == "record":
            records[r] = data.draw(st.sampled_from([{}, [], "x", {"index": r, "leaf_hash": "", "body": []}]), label="record")
    try:
        laid_out = forge.lay_out(doc)
    except Exception:  # noqa: BLE001 - RFC 8785 refuses a body (an integer past 2**53, say): no layout to write
        return
    path = tmp_path / "t.json"
    path.write_bytes(laid_out)
    strict, one, two = (verify_export(source, public_key_pem=signer.public_key_pem, workers=w)
                        for source, w in ((json.loads(laid_out), 1), (path, 1), (path, 2)))
    for report in (one, two):
        assert (report.errors, report.checked, report.anchor, report.exit_code) == (strict.errors, strict.checked, strict.anchor, strict.exit_code)
