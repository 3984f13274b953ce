"""An outside auditor's attacks on `lethe audit verify`: each is refused, by name, with the right exit code.

Every attack here was accepted (exit 0) or crashed the verifier before the verifier gained roots of
trust, strict reading, one witness rule set and header checks.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from audit import AuditLog, Signer
from audit.verify import NO_ANCHOR, main, verify_erasure_proof, verify_export
from gateway.cli import app as cli


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


# --- roots of trust ----------------------------------------------------------------------------

def test_a_history_resigned_by_an_attacker_who_rotates_to_the_real_key_is_refused(honest, forge, signer, tmp_path):
    """The forged rotation: drop an erasure, re-sign everything with the attacker's key, end with a
    rotation from the attacker's key to the real one. Every signature verifies; the pin does not."""
    _, doc, _ = honest
    attacker = Signer.generate()
    forged = copy.deepcopy(doc)
    del forged["records"][0]  # a forget, gone
    forge.append_rotation(forged, attacker, signer)
    forged = forge.resign(forged, attacker)
    assert verify_export(forged, no_anchor=True).ok  # internally consistent: the attack is well formed
    report = verify_export(forged, public_key_pem=signer.public_key_pem)
    assert report.errors == [report.errors[0]] and report.errors[0].startswith(
        "root of trust: the pinned public key is not this log's genesis key"
    ), report.errors
    assert "a key rotation to it inside the export proves nothing" in report.errors[0]
    path = _write(tmp_path / "forged.json", forged)
    assert main(["--export", str(path), "--public-key", str(tmp_path / "genesis.pem")]) == 1


def test_the_forged_rotation_is_refused_against_a_trusted_checkpoint_too(honest, forge, signer):
    log, doc, _ = honest
    trusted = log.checkpoints()[0].note  # size 8, signed by the real key
    attacker = Signer.generate()
    forged = copy.deepcopy(doc)
    forge.append_rotation(forged, attacker, signer)
    forged = forge.resign(forged, attacker)
    report = verify_export(forged, public_key_pem=signer.public_key_pem, trusted_checkpoint=trusted)
    assert any(e.startswith("trusted checkpoint 8: signature") for e in report.errors), report.errors
    assert any(e.startswith("root of trust: the pinned public key is not this log's genesis key nor the key that signed")
               for e in report.errors), report.errors
    report = verify_export(forged, trusted_checkpoint=trusted)  # the checkpoint alone anchors as well
    assert any(e.startswith("trusted checkpoint 8: signature") for e in report.errors), report.errors


def test_a_real_rotation_verifies_from_the_genesis_key_or_from_a_checkpoint_the_new_key_signed(sqlite_url, signer, record, tmp_path):
    log = AuditLog(sqlite_url, signer, batch_size=4)
    log.append_many([record(i) for i in range(5)])
    new = Signer.generate()
    log.rotate_key(new)
    log.append_many([record(i) for i in range(6, 12)])
    log.export(tmp_path / "e.json")
    assert verify_export(tmp_path / "e.json", public_key_pem=signer.public_key_pem).ok
    after = log.checkpoint().note
    report = verify_export(tmp_path / "e.json", public_key_pem=new.public_key_pem, trusted_checkpoint=after)
    assert report.ok, report.summary()
    report = verify_export(tmp_path / "e.json", public_key_pem=new.public_key_pem)  # the new key alone anchors nothing
    assert not report.ok and report.errors[0].startswith("root of trust: the pinned public key is not")
    log.close()


def test_without_a_root_of_trust_the_verdict_fails_unless_no_anchor_is_explicit(honest, tmp_path, capsys):
    _, _, path = honest
    assert main(["--export", str(path)]) == 1
    assert f"FAIL: root of trust: {NO_ANCHOR}" in capsys.readouterr().err
    assert main(["--export", str(path), "--no-anchor"]) == 0
    out = capsys.readouterr().out
    assert "warning: no root of trust (--no-anchor): this shows internal consistency only" in out


def test_a_trusted_checkpoint_alone_anchors_and_prints_no_public_key_warning(honest, tmp_path, capsys):
    log, _, path = honest
    (tmp_path / "seen.note").write_text(log.checkpoints()[1].note)
    assert main(["--export", str(path), "--trusted-checkpoint", str(tmp_path / "seen.note")]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and "anchored to: the trusted checkpoint 16" in out, out


def test_lethe_audit_verify_pins_a_key_and_prints_each_failure_once(honest, forge, signer, tmp_path):
    _, doc, path = honest
    runner = CliRunner()
    ok = runner.invoke(cli, ["audit", "verify", "--export", str(path), "--public-key", str(tmp_path / "genesis.pem")])
    assert ok.exit_code == 0, ok.output
    assert "anchored to: the pinned key is the genesis key" in ok.output
    attacker = Signer.generate()
    forged = forge.resign(doc, attacker)
    bad = runner.invoke(cli, ["audit", "verify", "--export", str(_write(tmp_path / "f.json", forged)),
                              "--public-key", str(tmp_path / "genesis.pem")])
    assert bad.exit_code == 1
    assert bad.output.count("root of trust: the pinned public key") == 1, bad.output
    assert "Traceback" not in bad.output


# --- erasure proofs ----------------------------------------------------------------------------

@pytest.mark.parametrize("index, kind", [(2, "amortize"), (1, "quarantine"), (4, "policy-bundle")])
def test_a_proof_of_a_record_that_is_not_an_erasure_fails(honest, signer, index, kind):
    log, _, _ = honest
    proof = log.erasure_proof(index)
    assert proof["record"]["body"]["kind"] == kind
    report = verify_erasure_proof(proof, public_key_pem=signer.public_key_pem)
    assert report.exit_code == 1
    assert report.errors == [f"record {index}: a {kind!r} record is not an erasure (erasures: ['forget', 'retention-forget']); it proves no erasure"]


@pytest.mark.parametrize("index", [0, 3])
def test_a_proof_of_an_erasure_verifies_against_the_pinned_key_only(honest, signer, index):
    log, _, _ = honest
    proof = log.erasure_proof(index)
    assert verify_erasure_proof(proof, public_key_pem=signer.public_key_pem).ok
    assert verify_erasure_proof(proof, public_key_pem=Signer.generate().public_key_pem).errors[0].startswith("checkpoint")
    assert verify_erasure_proof(proof).errors[0].startswith("root of trust")
    assert verify_erasure_proof(proof, no_anchor=True).ok


# --- duplicate names and the unsigned header ---------------------------------------------------

def test_a_duplicated_name_in_a_body_is_refused(honest, tmp_path):
    _, _, path = honest
    text = path.read_text()
    forged = text.replace('"segment_id":"seg-0"', '"segment_id":"seg-FORGED","segment_id":"seg-0"', 1)
    assert forged != text
    report = verify_export(_write_text(tmp_path / "dup.json", forged), no_anchor=True)
    assert report.exit_code == 2
    assert report.errors == ["export: duplicate name 'segment_id' in one object (refused: a reader would keep only one)"]


def test_a_forged_records_array_in_front_of_the_real_one_is_refused(honest, tmp_path):
    _, _, path = honest
    text = path.read_text()
    forged = text.replace('"checkpoints":', '"records": [], "checkpoints":', 1)
    report = verify_export(_write_text(tmp_path / "dup.json", forged), no_anchor=True)
    assert report.exit_code == 2 and "duplicate name 'records'" in report.errors[0]


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_header_size_that_claims_more_records_fails(honest, signer):
    _, doc, _ = honest
    forged = {**doc, "size": doc["size"] + 50}
    report = verify_export(forged, public_key_pem=signer.public_key_pem)
    assert report.errors == [f"export.size: says {doc['size'] + 50} records, but the export holds {doc['size']}"]


def test_an_extra_key_in_the_header_fails(honest, signer):
    _, doc, _ = honest
    other = Signer.generate()
    forged = {**doc, "keys": [*doc["keys"], {"key_id": other.key_id, "name": other.name,
                                             "public_key_pem": other.public_key_pem, "from_size": 9}]}
    report = verify_export(forged, public_key_pem=signer.public_key_pem)
    assert report.errors == ["export.keys: lists 2 keys, but the genesis key and the verified rotations make 1"]


def test_a_rotation_replayed_from_another_log_is_refused(honest, forge, signer):
    _, doc, _ = honest
    forged = copy.deepcopy(doc)
    forged["origin"] = "other.example/audit"
    new = Signer.generate()
    forged["records"].append(forge.rotation({**doc, "records": doc["records"]}, signer, new))  # made for doc's origin
    forged = forge.resign(forged, signer)
    report = verify_export(forged, public_key_pem=signer.public_key_pem)
    assert any("key rotation: hands over log 'lethe.local/audit', not this log 'other.example/audit'" in e
               for e in report.errors), report.errors


# --- red team: a fresh export attacked as an outside auditor would ------------------------------

def _swap_genesis(doc, signer, forge):
    attacker = Signer.generate()
    doc["keys"][0] = {**doc["keys"][0], "public_key_pem": attacker.public_key_pem, "key_id": attacker.key_id}


def _reorder_checkpoints(doc, signer, forge):
    doc["checkpoints"].reverse()


def _drop_last_records_and_checkpoint(doc, signer, forge):
    del doc["records"][16:]
    doc["checkpoints"] = doc["checkpoints"][:2]
    doc["size"] = 16


def _resign_with_real_key_after_rewriting_an_erasure(doc, signer, forge):
    """An insider with the real key rewrites record 0 and re-signs: only a trusted checkpoint catches it."""
    doc["records"][0]["body"]["decision"]["reasons"] = ["forged"]
    doc.update(forge.resign(doc, signer))


def _checkpoint_from_another_origin(doc, signer, forge):
    from audit.note import Checkpoint

    cp = Checkpoint.from_note(doc["checkpoints"][0])
    doc["checkpoints"][0] = Checkpoint.sign("other.example/audit", cp.size, cp.root_hash, signer).note


def _forget_relabelled_as_retention_forget_with_a_failed_witness(doc, signer, forge):
    rec = doc["records"][3]  # a retention-forget
    rec["body"]["witness"].update(max_abs_dv=0.5, equal=False)
    doc.update(forge.resign(doc, signer))


RED_TEAM = [
    (_swap_genesis, "checkpoint 8: signature"),
    (_reorder_checkpoints, "export.checkpoints: sizes"),
    (_drop_last_records_and_checkpoint, "trusted checkpoint 20: covers 20 records but the export holds 16"),
    (_resign_with_real_key_after_rewriting_an_erasure, "trusted checkpoint 20: not consistent with the export"),
    (_checkpoint_from_another_origin, "checkpoint 8: origin 'other.example/audit'"),
    (_forget_relabelled_as_retention_forget_with_a_failed_witness, "record 3: witness: max_abs_dv = 0.5"),
]


@pytest.mark.parametrize("attack, expected", RED_TEAM, ids=[a.__name__.strip("_") for a, _ in RED_TEAM])
def test_red_team_attacks_on_a_fresh_export_fail(honest, forge, signer, attack, expected):
    log, doc, _ = honest
    trusted = log.latest_checkpoint().note  # what the auditor saved last time: size 20
    doc = copy.deepcopy(doc)
    attack(doc, signer, forge)
    report = verify_export(doc, public_key_pem=signer.public_key_pem, trusted_checkpoint=trusted)
    assert report.exit_code == 1, report.summary()
    assert any(e.startswith(expected) for e in report.errors), report.errors


def test_a_retired_key_that_forks_history_at_its_rotation_is_caught_by_a_later_trusted_checkpoint(
    sqlite_url, signer, record, forge, tmp_path
):
    """Whoever steals a retired key can rewrite its hand-over to a key of their own: the genesis key
    alone cannot tell (the fork chains from it). A checkpoint saved after the real rotation can."""
    log = AuditLog(sqlite_url, signer, batch_size=4)
    log.append_many([record(i) for i in range(4)])
    new = Signer.generate()
    r = log.rotate_key(new)
    log.append_many([record(i) for i in range(6, 10)])
    seen = log.checkpoint().note  # signed by the new key, saved by the auditor
    log.export(tmp_path / "e.json")
    doc = json.loads((tmp_path / "e.json").read_text())
    thief = Signer.generate()
    forked = copy.deepcopy(doc)
    forked["records"] = forked["records"][:r]
    forge.append_rotation(forked, signer, thief)  # the stolen genesis key hands over to the thief
    forked["records"] += copy.deepcopy(doc["records"][r + 1 :])
    forked["_next_signers"] = {r: thief}
    forked = forge.resign(forked, signer, every=4)
    assert verify_export(forked, public_key_pem=signer.public_key_pem).ok  # the known limit of a key chain
    report = verify_export(forked, public_key_pem=signer.public_key_pem, trusted_checkpoint=seen)
    assert any(e.startswith(f"trusted checkpoint {doc['size']}: ") for e in report.errors), report.errors
    log.close()
