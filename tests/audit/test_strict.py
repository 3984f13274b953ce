"""Malformed input is refused in one line naming the place, exit code 2, never a traceback.

And a property: any mutation of a valid export (flipped bytes, deleted, duplicated, retyped or
reordered JSON) gets a clean verdict, and only a mutation that changes nothing verifies.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit.strict import load_json
from audit.verify import main, verify_url

ROOT = Path(__file__).resolve().parents[2]


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _set(path_in_doc: list, value: Any):  # noqa: ANN202
    def change(_raw: bytes, doc: Any) -> bytes:
        target = doc
        for key in path_in_doc[:-1]:
            target = target[key]
        target[path_in_doc[-1]] = value
        return _dumps(doc)
    return change


MALFORMED_EXPORTS = [
    ("invalid_json", lambda raw, doc: raw[:-20], "export: invalid JSON at line"),
    ("invalid_utf8", lambda raw, doc: raw.replace(b'"seg-1"', b'"seg-\xff"', 1), "export: not UTF-8 (invalid byte at offset"),
    ("top_level_array", lambda raw, doc: _dumps([doc]), "export: must be an object, not an array"),
    ("record_is_a_string", _set(["records", 3], "forget"), "export.records[3]: must be an object, not a string"),
    ("body_is_a_list", _set(["records", 2, "body"], []), "export.records[2].body: must be an object, not an array"),
    ("checkpoint_is_a_number", _set(["checkpoints", 0], 8), "export.checkpoints[0]: must be a string, not an integer"),
    ("checkpoint_is_not_a_note", _set(["checkpoints", 1], "hello"), "export.checkpoints[1]: not a signed checkpoint note"),
    ("index_is_a_bool", _set(["records", 0, "index"], False), "export.records[0].index: must be an integer, not true or false"),
    ("size_is_a_string", _set(["size"], "20"), "export.size: must be an integer, not a string"),
    ("missing_records", lambda raw, doc: _dumps({k: v for k, v in doc.items() if k != "records"}), "export: missing 'records'"),
    ("unknown_field", _set(["note"], "trust me"), "export: unexpected 'note' (not part of this format)"),
    ("record_unknown_field", _set(["records", 1, "signature"], "x"), "export.records[1]: unexpected 'signature'"),
    ("no_keys", _set(["keys"], []), "export.keys: must list at least the genesis key"),
    ("genesis_not_pem", _set(["keys", 0, "public_key_pem"], "not a key"), "export.keys[0]: not an Ed25519 public key in PEM form"),
    ("nan", lambda raw, doc: raw.replace(b'"size": 20', b'"size": NaN', 1), "export: invalid JSON: NaN is not JSON"),
    ("deeply_nested", lambda raw, doc: b"[" * 100_000, "export: JSON nested too deeply"),
    ("wrong_format", _set(["format"], "lethe-audit-export/0"), "export.format: 'lethe-audit-export/0' is not"),
]


@pytest.mark.parametrize("name, build, message", MALFORMED_EXPORTS, ids=[m[0] for m in MALFORMED_EXPORTS])
def test_a_malformed_export_is_one_line_naming_the_place_with_exit_code_2(honest, tmp_path, capsys, name, build, message):
    _, _, path = honest
    bad = tmp_path / "bad.json"
    bad.write_bytes(build(path.read_bytes(), json.loads(path.read_text())))
    assert main(["--export", str(bad), "--public-key", str(tmp_path / "genesis.pem")]) == 2
    captured = capsys.readouterr()
    fails = [line for line in captured.err.splitlines() if line.startswith("FAIL: ")]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL: {message}"), captured.err
    assert captured.err.rstrip().endswith("MALFORMED INPUT")


LONE_SURROGATE = [  # "\ud800" is valid JSON but no UTF-8 string: every use of it must fail cleanly
    ("body_string", '"segment_id":"seg-1"', '"segment_id":"seg-\\ud800"', 1),
    ("leaf_hash", '"leaf_hash": "', '"leaf_hash": "\\ud800', 1),
    ("genesis_name", '"name": "lethe.local/audit"', '"name": "lethe\\ud800"', 2),
    ("checkpoint_note", '"lethe.local/audit\\n8\\n', '"lethe.local/audit\\ud800\\n8\\n', 2),
]


@pytest.mark.parametrize("name, old, new, code", LONE_SURROGATE, ids=[c[0] for c in LONE_SURROGATE])
def test_a_lone_surrogate_anywhere_fails_cleanly(honest, tmp_path, capsys, name, old, new, code):
    _, _, path = honest
    text = path.read_text()
    assert old in text
    (tmp_path / "s.json").write_text(text.replace(old, new, 1))
    assert main(["--export", str(tmp_path / "s.json"), "--public-key", str(tmp_path / "genesis.pem")]) == code
    assert "FAIL: " in capsys.readouterr().err


def test_a_byte_order_mark_is_accepted(honest, tmp_path):
    _, _, path = honest
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert main(["--export", str(tmp_path / "bom.json"), "--public-key", str(tmp_path / "genesis.pem")]) == 0


@pytest.mark.parametrize("args, message", [
    (["--trusted-checkpoint", "missing.note"], "FAIL: trusted checkpoint missing.note: cannot read missing.note"),
    (["--public-key", "missing.pem"], "FAIL: public key missing.pem: cannot read missing.pem"),
    (["--public-key", "export.json"], "FAIL: public key: not an Ed25519 public key in PEM form"),
])
def test_missing_or_wrong_files_are_malformed_input(honest, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert main(["--export", "export.json", *args]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith(message), err


@pytest.mark.parametrize("change, message", [
    (lambda p: p["record"].pop("body"), "FAIL: proof.record: missing 'body'"),
    (lambda p: p.update(record="x"), "FAIL: proof.record: must be an object, not a string"),
    (lambda p: p["inclusion_proof"]["hashes"].insert(0, "zz"), "FAIL: proof.inclusion_proof.hashes[0]: must be 64 lowercase hex digits"),
    (lambda p: p.update(checkpoint=5), "FAIL: proof.checkpoint: must be a string, not an integer"),
])
def test_a_malformed_proof_is_malformed_input(honest, tmp_path, capsys, change, message):
    log, _, _ = honest
    proof = log.erasure_proof(0)
    change(proof)
    (tmp_path / "p.json").write_text(json.dumps(proof))
    assert main(["--proof", str(tmp_path / "p.json"), "--public-key", str(tmp_path / "genesis.pem")]) == 2
    assert capsys.readouterr().err.splitlines()[0].startswith(message)


def _gateway(status: int, body: str) -> TestClient:
    app = FastAPI()
    app.get("/v1/audit/export")(lambda: PlainTextResponse(body, status_code=status))
    return TestClient(app)


@pytest.mark.parametrize("status, body, message", [
    (401, '{"error": "unauthorized"}', "--url http://testserver/v1/audit/export: answered HTTP 401 Unauthorized; give an admin API key"),
    (200, "<html>not json</html>", "reply of http://testserver/v1/audit/export: invalid JSON at line 1 column 1"),
    (200, "[1, 2]", "reply of http://testserver: must be an export object"),
    (500, "oops", "--url http://testserver/v1/audit/export: answered HTTP 500 Internal Server Error"),
])
def test_a_gateway_reply_that_is_no_export_is_malformed_input(status, body, message):
    report = verify_url("http://testserver", api_key="k", client=_gateway(status, body))
    assert report.exit_code == 2 and report.errors == [report.errors[0]] and report.errors[0].startswith(message), report.errors


def test_an_unreachable_gateway_is_malformed_input():
    report = verify_url("http://127.0.0.1:18149", api_key="k")  # nothing listens on this port
    assert report.exit_code == 2 and report.errors[0].startswith("--url http://127.0.0.1:18149/v1/audit/export: cannot fetch")


def test_the_command_line_never_prints_a_traceback(honest, tmp_path):
    _, _, path = honest
    (tmp_path / "bad.json").write_bytes(b'{"format": "lethe-audit-export/1", "records": "x"')
    cases = [["--export", str(tmp_path / "bad.json")], ["--export", str(tmp_path / "nope.json")],
             ["--proof", str(path)], ["--export", str(path), "--trusted-checkpoint", str(path)]]
    for args in cases:
        done = subprocess.run([sys.executable, "-m", "audit.verify", *args], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr)


# --- the property ------------------------------------------------------------------------------

def _mutate_json(doc: Any, data: st.DataObject) -> Any:
    """Walk to a random place of ``doc`` and delete, duplicate, retype or reorder it."""
    target, path = doc, []
    while isinstance(target, (dict, list)) and target and data.draw(st.booleans(), label="deeper"):
        key = data.draw(st.sampled_from(sorted(target) if isinstance(target, dict) else range(len(target))))
        if not isinstance(target[key], (dict, list)) or not target[key]:
            break
        path.append(key)
        target = target[key]
    if not isinstance(target, (dict, list)) or not target:
        return doc
    keys = sorted(target) if isinstance(target, dict) else list(range(len(target)))
    key = data.draw(st.sampled_from(keys))
    how = data.draw(st.sampled_from(["delete", "retype", "reorder", "duplicate"]))
    if how == "delete":
        del target[key]
    elif how == "retype":
        target[key] = data.draw(st.sampled_from([None, True, 0, -1, 2**64, 1.5, "", "x", [], {}, [1], {"a": 1}]))
    elif how == "reorder":
        items = list(target.items()) if isinstance(target, dict) else list(target)
        shuffled = data.draw(st.permutations(items))
        if isinstance(target, dict):
            target.clear()
            target.update(shuffled)
        else:
            target[:] = shuffled
    elif isinstance(target, list):
        target.insert(key, target[key])
    else:
        return ("duplicate", json.dumps(doc).replace(json.dumps(key) + ":", json.dumps(key) + ": 0, " + json.dumps(key) + ":", 1))
    return doc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_mutation_of_a_valid_export_gets_a_clean_verdict(honest, tmp_path, data):
    from audit.verify import verify_export

    _, original, path = honest
    pem = (tmp_path / "genesis.pem").read_text()
    raw = path.read_bytes()
    if data.draw(st.booleans(), label="bytes"):
        mutated = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(mutated) - 1))
            mutated[at] ^= data.draw(st.integers(1, 255))
        text = bytes(mutated)
    else:
        doc = _mutate_json(json.loads(raw), data)
        text = doc[1].encode() if isinstance(doc, tuple) else json.dumps(doc).encode()
    (tmp_path / "m.json").write_bytes(text)
    report = verify_export(tmp_path / "m.json", public_key_pem=pem)  # must return, never raise
    assert report.exit_code in (0, 1, 2)
    assert all("\n" not in e for e in report.errors)
    if report.ok:  # only a change that changes nothing signed verifies: same records, keys and head;
        got = load_json(text, "mutated")  # dropping a checkpoint that a later one covers loses nothing
        assert {**got, "checkpoints": None} == {**original, "checkpoints": None}
        assert got["checkpoints"][-1] == original["checkpoints"][-1]
        assert set(got["checkpoints"]) <= set(original["checkpoints"])


def _hostile_server(send_body) -> tuple[str, threading.Thread]:
    """A raw socket server answering one GET with 200 and a chunked body from `send_body(conn)`."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            try:
                send_body(conn)
            except OSError:  # the verifier hung up: what it should do
                pass
        sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", thread


def _flood(conn: socket.socket) -> None:
    chunk = b" " * 65536
    while True:
        conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))


def _drip(conn: socket.socket) -> None:
    while True:
        conn.sendall(b"1\r\n \r\n")
        time.sleep(0.2)


def test_a_gateway_that_sends_without_end_is_cut_off_at_the_size_cap():
    url, thread = _hostile_server(_flood)
    report = verify_url(url, api_key="k", max_bytes=4 << 20)
    assert report.exit_code == 2 and "sent more than 4194304 bytes" in report.errors[0], report.errors
    thread.join(10)


def test_a_gateway_that_drips_its_export_is_cut_off_at_the_deadline():
    url, thread = _hostile_server(_drip)
    report = verify_url(url, api_key="k", deadline_s=1.0)
    assert report.exit_code == 2 and "did not finish sending the export in time" in report.errors[0], report.errors
    thread.join(10)
