"""The CLI's benchmark output: one JSON object with --json, readable lines without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli import app as cli
from kvkernel import Plan


def test_bench_json_prints_one_object():
    result = CliRunner().invoke(cli, ["bench", "policy", "--iterations", "20", "--json"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["embedded"]["p50_us"] > 0 and report["opa"]["skipped"]


def test_bench_readable_lines_name_every_value():
    result = CliRunner().invoke(cli, ["bench", "policy", "--iterations", "20"])
    assert result.exit_code == 0, result.output
    lines = dict(line.split(": ", 1) for line in result.stdout.strip().splitlines())
    assert float(lines["embedded.p50_us"]) > 0
    assert "opa.skipped" in lines


def test_logging_follows_the_current_stderr(capsys):
    """Logging set up under a swapped stream (as a CLI runner does) keeps working once it is closed."""
    import io
    import sys

    import structlog

    from gateway.logging import configure_logging

    real, swapped = sys.stderr, io.StringIO()
    sys.stderr = swapped
    try:
        configure_logging("info", json=True)
    finally:
        sys.stderr = real
    swapped.close()
    structlog.get_logger("cli-test").info("still.logged", n=1)
    err = capsys.readouterr().err
    assert '"event": "still.logged"' in err and "Logging error" not in err


@pytest.mark.model
def test_kernel_plan_json_names_the_verified_plan_and_its_cache(monkeypatch, tmp_path, model_cache_dir):
    monkeypatch.setenv("LETHE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LETHE_MODEL_CACHE_DIR", str(model_cache_dir))
    result = CliRunner().invoke(cli, ["kernel", "plan", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["source"] in ("calibrated", "cache") and report["plan_sha256"] == Plan.from_dict(report["plan"]).sha256
    assert report["fingerprint"]["threads"] >= 1 and report["fingerprint"]["linear_shapes"]["qkv"] == [960, 576]
    cached = json.loads(Path(report["path"]).read_text())
    assert cached["plan_sha256"] == report["plan_sha256"]


@pytest.mark.model
def test_kernel_plan_can_be_forced_and_is_still_verified(monkeypatch, model_cache_dir):
    monkeypatch.setenv("LETHE_MODEL_CACHE_DIR", str(model_cache_dir))
    result = CliRunner().invoke(cli, ["kernel", "plan", "--plan", "fallback-m64", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["source"] == "forced" and report["plan"]["fixed_m"] == 64 and report["plan"]["attention_min_rows"] is None


def test_an_unknown_plan_name_is_refused_with_the_choices():
    result = CliRunner().invoke(cli, ["bench", "kernel", "--plan", "fastest", "--json"])
    assert result.exit_code != 0
    assert "unknown kernel plan 'fastest'" in str(result.exception) and "fallback-m<M>" in str(result.exception)


@pytest.mark.parametrize(("flag", "names"), [
    ("Bad_Name=echo hi", "upstream name 'Bad_Name' must be 1 to 32 characters of a-z, 0-9 and '-'"),
    ("fx__tools=http://127.0.0.1:9/mcp", "upstream name 'fx__tools' must be"),
    ("no-equals-sign", "write NAME=COMMAND ARGS... or NAME=https://host/mcp"),
    ("fx=", "write NAME=COMMAND ARGS... or NAME=https://host/mcp"),
    ("fx=python 'unterminated", "cannot split the command (No closing quotation); quote it as a shell would"),
])
def test_a_wrong_upstream_flag_is_one_line_naming_the_fix_without_a_traceback(tmp_path, flag, names):
    result = CliRunner().invoke(cli, ["mcp", "--tenant", "acme", "--upstream", flag],
                                env={"LETHE_DATA_DIR": str(tmp_path)})
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"lethe mcp: --upstream {flag!r}: ") and names in line
