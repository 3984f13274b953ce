"""Type hints that a checker verifies: mypy (with pydantic's plugin, `[tool.mypy]` in
pyproject.toml) finds nothing in the packages named here: all of the product, its training scripts
included (tests and deploy scripts are not checked)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("audit", "gate", "gateway", "kvkernel", "ledger", "policies")


def test_mypy_finds_nothing_in_the_checked_packages() -> None:
    run = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", *CHECKED], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
