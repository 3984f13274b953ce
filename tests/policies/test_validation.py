"""Policy data is validated on load and every tenant is probed: a bad reload is refused, the active bundle stays."""

from __future__ import annotations

import json

import pytest

from policies import PolicyEngine, PolicyError
from policies.bundle import SHIPPED_BUNDLE_DIR
from tests.policies.test_engine import decision_input

INJECTED = {"injection": 0.998, "secret": 0.0, "findings": []}


def _assert_refused_and_kept(engine: PolicyEngine, bad, *fragments: str) -> None:
    before = engine.bundle_hash
    with pytest.raises(PolicyError) as err:
        engine.reload(bad)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    assert engine.bundle_hash == before
    d = engine.decide(decision_input(gate=INJECTED))
    assert (d.action, d.bundle_hash) == ("quarantine", before)


@pytest.mark.parametrize(
    ("override", "field", "problem"),
    [
        ({"thresholds": {"injection": "0.8"}}, "data.lethe.tenants.acme.thresholds.injection", "'0.8' is not of type 'number'"),
        ({"blocked_tools": "shell.exec"}, "data.lethe.tenants.acme.blocked_tools", "is not of type 'array'"),
        ({"sensitive_kinds": "secret"}, "data.lethe.tenants.acme.sensitive_kinds", "is not of type 'array'"),
        ({"trusted_tools": [""]}, "data.lethe.tenants.acme.trusted_tools[0]", "should be non-empty"),
        ({"thresholds": {"secret": 1.5}}, "data.lethe.tenants.acme.thresholds.secret", "greater than or equal to the maximum"),
        ({"treshold": {"injection": 0.8}}, "data.lethe.tenants.acme", "'treshold' was unexpected"),
        ({"max_span_tokens": 1000.5}, "data.lethe.tenants.acme.max_span_tokens", "is not of type 'integer'"),
        ({"principal_channels": ["user", "email"]}, "data.lethe.tenants.acme.principal_channels[1]", "is not one of"),
        ({"retention": {"classes": {"normal": "30d"}}}, "data.lethe.tenants.acme.retention.classes.normal", "is not of type"),
        # red team #13 F8: each of these was accepted and turned a protection off
        ({"thresholds": {"injection": 1.0}}, "data.lethe.tenants.acme.thresholds.injection", "greater than or equal to the maximum"),
        ({"thresholds": {"injection_byte_gate": 1.0}}, "data.lethe.tenants.acme.thresholds.injection_byte_gate",
         "greater than or equal to the maximum"),
        ({"thresholds": {"secret": 1.0}}, "data.lethe.tenants.acme.thresholds.secret", "greater than or equal to the maximum"),
        ({"thresholds": {"secret": 0}}, "data.lethe.tenants.acme.thresholds.secret", "less than or equal to the minimum"),
        ({"sensitive_kinds": []}, "data.lethe.tenants.acme.sensitive_kinds", "should be non-empty"),
        ({"sensitive_kinds": ["nonsense"]}, "data.lethe.tenants.acme.sensitive_kinds[0]", "is not one of"),
        ({"retention": {"classes": {"secret": None}}}, "data.lethe.tenants.acme.retention.classes.secret", "is not of type"),
        ({"retention": {"classes": {"secret": 1e30}}}, "data.lethe.tenants.acme.retention.classes.secret", "greater than the maximum"),
        ({"retention": {"classes": {"normal": 315360001}}}, "data.lethe.tenants.acme.retention.classes.normal",
         "greater than the maximum"),
    ],
)
def test_wrongly_typed_tenant_setting_is_refused_naming_the_field(make_bundle, override, field, problem):
    engine = PolicyEngine(make_bundle())
    _assert_refused_and_kept(engine, make_bundle(tenants={"acme": override}), field + ":", problem, "tenants.json")


def test_a_duplicate_key_in_a_policy_file_is_refused_naming_the_key(make_bundle):
    """Red team #13 F8: a second "lethe" entry silently replaced the first (last wins)."""
    text = (SHIPPED_BUNDLE_DIR / "data" / "tenants.json").read_text()
    doubled = '{"lethe": {"tenants": {}}, ' + text.strip()[1:]
    bad = make_bundle(replace={"data/tenants.json": doubled})
    _assert_refused_and_kept(PolicyEngine(make_bundle()), bad, "tenants.json has the key 'lethe' twice")


def test_defaults_are_checked_with_every_key_required(make_bundle):
    defaults = json.loads((SHIPPED_BUNDLE_DIR / "data" / "defaults.json").read_text())
    del defaults["lethe"]["defaults"]["blocked_tools"]
    bad = make_bundle(replace={"data/defaults.json": json.dumps(defaults)})
    _assert_refused_and_kept(PolicyEngine(make_bundle()), bad, "data.lethe.defaults:", "'blocked_tools' is a required property", "defaults.json")


def test_quoted_threshold_no_longer_allows_an_injection(make_bundle):
    """The issue's reproduction: on the old code this reload succeeded and 0.998 became `allow`."""
    with pytest.raises(PolicyError, match=r"thresholds\.injection"):
        PolicyEngine(make_bundle(tenants={"acme": {"thresholds": {"injection": "0.8"}}}))


def test_a_tenant_that_would_not_quarantine_a_known_injection_is_refused(make_bundle):
    engine = PolicyEngine(make_bundle())
    bad = make_bundle(tenants={"acme": {}, "lax": {"principal_channels": ["tool", "user", "system", "developer"]}})
    _assert_refused_and_kept(engine, bad, "tenant 'lax'", "a known injection gives 'allow'", "must be quarantine")


def test_a_policy_that_keeps_secrets_is_refused(make_bundle):
    rego = (SHIPPED_BUNDLE_DIR / "decision.rego").read_text().replace('else := "redact"', 'else := "allow"')
    engine = PolicyEngine(make_bundle())
    _assert_refused_and_kept(engine, make_bundle(replace={"decision.rego": rego}), "a known secret gives 'allow'",
                             "must be forget or redact")


def test_a_policy_that_ignores_quarantined_hashes_is_refused(make_bundle):
    shipped = (SHIPPED_BUNDLE_DIR / "decision.rego").read_text()
    ignored = 'quarantined_list := object.get(object.get(input, "session", {}), "quarantined_hashes", [])'
    assert ignored in shipped  # the rule this test breaks is still spelt so
    rego = shipped.replace(ignored, "quarantined_list := []")
    engine = PolicyEngine(make_bundle())
    _assert_refused_and_kept(engine, make_bundle(replace={"decision.rego": rego}),
                             "a quarantined result re-sent as user text gives 'allow'")


def test_explicit_double_opt_ins_are_accepted(make_bundle):
    tenants = {
        "review": {"admit_sensitive": True, "sensitive_action": "allow"},
        "optin": {"amortize_opt_in": True, "sensitive_action": "amortize"},
        "half": {"sensitive_action": "allow"},  # one switch only: still redacts, still accepted
    }
    engine = PolicyEngine(make_bundle(tenants=tenants))
    secret = {"injection": 0.0, "secret": 0.99, "findings": []}
    assert engine.decide(decision_input(gate=secret, tenant="review")).action == "allow"
    assert engine.decide(decision_input(gate=secret, tenant="half")).action == "redact"


def test_shipped_bundle_passes_validation_and_probes():
    assert PolicyEngine().bundle_hash
