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
