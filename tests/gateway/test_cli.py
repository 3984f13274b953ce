"""The CLI's benchmark output: one JSON object with --json, readable lines without."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gateway.cli import app as cli


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
