"""`opa test` for the embedded engine: run every `test_*` rule of every `*_test.rego` in a directory.

Conventions follow OPA's: a test is a rule whose name starts with `test_`, in any package of a
`*_test.rego` file; it passes when it evaluates to true, fails when it is undefined or false,
and errors when evaluation raises. Tests see the directory's policies and `data/*.json`, so the
same files run unchanged under `opa test <dir>`. Rule heads are found at the start of a line, as
`opa fmt` writes them.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import regorus

from policies.backends import engine_error
from policies.bundle import SHIPPED_BUNDLE_DIR

_PACKAGE = re.compile(r"^package\s+([A-Za-z_][A-Za-z0-9_.]*)", re.MULTILINE)
_TEST_RULE = re.compile(r"^(test_[A-Za-z0-9_]*)\b", re.MULTILINE)


@dataclass(frozen=True)
class RegoTestResult:
    name: str  # e.g. data.lethe.decision_test.test_secret_score_leads_to_forget
    file: str
    passed: bool
    error: str | None  # None for a pass and for a plain failure (false or undefined)
    duration_s: float


@dataclass(frozen=True)
class RegoTestReport:
    directory: Path
    results: tuple[RegoTestResult, ...]

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed

    @property
    def ok(self) -> bool:
        return bool(self.results) and self.failed == 0

    def format(self) -> str:
        lines: list[str] = []
        current = None
        for r in self.results:
            if r.file != current:
                current = r.file
                lines.append(f"{r.file}:")
            status = "PASS" if r.passed else ("ERROR" if r.error else "FAIL")
            detail = f"\n  {r.error}" if r.error else ""
            lines.append(f"{r.name}: {status} ({r.duration_s * 1e6:.0f}µs){detail}")
        lines.append("-" * 80)
        total = len(self.results)
        lines.append(f"PASS: {self.passed}/{total}")
        if self.failed:
            lines.append(f"FAIL: {self.failed}/{total}")
        return "\n".join(lines)


def run_rego_tests(directory: Path | None = None) -> RegoTestReport:
    """Run the Rego tests in `directory` (default: the policies shipped with this package)."""
    root = Path(directory) if directory is not None else SHIPPED_BUNDLE_DIR
    engine = regorus.Engine()
    results: list[RegoTestResult] = []
    for path in sorted(root.glob("data/*.json")):
        try:
            engine.add_data_json(path.read_text(encoding="utf-8"))
        except Exception as exc:
            results.append(_load_error(path, root, exc))
    test_files = []
    for path in sorted(root.glob("*.rego")):
        source = path.read_text(encoding="utf-8")
        try:
            engine.add_policy(path.relative_to(root).as_posix(), source)
        except Exception as exc:
            results.append(_load_error(path, root, exc))
            continue
        if path.name.endswith("_test.rego"):
            test_files.append((path, source))
    if not any(r.error for r in results):
        for path, source in test_files:
            results.extend(_run_file(engine, root, path, source))
    return RegoTestReport(root, tuple(results))


def _run_file(engine: regorus.Engine, root: Path, path: Path, source: str) -> list[RegoTestResult]:
    package = _PACKAGE.search(source)
    rel = path.relative_to(root).as_posix()
    if package is None:
        return [RegoTestResult(f"load {rel}", rel, False, "no `package` line: a Rego file starts with one", 0.0)]
    names = dict.fromkeys(_TEST_RULE.findall(source))  # incremental definitions are one test
    results = []
    for name in names:
        ref = f"data.{package.group(1)}.{name}"
        start = time.perf_counter()
        try:
            value, error = engine.eval_rule(ref), None
        except Exception as exc:
            value, error = None, engine_error(exc)
        results.append(RegoTestResult(ref, rel, value is True, error, time.perf_counter() - start))
    return results


def _load_error(path: Path, root: Path, exc: Exception) -> RegoTestResult:
    rel = path.relative_to(root).as_posix()
    return RegoTestResult(f"load {rel}", rel, False, engine_error(exc), 0.0)
