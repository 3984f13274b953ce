"""`python -m gate.bench peers`: the side-by-side secrets bench scores every scanner by the same
lines, and a peer that is not installed is skipped with the command that installs it."""

from __future__ import annotations

from pathlib import Path

from gate.peers import _value_lines, peer_bins, run_peers_bench, score


def test_a_missing_peer_is_skipped_with_the_install_command(tmp_path: Path) -> None:
    assert peer_bins(tmp_path) == {"credsweeper": None, "detect-secrets": None}
    result = run_peers_bench(tmp_path, megabytes=0.05, per_format=1, progress=False)
    for peer in ("credsweeper", "detect_secrets"):
        assert "not found" in result[peer]["skipped"] and "pip install credsweeper detect-secrets" in result[peer]["skipped"]
    assert result["lethe_gate"]["recall"] >= 0.98 and result["lethe_gate"]["lookalike_documents_flagged"] == 0


def test_a_credential_counts_only_on_the_lines_its_value_occupies() -> None:
    text = "a=1\nkey: |\n  -----BEGIN X-----\n  QUJD\n  -----END X-----\nb=2\n"
    lines = _value_lines(text, "-----BEGIN X-----\n  QUJD\n  -----END X-----")
    assert list(lines) == [3, 4, 5]
    creds = [{"path": "c/1", "format": "x", "lines": lines}, {"path": "c/2", "format": "y", "lines": range(2, 3)}]
    found = {"c/1": {5}, "c/2": {1}, "pkg/a": {1, 9}, "look/b": {2}}
    result = score(found, creds, ["pkg/a", "pkg/b"], ["look/b"], benign_bytes=2_000_000)
    assert result["recall"] == 0.5 and result["formats_below_1"] == {"y": 0.0}
    assert result["benign_findings"] == 2 and result["benign_files_flagged"] == 1
    assert result["false_positives_per_10mb"] == 10.0 and result["lookalike_documents_flagged"] == 1
