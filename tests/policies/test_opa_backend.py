"""The opa backend against the loopback OPA stand-in (conftest.OpaStandin): same answers, fail closed."""

import time

import pytest
from opa_client import OpaClient

from gateway.wiring import free_ports
from policies import PolicyEngine, PolicyError

GATES = [
    {"injection": 0.93, "secret": 0.0, "findings": []},
    {"injection": 0.85, "secret": 0.0, "findings": []},
    {"injection": 0.1, "secret": 0.97, "findings": []},
    {"injection": 0.1, "secret": 0.0, "findings": [{"kind": "pii", "rule_id": "email", "layer": "regex", "score": 1}]},
    {"injection": 0.0, "secret": 0.0, "findings": []},
]


def decision_input(tenant, tool, gate):
    return {"tenant": tenant, "user": "u", "session": {"id": "s", "age_s": 1, "tokens": 10},
            "tool": tool, "span": {"bytes": 10, "tokens": 5}, "gate": gate}


def test_opa_backend_agrees_with_embedded(opa_standin):
    opa = PolicyEngine(opa_standin.bundle_dir, backend="opa", opa_url=opa_standin.url)
    embedded = PolicyEngine(opa_standin.bundle_dir)
    assert opa.bundle_hash == embedded.bundle_hash
    for tenant in ("acme", "optin", "strict", "nobody"):
        for tool in ("web.fetch", "search.internal", "browser.raw"):
            for gate in GATES:
                i = decision_input(tenant, tool, gate)
                assert opa.decide(i) == embedded.decide(i), i
        t = {"tenant": tenant, "user": "bob", "public_prefix": True}
        assert opa.tenancy(t) == embedded.tenancy(t)
    r = {"tenant": "acme", "tool": "search.internal", "state": "live", "gate": GATES[4]}
    assert opa.retention(r) == embedded.retention(r) and opa.retention(r).ttl_seconds == 3600
    e = {"actor": {"tenant": "acme", "user": "bob", "roles": []}, "target": {"tenant": "acme", "session_id": "s", "session_owner": "al"}, "action": "forget"}
    assert opa.erasure_allowed(e) == embedded.erasure_allowed(e)
    assert opa_standin.queries >= 60


def test_opa_undefined_and_malformed_fail_closed(opa_standin):
    opa = PolicyEngine(opa_standin.bundle_dir, backend="opa", opa_url=opa_standin.url)
    with pytest.raises(PolicyError, match="undefined"):
        opa.tenancy({"tenant": "acme", "user": None, "public_prefix": False})
    client = OpaClient(host="127.0.0.1", port=int(opa_standin.url.rsplit(":", 1)[1]))
    assert client.update_policy_from_string(
        'package lethe\n\nimport rego.v1\n\nbogus := {"action": "launch", "reasons": ["x"]}\n', "bogus.rego")
    with pytest.raises(PolicyError, match="undefined"):
        opa.evaluate("lethe/nothing_here", {})
    assert opa.evaluate("lethe/bogus", {}) == {"action": "launch", "reasons": ["x"]}


def test_policy_and_data_upload_semantics(opa_standin):
    client = OpaClient(host="127.0.0.1", port=int(opa_standin.url.rsplit(":", 1)[1]))
    opa = PolicyEngine(opa_standin.bundle_dir, backend="opa", opa_url=opa_standin.url)
    gate = {"injection": 0.6, "secret": 0.0, "findings": []}
    assert opa.decide(decision_input("acme", "web.fetch", gate)).action == "allow"  # acme: 0.8
    assert client.update_or_create_data({"acme": {"thresholds": {"injection": 0.5}}}, "lethe/tenants")
    assert opa.decide(decision_input("acme", "web.fetch", gate)).action == "quarantine"
    with pytest.raises(Exception):
        client.update_policy_from_string("package lethe\n\ndecision := {\n", "broken.rego", rego_compat=False)
    assert "broken.rego" not in client.get_policies_list()
    assert opa.decide(decision_input("acme", "web.fetch", gate)).action == "quarantine"


def test_opa_timeout_fails_closed_within_budget(opa_standin):
    opa_standin.delay_s = 1.0
    opa = PolicyEngine(opa_standin.bundle_dir, backend="opa", opa_url=opa_standin.url, timeout_s=0.2, retries=0)
    start = time.monotonic()
    d = opa.decide(decision_input("acme", "web.fetch", GATES[4]))
    assert time.monotonic() - start < 0.9
    assert d.action == "quarantine" and "timed out after 0.2s" in d.reasons[0] and d.reasons[0].startswith("policy-error: ")
    assert opa.retention({"tenant": "acme", "tool": "t", "state": "live", "gate": GATES[4]}).ttl_seconds == 0.0
    assert not opa.erasure_allowed({"actor": {}, "target": {}, "action": "forget"}).allowed


def test_opa_server_error_fails_closed(opa_standin):
    opa_standin.fail_status = 500
    opa = PolicyEngine(opa_standin.bundle_dir, backend="opa", opa_url=opa_standin.url, retries=1)
    d = opa.decide(decision_input("acme", "web.fetch", GATES[4]))
    assert d.action == "quarantine" and "HTTP 500" in d.reasons[0] and "injected fault" in d.reasons[0]
    assert opa_standin.queries == 1  # urllib3 never retries a POST on a 5xx answer


def test_opa_unreachable_fails_closed(make_bundle):
    opa = PolicyEngine(make_bundle(), backend="opa", opa_url=f"http://127.0.0.1:{free_ports(1)[0]}", retries=1)
    d = opa.decide(decision_input("acme", "web.fetch", GATES[4]))
    assert d.action == "quarantine" and "unreachable" in d.reasons[0]
    with pytest.raises(PolicyError, match="unreachable"):
        opa.tenancy({"tenant": "acme", "user": "u", "public_prefix": False})
    e = opa.erasure_allowed({"actor": {}, "target": {}, "action": "forget"})
    assert not e.allowed and e.reasons[0].startswith("policy-error: opa at")
