"""The shipped Rego tests pass on the embedded engine, and the runner reports failures as failures."""

from pathlib import Path

from policies import run_rego_tests


def test_shipped_rego_tests_all_pass_and_cover_the_four_policies():
    report = run_rego_tests()
    assert report.ok, report.format()
    assert len(report.results) >= 25
    files = {r.file for r in report.results}
    assert files == {"decision_test.rego", "tenancy_test.rego", "retention_test.rego", "erasure_test.rego"}
    text = report.format()
    assert text.splitlines()[-1] == f"PASS: {len(report.results)}/{len(report.results)}"
    assert "data.lethe.decision_test.test_secret_score_leads_to_redact_by_default: PASS" in text


def test_failing_and_erroring_tests_are_reported(make_bundle):
    bundle: Path = make_bundle()
    (bundle / "broken_test.rego").write_text(
        "package lethe.broken_test\n\nimport rego.v1\n\n"
        "test_wrong_action if {\n"
        '\td := data.lethe.decision with input as {"tenant": "t"}\n'
        '\td.action == "allow"\n}\n\n'
        "test_conflict if {\n\tx := {1: 2}\n\tx[_] == 2\n\ty := 1 / 0\n\ty == 1\n}\n"
    )
    report = run_rego_tests(bundle)
    assert not report.ok
    by_name = {r.name: r for r in report.results}
    wrong = by_name["data.lethe.broken_test.test_wrong_action"]
    assert not wrong.passed and wrong.error is None
    assert not by_name["data.lethe.broken_test.test_conflict"].passed
    assert report.failed == 2
    lines = report.format().splitlines()
    assert "data.lethe.broken_test.test_wrong_action: FAIL" in "\n".join(lines)
    assert lines[-2:] == [f"PASS: {report.passed}/{report.passed + 2}", f"FAIL: 2/{report.passed + 2}"]


def test_unparsable_test_file_is_an_error(make_bundle):
    bundle = make_bundle()
    (bundle / "syntax_test.rego").write_text("package x_test\n\ntest_a if {\n")
    report = run_rego_tests(bundle)
    assert not report.ok
    assert any(r.name == "load syntax_test.rego" and r.error for r in report.results)
