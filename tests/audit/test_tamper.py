"""Every way to tamper with an export or the database is caught by the offline verifier, by name."""
from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from audit import AuditLog, Signer
from audit.merkle import hash_leaf
from audit.note import Checkpoint
from audit.records import canonical
from audit.verify import NO_ANCHOR, verify_export

N = 40  # records; batch_size 8 gives checkpoints at 8, 16, 24, 32, 40



@pytest.fixture
def filled(sqlite_url, signer, record) -> Iterator[tuple[AuditLog, str]]:
    log = AuditLog(sqlite_url, signer, batch_size=8)
    kinds = ["forget", "quarantine", "amortize", "retention-forget", "policy-bundle"]
    for start in range(0, N, 8):
        log.append_many([record(i, kind=kinds[i % 5]) for i in range(start, start + 8)])
    trusted = next(c for c in log.checkpoints() if c.size == 24).note
    yield log, trusted
    log.close()


@pytest.fixture
def export(filled, tmp_path) -> dict[str, Any]:
    log, _ = filled
    log.export(tmp_path / "export.json")
    return json.loads((tmp_path / "export.json").read_text())


def _rehash(rec: dict) -> None:
    rec["leaf_hash"] = hash_leaf(canonical(rec["body"])).hex()


def _renumber(doc: dict) -> None:
    for i, rec in enumerate(doc["records"]):
        rec["index"] = i


def modify(doc):
    doc["records"][5]["body"]["span"] = [0, 1]


def modify_and_rehash(doc):
    modify(doc)
    _rehash(doc["records"][5])


def delete(doc):
    del doc["records"][5]


def delete_and_renumber(doc):
    delete(doc)
    _renumber(doc)


def reorder(doc):
    r = doc["records"]
    r[3], r[4] = r[4], r[3]


def reorder_and_renumber(doc):
    reorder(doc)
    _renumber(doc)


def insert(doc):
    forged = copy.deepcopy(doc["records"][9])
    forged["body"]["segment_id"] = "forged"
    _rehash(forged)
    doc["records"].insert(10, forged)
    _renumber(doc)


def truncate(doc):
    del doc["records"][35:]


def swap_signature(doc):
    sig8 = doc["checkpoints"][0].split("\n\n")[1]
    head, _ = doc["checkpoints"][1].split("\n\n")
    doc["checkpoints"][1] = f"{head}\n\n{sig8}"


def forge_witness(doc):
    rec = doc["records"][5]  # kind forget (5 % 5 == 0)
    assert rec["body"]["kind"] == "forget"
    rec["body"]["witness"]["max_abs_dk"] = 0.5
    _rehash(rec)


def forge_digest(doc):
    rec = doc["records"][10]
    rec["body"]["witness"]["digest_edited"] = "ffff"
    _rehash(rec)


def relabel_amortize_as_forget(doc):
    rec = doc["records"][2]
    assert rec["body"]["kind"] == "amortize"
    rec["body"]["kind"] = "forget"
    _rehash(rec)


EXPORT_TAMPERS: list[tuple[Callable[[dict], None], str]] = [
    (modify, "record 5: leaf hash"),
    (modify_and_rehash, "checkpoint 8: root hash differs"),
    (delete, "record 5: index 6 found at position 5"),
    (delete_and_renumber, "checkpoint 8: root hash differs"),
    (reorder, "record 3: index 4 found at position 3"),
    (reorder_and_renumber, "checkpoint 8: root hash differs"),
    (insert, "checkpoint 16: root hash differs"),
    (truncate, "checkpoint 40: covers 40 records but the export holds 35"),
    (swap_signature, "checkpoint 16: signature"),
    (forge_witness, "record 5: witness: max_abs_dk = 0.5, expected exactly 0"),
    (forge_digest, "record 10: witness: digest_edited ffff != digest_reference"),
    (relabel_amortize_as_forget, "record 2: witness"),
]


def test_untampered_export_verifies(export, filled, signer):
    report = verify_export(export, trusted_checkpoint=filled[1], public_key_pem=signer.public_key_pem)
    assert report.ok, report.summary()
    assert report.checked["records"] == N and report.checked["records_included"] == N
    assert report.checked["checkpoint_signatures"] == 6  # 5 in the export + the trusted one


@pytest.mark.parametrize("tamper, expected", EXPORT_TAMPERS, ids=[t.__name__ for t, _ in EXPORT_TAMPERS])
def test_tampered_export_is_detected_alike_in_one_process_or_two(export, filled, signer, forge, tmp_path, tamper, expected,
                                                                 two_processes):
    doc = copy.deepcopy(export)
    tamper(doc)
    path = tmp_path / "tampered.json"
    path.write_bytes(forge.lay_out(doc))  # in the log's layout: read by the fast reader, in one process or two
    report, one = (verify_export(source, trusted_checkpoint=filled[1], public_key_pem=signer.public_key_pem, workers=1)
                   for source in (doc, path))
    two = two_processes(path, trusted_checkpoint=filled[1], public_key_pem=signer.public_key_pem)
    assert not report.ok
    assert any(e.startswith(expected) for e in report.errors), report.errors
    assert (one.processes, two["processes"]) == (1, 2)
    # the strict reader, the fast one, and two processes: the same words, in order
    assert (one.errors, one.checked, one.anchor) == (report.errors, report.checked, report.anchor)
    assert (two["errors"], two["checked"], two["anchor"]) == (report.errors, report.checked, report.anchor)


def test_truncating_records_and_checkpoints_is_caught_by_the_trusted_checkpoint(export, filled, signer):
    doc = copy.deepcopy(export)
    del doc["records"][16:]
    doc["checkpoints"] = doc["checkpoints"][:2]
    doc["size"] = 16
    assert verify_export(doc, public_key_pem=signer.public_key_pem).ok  # nothing inside the export shows it...
    report = verify_export(doc, trusted_checkpoint=filled[1], public_key_pem=signer.public_key_pem)
    assert any(e.startswith("trusted checkpoint 24: covers 24 records but the export holds 16") for e in report.errors)


def test_history_rewritten_and_resigned_with_another_key_is_detected(export, filled, signer):
    forger = Signer.generate()
    doc = copy.deepcopy(export)
    doc["records"][5]["body"]["segment_id"] = "seg-FORGED"
    _rehash(doc["records"][5])
    tree_roots = {}
    from audit.merkle import CompactRange

    tree = CompactRange()
    for rec in doc["records"]:
        tree.append(bytes.fromhex(rec["leaf_hash"]))
        tree_roots[tree.size] = tree.root()
    doc["checkpoints"] = [
        Checkpoint.sign(doc["origin"], Checkpoint.from_note(n).size, tree_roots[Checkpoint.from_note(n).size], forger).note
        for n in doc["checkpoints"]
    ]
    doc["keys"] = [{**doc["keys"][0], "key_id": forger.key_id, "public_key_pem": forger.public_key_pem}]
    assert verify_export(doc, no_anchor=True).ok  # self-consistent forgery: only trust anchors can catch it
    assert verify_export(doc).errors == [f"root of trust: {NO_ANCHOR}"]
    report = verify_export(doc, public_key_pem=signer.public_key_pem)
    assert any(e.startswith("root of trust: the pinned public key is not this log's genesis key") for e in report.errors)
    report = verify_export(doc, trusted_checkpoint=filled[1])
    assert any(e.startswith("trusted checkpoint 24: signature") for e in report.errors)


# --- the same through the database, with its triggers dropped as an attacker would ---------------

def _raw(url: str, *stmts: tuple[str, dict]) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for t in ("audit_records", "audit_checkpoints"):
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {t}_no_update")
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {t}_no_delete")
        for stmt, params in stmts:
            conn.execute(sa.text(stmt), params)
    engine.dispose()


def _entry(log: AuditLog, i: int, **change: Any) -> tuple[bytes, bytes]:
    body = {**log.get(i).body, **change}
    entry = canonical(body)
    return entry, hash_leaf(entry)


def db_modify(log, url):
    entry, _ = _entry(log, 5, span=[0, 1])
    _raw(url, ("UPDATE audit_records SET entry = :e WHERE idx = 5", {"e": entry}))


def db_modify_and_rehash(log, url):
    entry, leaf = _entry(log, 5, span=[0, 1])
    _raw(url, ("UPDATE audit_records SET entry = :e, leaf_hash = :h WHERE idx = 5", {"e": entry, "h": leaf}))


def db_delete(log, url):
    _raw(url, ("DELETE FROM audit_records WHERE idx = 5", {}))


def db_reorder(log, url):
    _raw(
        url,
        ("UPDATE audit_records SET idx = -1 WHERE idx = 3", {}),
        ("UPDATE audit_records SET idx = 3 WHERE idx = 4", {}),
        ("UPDATE audit_records SET idx = 4 WHERE idx = -1", {}),
    )


def db_insert(log, url):
    entry, leaf = _entry(log, 9, segment_id="forged")
    stmts = [("DELETE FROM audit_records WHERE idx = :i", {"i": N - 1})]
    stmts += [("UPDATE audit_records SET idx = idx + 1 WHERE idx = :i", {"i": i}) for i in range(N - 2, 9, -1)]
    stmts.append((
        "INSERT INTO audit_records (idx, time_us, kind, tenant, session, entry, leaf_hash) "
        "VALUES (10, 0, 'forget', 'acme', 's0', :e, :h)",
        {"e": entry, "h": leaf},
    ))
    _raw(url, *stmts)


def db_truncate(log, url):
    _raw(url, ("DELETE FROM audit_records WHERE idx >= 35", {}))


def db_swap_signature(log, url):
    notes = {c.size: c.note for c in log.checkpoints()}
    forged = notes[16].split("\n\n")[0] + "\n\n" + notes[8].split("\n\n")[1]
    _raw(url, ("UPDATE audit_checkpoints SET note = :n WHERE size = 16", {"n": forged}))


def db_forge_witness(log, url):
    witness = {**log.get(5).body["witness"], "max_abs_dv": 0.25}
    entry, leaf = _entry(log, 5, witness=witness)
    _raw(url, ("UPDATE audit_records SET entry = :e, leaf_hash = :h WHERE idx = 5", {"e": entry, "h": leaf}))


DB_TAMPERS = [
    (db_modify, "record 5: leaf hash"),
    (db_modify_and_rehash, "checkpoint 8: root hash differs"),
    (db_delete, "record 5: index 6 found at position 5"),
    (db_reorder, "checkpoint 8: root hash differs"),
    (db_insert, "checkpoint 16: root hash differs"),
    (db_truncate, "checkpoint 40: covers 40 records but the export holds 35"),
    (db_swap_signature, "checkpoint 16: signature"),
    (db_forge_witness, "record 5: witness: max_abs_dv = 0.25, expected exactly 0"),
]


@pytest.mark.parametrize("tamper, expected", DB_TAMPERS, ids=[t.__name__ for t, _ in DB_TAMPERS])
def test_tampered_database_is_detected(filled, sqlite_url, signer, tmp_path, tamper, expected):
    log, trusted = filled
    tamper(log, sqlite_url)
    log.export(tmp_path / "tampered.json")
    report = verify_export(tmp_path / "tampered.json", trusted_checkpoint=trusted, public_key_pem=signer.public_key_pem)
    assert not report.ok
    assert any(e.startswith(expected) for e in report.errors), report.errors


def test_a_forged_key_rotation_is_detected(sqlite_url, signer, record, forge, tmp_path, two_processes):
    log = AuditLog(sqlite_url, signer, batch_size=4)
    log.append_many([record(i) for i in range(3)])
    new = Signer.generate()
    r = log.rotate_key(new)
    log.append_many([record(i) for i in range(4, 9)])
    log.export(tmp_path / "e.json")
    doc = json.loads((tmp_path / "e.json").read_text())
    assert verify_export(doc, public_key_pem=signer.public_key_pem).ok
    forger = Signer.generate()
    key = doc["records"][r]["body"]["key"]
    key["new_public_key"], key["new_key_id"] = base64.b64encode(forger.verifier.raw).decode(), forger.key_id
    _rehash(doc["records"][r])
    path = tmp_path / "forged.json"
    path.write_bytes(forge.lay_out(doc))
    report, two = verify_export(doc, public_key_pem=signer.public_key_pem), two_processes(path, public_key_pem=signer.public_key_pem)
    assert any(e.startswith(f"record {r}: key rotation: hand-over is not signed by the old key") for e in report.errors)
    assert any(e.startswith(f"checkpoint {doc['size']}: signature") for e in report.errors)  # the new key never took over
    assert two["processes"] == 2 and (two["errors"], two["checked"]) == (report.errors, report.checked)  # the same words, in order
    log.close()
