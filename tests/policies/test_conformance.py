"""regorus (compiled VM and interpreter) against real OPA v1.20.2 on the same bundle.

The oracle is `opa-golib-python-bindings`, which embeds OPA's Go evaluator. It declares
Python >= 3.14 but runs on 3.11; install it with
`pip install --no-deps --ignore-requires-python opa-golib-python-bindings==0.4.4`.
"""

import itertools
import json

import pytest

from policies import PolicyEngine, run_rego_tests
from policies.backends import compile_bundle
from policies.bundle import SHIPPED_BUNDLE_DIR, load_bundle

opa_bindings = pytest.importorskip(
    "opa_bindings",
    reason="real-OPA oracle missing: pip install --no-deps --ignore-requires-python opa-golib-python-bindings==0.4.4",
)


def opa_engine(directory, *, with_tests=False):
    engine = opa_bindings.OpaEngine()
    for path in sorted(directory.glob("*.rego")):
        if with_tests or not path.name.endswith("_test.rego"):
            engine.add_policy(path.name, path.read_text())
    engine.add_data(json.loads(load_bundle(directory).data_json))
    return engine


def opa_eval(engine, ref, input):
    try:
        return engine.eval_document(ref, input)
    except opa_bindings.OpaUndefinedError:
        return None


def test_rego_suite_passes_on_real_opa():
    names = [r.name for r in run_rego_tests().results]
    engine = opa_engine(SHIPPED_BUNDLE_DIR, with_tests=True)
    failing = [n for n in names if opa_eval(engine, n.removeprefix("data."), None) is not True]
    assert len(names) >= 25 and not failing


def corpus():
    gates = [
        {"injection": i, "secret": s, "findings": f}
        for i, s, f in itertools.product(
            (0.0, 0.5, 0.85, 0.95), (0.0, 0.3, 0.5, 0.99),
            ([], [{"kind": "pii", "rule_id": "email", "layer": "regex", "score": 0.9}], [{"kind": "url", "rule_id": "u", "layer": "ml", "score": 0.4}]),
        )
    ]
    tenants = ["acme", "optin", "strict", "archive", "nobody"]
    tools = ["web.fetch", "search.internal", "browser.raw"]
    for tenant, tool, gate in itertools.product(tenants, tools, gates[::5]):
        yield "lethe.decision", {"tenant": tenant, "user": "u", "session": {"id": "s", "age_s": 3, "tokens": 131000 if gate["secret"] == 0.3 else 10},
                                 "tool": tool, "span": {"bytes": 10, "tokens": 40000 if gate["injection"] == 0.95 else 5}, "gate": gate}
        for state in ("live", "quarantined", "amortized", "archived"):
            yield "lethe.retention", {"tenant": tenant, "tool": tool, "state": state, "gate": gate}
    for tenant, user, public in itertools.product(tenants + ["", 7], ["bob", None, "", "a/b"], [True, False, None]):
        yield "lethe.tenancy", {"tenant": tenant, "user": user, "public_prefix": public}
    roles = [[], ["tenant_admin"], ["compliance"], ["viewer"], "admin"]
    for actor_t, target_t, user, owner, r, action in itertools.product(["acme", ""], ["acme", "globex"], ["bob", None], ["bob", None], roles, ["forget", "amortize"]):
        yield "lethe.erasure", {"actor": {"tenant": actor_t, "user": user, "roles": r},
                                "target": {"tenant": target_t, "session_id": "s", "session_owner": owner}, "action": action}
    for junk in ({}, {"tenant": "acme"}, {"gate": "high"}, {"tenant": "acme", "tool": "t", "gate": {"injection": -1, "secret": 2, "findings": {}}}):
        for ref in ("lethe.decision", "lethe.tenancy", "lethe.retention", "lethe.erasure"):
            yield ref, junk


def test_embedded_engines_agree_with_real_opa(make_bundle, test_tenants):
    bundle = make_bundle(tenants=test_tenants)
    oracle = opa_engine(bundle)
    embedded = PolicyEngine(bundle)  # the four documents run on regorus' compiled VM
    interpreter = compile_bundle(load_bundle(bundle))
    cases = list(corpus())
    assert len(cases) > 400
    mismatches = []
    for ref, i in cases:
        want = opa_eval(oracle, ref, i)
        try:
            vm = embedded.evaluate(ref.replace(".", "/"), i)
        except Exception:
            vm = None
        interpreter.set_input_json(json.dumps(i))
        interp = interpreter.eval_rule("data." + ref)
        if not (vm == interp == want):
            mismatches.append((ref, i, want, vm, interp))
    assert not mismatches, mismatches[:3]
