"""The verifier stands alone: no database or web stack imported, a CLI that names failures, a URL mode."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, Header, HTTPException
from fastapi.testclient import TestClient

from audit.api import make_router
from audit.verify import main, verify_url

ROOT = Path(__file__).resolve().parents[2]


def test_verifier_imports_no_database_gateway_or_kernel_code():
    code = (
        "import sys, audit.verify; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('sqlalchemy', 'psycopg', 'fastapi', 'starlette', 'gateway', 'kvkernel', 'torch', 'audit.log', 'audit.db')"
        " or m in ('audit.log', 'audit.db', 'audit.api')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_exits_non_zero_naming_the_record_and_check(sqlite_log, record, tmp_path, capsys, signer):
    sqlite_log.append_many([record(i) for i in range(10)])
    sqlite_log.export(tmp_path / "e.json")
    (tmp_path / "pub.pem").write_text(signer.public_key_pem)
    trusted = tmp_path / "trusted.note"
    trusted.write_text(sqlite_log.checkpoint().note)
    args = ["--export", str(tmp_path / "e.json"), "--public-key", str(tmp_path / "pub.pem"), "--trusted-checkpoint", str(trusted)]
    assert main(args) == 0
    assert "OK:" in capsys.readouterr().out
    doc = json.loads((tmp_path / "e.json").read_text())
    doc["records"][7]["body"]["witness"]["max_abs_dlogits"] = 1.5
    (tmp_path / "e.json").write_text(json.dumps(doc))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "FAIL: record 7: leaf hash" in err
    assert "FAIL: record 7: witness: max_abs_dlogits = 1.5, expected exactly 0" in err


def test_verify_url_fetches_the_export_with_an_admin_key(sqlite_log, record, signer):
    sqlite_log.append_many([record(i) for i in range(9)])

    class Admin:
        tenant, is_admin = "ops", True

    def principal(authorization: str = Header()) -> Admin:
        if authorization != "Bearer s3cret":
            raise HTTPException(401)
        return Admin()

    app = FastAPI()
    app.include_router(make_router(lambda: sqlite_log, principal))
    report = verify_url(
        "http://testserver", api_key="s3cret", public_key_pem=signer.public_key_pem, client=TestClient(app)
    )
    assert report.ok and report.checked["records"] == 9, report.summary()


@pytest.mark.slow
def test_the_audit_bench_verifies_an_honest_export_and_reports_its_time(tmp_path):
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    result = CliRunner().invoke(cli, ["bench", "audit", "--json", "--records", "300", "--verify-records", "200",
                                      "--sqlite-path", str(tmp_path / "bench.db")])
    assert result.exit_code == 0, result.output
    verify = json.loads(result.output.strip().splitlines()[-1])["verify"]
    assert verify["records"] == 200 and verify["checkpoints"] == 200 // 64 + 1 and verify["one_core_s"] > 0
    assert verify["verify_s"] == min(s for s in (verify["one_core_s"], verify["two_cores_s"]) if s)
