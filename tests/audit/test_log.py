"""AuditLog on SQLite: appends, validation, checkpoints, proofs, rotation, triggers, keys."""
from __future__ import annotations

import os
import stat
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from audit import AuditError, AuditLog, Checkpoint, RecordNotFound, Signer
from audit.merkle import hash_leaf
from audit.records import canonical
from audit.verify import verify_erasure_proof, verify_export


def test_append_is_canonical_and_hashed_as_rfc9162_leaf(sqlite_log, record):
    index = sqlite_log.append(record(0))
    got = sqlite_log.get(index)
    assert index == 0 and got.index == 0
    assert got.body["kind"] == "forget" and got.body["time"].endswith("Z")
    assert got.leaf_hash == hash_leaf(canonical(got.body)).hex()
    assert abs(got.time - datetime.now(timezone.utc)) < timedelta(seconds=30)
    with pytest.raises(RecordNotFound):
        sqlite_log.get(1)


def test_a_keyed_append_is_done_once_however_often_it_is_retried(sqlite_log, record, tmp_path):
    """A relayed intent redone after a crash appends nothing twice: the key is stored with the record."""
    first = sqlite_log.append_keyed([("int_1/0", record(0)), ("int_1/1", record(1))])
    sqlite_log.append(record(2))
    again = sqlite_log.append_keyed([("int_1/1", record(1)), ("int_1/0", record(0)), ("int_2/0", record(3))])
    assert first == [0, 1] and again == [1, 0, 3]
    assert sqlite_log.size == 4
    sqlite_log.export(tmp_path / "export.json")
    assert verify_export(tmp_path / "export.json", public_key_pem=sqlite_log.keys()[0]["public_key_pem"]).ok


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kind": "erase"}, "kind"),
        ({"content": "the secret"}, "never hold content"),
        ({"gate": {"findings": [{"content": "x"}]}}, "never hold content"),
        ({"time": "2020-01-01T00:00:00.000000Z"}, "set by the log"),
        ({"span": [5, 1]}, "span"),
        ({"token_count": -1}, "token_count"),
        ({"content_sha256": "ABC"}, "content_sha256"),
        ({"decision": {"reasons": []}}, "decision"),
        ({"witness": {**{"max_abs_dk": 1e-9}, "digest_edited": "a", "digest_reference": "a"}}, "max_abs_dk"),
        ({"witness": {"max_abs_dk": 0, "digest_edited": "a", "digest_reference": "b"}}, "digest_edited"),
        ({"witness": None}, "witness"),
    ],
)
def test_invalid_records_are_refused_and_nothing_is_written(sqlite_log, record, change, message):
    body = {**record(0), **change}
    with pytest.raises(AuditError, match=message):
        sqlite_log.append(body)
    assert sqlite_log.size == 0


def test_amortize_must_say_it_is_not_an_erasure(sqlite_log, record):
    sqlite_log.append(record(0, kind="amortize"))
    amortize = record(1, kind="amortize")
    with pytest.raises(AuditError, match="never_saw must be false"):
        sqlite_log.append({**amortize, "witness": {**amortize["witness"], "never_saw": True}})


def test_checkpoints_are_batched_and_proofs_verify(sqlite_log, record):
    assert sqlite_log.append_many([record(i) for i in range(7)]) == list(range(7))
    assert sqlite_log.checkpoints() == []  # 7 < batch_size 8
    sqlite_log.append(record(7))
    assert [c.size for c in sqlite_log.checkpoints()] == [8]
    sqlite_log.append_many([record(i) for i in range(8, 21)])
    head = sqlite_log.checkpoint()
    assert head.size == 21 and sqlite_log.checkpoint() == head  # unchanged tree: same checkpoint
    head.verify(sqlite_log.signer.verifier)
    assert Checkpoint.from_note(head.note) == head
    for i in range(21):
        sqlite_log.inclusion_proof(i).verify(bytes.fromhex(sqlite_log.get(i).leaf_hash), head.root_hash)
    old = sqlite_log.checkpoints()[0]
    sqlite_log.consistency_proof(old.size).verify(old.root_hash, head.root_hash)
    # any record in any checkpoint
    sqlite_log.inclusion_proof(3, 8).verify(bytes.fromhex(sqlite_log.get(3).leaf_hash), old.root_hash)
    with pytest.raises(AuditError, match="fewer than"):
        sqlite_log.inclusion_proof(3, 22)


def test_list_filters_and_pages(sqlite_log, record):
    sqlite_log.append_many([record(i, tenant="a" if i % 2 else "b") for i in range(10)])
    sqlite_log.append(record(10, tenant="a", kind="quarantine"))
    assert [r.index for r in sqlite_log.list(tenant="a")] == [1, 3, 5, 7, 9, 10]
    assert [r.index for r in sqlite_log.list(tenant="a", kind="quarantine")] == [10]
    assert [r.index for r in sqlite_log.list(session="s0", tenant="b")] == [0, 6]
    page = sqlite_log.list(limit=4)
    assert [r.index for r in sqlite_log.list(limit=4, after=page[-1].index)] == [4, 5, 6, 7]
    now = datetime.now(timezone.utc)
    assert len(sqlite_log.list(since=now - timedelta(minutes=5), until=now + timedelta(minutes=5))) == 11
    assert sqlite_log.list(since=now + timedelta(minutes=5)) == []


def test_erasure_proof_verifies_offline_and_detects_a_changed_record(sqlite_log, record, signer):
    sqlite_log.append_many([record(i) for i in range(5)])
    proof = sqlite_log.erasure_proof(3)
    report = verify_erasure_proof(proof, public_key_pem=signer.public_key_pem)
    assert report.ok, report.summary()
    proof["record"]["body"]["span"] = [0, 1]
    report = verify_erasure_proof(proof, public_key_pem=signer.public_key_pem)
    assert any(e.startswith("record 3: leaf hash") for e in report.errors)
    assert any(e.startswith("record 3: inclusion") for e in report.errors)
    assert not verify_erasure_proof(sqlite_log.erasure_proof(3), public_key_pem=Signer.generate().public_key_pem).ok


def test_key_rotation_is_a_record_signed_by_the_old_key(sqlite_url, record, signer, tmp_path):
    log = AuditLog(sqlite_url, signer, batch_size=4)
    log.append_many([record(i) for i in range(5)])
    new = Signer.generate()
    r = log.rotate_key(new)
    assert log.get(r).body["key"]["old_key_id"] == signer.key_id
    assert log.checkpoints()[-1].key_id == signer.key_id  # the checkpoint covering the rotation: old key
    log.append_many([record(i) for i in range(6, 12)])
    assert log.checkpoint().key_id == new.key_id
    assert log.public_key()["key_id"] == new.key_id
    assert [k["key_id"] for k in log.keys()] == [signer.key_id, new.key_id]
    log.export(tmp_path / "export.json")
    report = verify_export(tmp_path / "export.json", public_key_pem=signer.public_key_pem)  # the genesis key
    assert report.ok and report.checked["key_rotations"] == 1, report.summary()
    signed_by_new = log.checkpoint().note
    report = verify_export(tmp_path / "export.json", public_key_pem=new.public_key_pem, trusted_checkpoint=signed_by_new)
    assert report.ok and "signed the trusted checkpoint" in report.anchor, report.summary()
    assert verify_erasure_proof(log.erasure_proof(2), public_key_pem=new.public_key_pem).ok
    with pytest.raises(AuditError, match="active key"):  # a replica still holding the old key
        AuditLog(sqlite_url, signer)
    log.close()


def test_triggers_refuse_update_and_delete(sqlite_log, record, sqlite_url):
    sqlite_log.append_many([record(i) for i in range(8)])
    engine = sa.create_engine(sqlite_url)
    for stmt in (
        "UPDATE audit_records SET kind = 'quarantine' WHERE idx = 1",
        "DELETE FROM audit_records WHERE idx = 7",
        "UPDATE audit_nodes SET hash = x'00' WHERE id = 0",
        "DELETE FROM audit_checkpoints",
        "DELETE FROM audit_keys",
    ):
        with engine.connect() as conn, pytest.raises(sa.exc.DatabaseError, match="append-only"):
            conn.exec_driver_sql(stmt)
    engine.dispose()
    assert sqlite_log.size == 8 and sqlite_log.get(1).body["kind"] == "forget"


def test_key_file_is_created_0600_and_a_readable_key_is_refused(tmp_path):
    path = tmp_path / "keys" / "audit.pem"
    signer = Signer.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Signer.load_or_create(path).key_id == signer.key_id
    assert Signer.from_pem(path.read_text()).public_key_pem == signer.public_key_pem
    os.chmod(path, 0o644)
    with pytest.raises(AuditError, match="chmod 600"):
        Signer.load_or_create(path)
    with pytest.raises(AuditError, match="PEM"):
        Signer.from_pem("not a key")
    assert "PRIVATE" not in repr(signer)
