"""PolicyEngine on the embedded backend: answers, fail-closed paths, bundle identity, atomic reload."""

import threading

import pytest

from policies import Decision, PolicyEngine, PolicyError, Tenancy, derive_salt
from policies.bundle import SHIPPED_BUNDLE_DIR

CLEAN = {"injection": 0.05, "secret": 0.0, "findings": []}


def decision_input(tool="web.fetch", gate=CLEAN, tenant="acme"):
    return {
        "tenant": tenant, "user": "alice", "session": {"id": "s1", "age_s": 5.0, "tokens": 900},
        "tool": tool, "span": {"bytes": 400, "tokens": 100}, "gate": gate,
    }


# A decision policy that misbehaves on purpose for chosen tools, valid for every other input
# (so the bundle passes the activation probes and the failure shows up at request time).
FAULTY_DECISION = """package lethe

import rego.v1

decision := {"action": "allow", "reasons": ["test_allow: ok"]} if {
	not input.tool in {"ghost", "conflict", "bogus", "noreasons", "string", "div", "nokinds", "nontext"}
	not input.user == "probe"
}

decision := {"action": "quarantine", "reasons": ["probe"]} if {
	input.user == "probe"
	input.gate.secret < 1
}

decision := {"action": "forget", "reasons": ["probe"]} if {
	input.user == "probe"
	input.gate.secret == 1
}

decision := {"action": "allow", "reasons": ["a"]} if input.tool == "conflict"

decision := {"action": "forget", "reasons": ["b"]} if input.tool == "conflict"

decision := {"action": "delete-everything", "reasons": ["x"]} if input.tool == "bogus"

decision := {"action": "allow"} if input.tool == "noreasons"

decision := "allow" if input.tool == "string"

decision := {"action": "redact", "reasons": ["r"]} if input.tool == "nokinds"

decision := {"action": "allow", "reasons": ["r"], "non_text": "maybe"} if input.tool == "nontext"

decision := {"action": "allow", "reasons": [sprintf("%v", [1 / input.span.bytes])]} if input.tool == "div"
"""


@pytest.fixture(scope="module")
def engine():
    return PolicyEngine()


def test_shipped_bundle_answers_the_four_questions(engine):
    d = engine.decide(decision_input(gate={"injection": 0.98, "secret": 0.0, "findings": []}))
    assert d == Decision("quarantine", ("injection_threshold: injection 0.98 >= 0.76",), engine.bundle_hash)
    assert d.to_dict() == {"action": "quarantine", "reasons": ["injection_threshold: injection 0.98 >= 0.76"], "bundle_hash": engine.bundle_hash}
    redacted = engine.decide(decision_input(gate={"injection": 0.1, "secret": 0.99, "findings": []}))
    assert (redacted.action, redacted.redact_kinds) == ("redact", ("credential", "pii", "secret"))
    assert redacted.to_dict()["redact_kinds"] == ["credential", "pii", "secret"]
    assert engine.decide(decision_input()).reasons == ("default_allow: no rule fired",)
    t = engine.tenancy({"tenant": "acme", "user": "bob", "public_prefix": False})
    assert t == Tenancy("tenant_user", '["acme","bob"]', 0, engine.bundle_hash)
    r = engine.retention({"tenant": "acme", "tool": "x", "state": "quarantined", "gate": CLEAN})
    assert (r.data_class, r.ttl_seconds) == ("quarantined", 604800.0)
    e = engine.erasure_allowed({
        "actor": {"tenant": "acme", "user": "eve", "roles": ["tenant_admin"]},
        "target": {"tenant": "globex", "session_id": "s9", "session_owner": "bob"}, "action": "forget",
    })
    assert not e.allowed and e.reasons == ("cross_tenant: actor of tenant acme may not erase in tenant globex",)
    assert engine.evaluate("lethe/decision", decision_input()) == {"action": "allow", "reasons": ["default_allow: no rule fired"]}


def test_ad_hoc_rule_paths_run_on_the_interpreter(engine):
    assert engine.evaluate("lethe/tenant_settings", {"tenant": "nobody"})["thresholds"]["injection"] == 0.76
    with pytest.raises(PolicyError, match="must look like"):
        engine.evaluate("lethe/../etc", {})


def test_derive_salt_is_keyed_scoped_and_rotates():
    t = Tenancy("tenant_user", '["acme","bob"]', 0, "h")
    salt = derive_salt(b"k" * 32, t)
    assert len(salt) == 64 and salt == derive_salt(b"k" * 32, t)
    assert salt != derive_salt(b"j" * 32, t)
    assert salt != derive_salt(b"k" * 32, Tenancy("tenant_user", '["acme","eve"]', 0, "h"))
    assert salt != derive_salt(b"k" * 32, Tenancy("tenant_user", '["acme","bob"]', 1, "h"))
    with pytest.raises(ValueError, match="empty"):
        derive_salt(b"", t)


@pytest.mark.parametrize(
    ("tool", "reason"),
    [
        ("ghost", "policy-error: data.lethe.decision is undefined for this input"),
        ("conflict", "policy-error: engine error evaluating data.lethe.decision: "),
        ("div", "policy-error: engine error evaluating data.lethe.decision: "),
        ("bogus", "policy-error: malformed data.lethe.decision: unknown action 'delete-everything'"),
        ("noreasons", "policy-error: malformed data.lethe.decision: reasons must be a non-empty list of strings, got None"),
        ("string", "policy-error: data.lethe.decision is str, not an object"),
        ("nokinds", "policy-error: malformed data.lethe.decision: redact needs redact_kinds"),
        ("nontext", "policy-error: malformed data.lethe.decision: non_text must be 'pass' or 'withhold'"),
    ],
)
def test_decision_fails_closed(make_bundle, tool, reason):
    engine = PolicyEngine(make_bundle(replace={"decision.rego": FAULTY_DECISION}))
    assert engine.decide(decision_input(tool="fine")).action == "allow"
    gate = {"injection": 0.0, "secret": 0.0, "findings": []}
    d = engine.decide({**decision_input(tool=tool, gate=gate), "span": {"bytes": 0, "tokens": 1}})
    assert d.action == "quarantine"
    assert len(d.reasons) == 1 and d.reasons[0].startswith(reason), d.reasons
    assert d.bundle_hash == engine.bundle_hash
    if "malformed" not in reason:  # evaluate() returns raw objects; only decide() vets their shape
        with pytest.raises(PolicyError):
            engine.evaluate("lethe/decision", {**decision_input(tool=tool), "span": {"bytes": 0, "tokens": 1}})


def test_input_that_is_not_json_fails_closed(engine):
    d = engine.decide({**decision_input(), "gate": {"injection": float("nan"), "secret": 0, "findings": []}})
    assert d.action == "quarantine" and d.reasons[0].startswith("policy-error: policy input is not JSON")
    assert engine.decide({"tool": object()}).action == "quarantine"
    assert engine.decide("not even a dict").action == "quarantine"


def test_other_documents_fail_closed(make_bundle):
    broken = make_bundle(replace={"extra.rego": "package lethe\n\nimport rego.v1\n\nerasure := {\"allow\": \"yes\", \"reasons\": [\"x\"]} if input.action == \"weird\"\n"})
    engine = PolicyEngine(broken)
    with pytest.raises(PolicyError, match="undefined"):
        engine.tenancy({"tenant": "acme", "user": None, "public_prefix": False})
    with pytest.raises(PolicyError):
        engine.tenancy({"tenant": 5})
    r = engine.retention({"tenant": "acme", "tool": "x", "state": "archived", "gate": CLEAN})
    assert (r.data_class, r.ttl_seconds, r.bundle_hash) == ("policy-error", 0.0, engine.bundle_hash)
    e = engine.erasure_allowed({
        "actor": {"tenant": "a", "user": "u", "roles": []},
        "target": {"tenant": "a", "session_id": "s", "session_owner": "u"}, "action": "weird",
    })
    assert not e.allowed and e.reasons[0].startswith("policy-error: "), e.reasons


def test_bundle_hash_follows_content_not_location_or_tests(make_bundle):
    shipped = PolicyEngine().bundle_hash
    copy = make_bundle()
    assert PolicyEngine(copy).bundle_hash == shipped
    (copy / "decision_test.rego").write_text("package lethe.x_test\n")
    assert PolicyEngine(copy).bundle_hash == shipped
    changed = make_bundle(tenants={"acme": {"thresholds": {"injection": 0.7}}})
    assert PolicyEngine(changed).bundle_hash != shipped
    added = make_bundle(replace={"extra.rego": "package lethe.extra\n"})
    assert PolicyEngine(added).bundle_hash not in (shipped, PolicyEngine(changed).bundle_hash)


@pytest.mark.parametrize(
    ("rel", "text", "message"),
    [
        ("decision.rego", "package lethe\n\ndecision := {\n", "does not"),
        ("data/tenants.json", "{not json", "is not valid JSON"),
        ("data/tenants.json", "[1, 2]", "must hold a JSON object"),
        ("data/extra.json", '{"lethe": {"public": {"epoch": 9}}}', "another data file already sets"),
        ("decision.rego", "package lethe\n\nimport rego.v1\n\ndecision := {\"action\": \"allow\", \"reasons\": [\"x\"]} if false\n", "undefined"),
        ("decision.rego", "package lethe\n\nimport rego.v1\n\ndecision := {\"action\": \"maybe\", \"reasons\": [\"x\"]}\n", "unknown action"),
    ],
)
def test_bad_bundle_is_refused_and_old_bundle_stays(make_bundle, rel, text, message):
    engine = PolicyEngine(make_bundle())
    before = engine.bundle_hash
    bad = make_bundle(replace={rel: text})
    with pytest.raises(PolicyError, match=message):
        engine.reload(bad)
    assert engine.bundle_hash == before
    d = engine.decide(decision_input(gate={"injection": 0.98, "secret": 0, "findings": []}))
    assert (d.action, d.bundle_hash) == ("quarantine", before)
    with pytest.raises(PolicyError):
        PolicyEngine(bad)


def test_reload_rereads_the_active_directory(make_bundle):
    bundle = make_bundle()
    engine = PolicyEngine(bundle)
    old = engine.bundle_hash
    gate = {"injection": 0.98, "secret": 0, "findings": []}
    assert engine.decide(decision_input(gate=gate)).action == "quarantine"
    (bundle / "data" / "tenants.json").write_text('{"lethe": {"tenants": {"acme": {"thresholds": {"injection": 0.99}}}}}')
    new = engine.reload()
    assert new != old and engine.bundle_hash == new and engine.bundle_dir == bundle.resolve()
    d = engine.decide(decision_input(gate=gate))
    assert (d.action, d.bundle_hash) == ("allow", new)


def test_reload_is_atomic_under_concurrent_decisions(make_bundle):
    strict = make_bundle()
    lenient = make_bundle(tenants={"acme": {"thresholds": {"injection": 0.99}}})
    engine = PolicyEngine(strict)
    strict_hash = engine.bundle_hash
    lenient_hash = PolicyEngine(lenient).bundle_hash
    expected = {strict_hash: "quarantine", lenient_hash: "allow"}
    gate = {"injection": 0.98, "secret": 0, "findings": []}
    stop = threading.Event()
    seen: list[tuple[str, str]] = []
    errors: list[BaseException] = []

    def worker():
        try:
            while not stop.is_set():
                d = engine.decide(decision_input(gate=gate))
                seen.append((d.bundle_hash, d.action))
        except BaseException as exc:  # noqa: BLE001 - any exception fails the test
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for i in range(16):
            assert engine.reload(lenient if i % 2 == 0 else strict) == (lenient_hash if i % 2 == 0 else strict_hash)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert len(seen) > 100
    bad = [(h, a) for h, a in seen if expected.get(h) != a]
    assert not bad, bad[:5]
    assert {h for h, _ in seen} == {strict_hash, lenient_hash}


def test_unknown_backend_and_bad_opa_url_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        PolicyEngine(backend="wasm")
    with pytest.raises(ValueError, match="must look like"):
        PolicyEngine(backend="opa", opa_url="127.0.0.1:8181/v1")
    with pytest.raises(PolicyError, match="not found"):
        PolicyEngine(SHIPPED_BUNDLE_DIR / "missing")


@pytest.mark.parametrize("extra", [{}, {"content_sha256": "a" * 64},
                                   {"content_sha256": "a" * 64, "content_norm_sha256": "b" * 64,
                                    "session": {"id": "s", "age_s": 0, "tokens": 0, "quarantined_hashes": ["b" * 64]}},
                                   {"tool": {"name": "x", "claimed_name": "X-Y", "verified": False, "source": "client",
                                             "folded": ["x_y"]}}],
                         ids=["mcp-no-hashes", "exact-hash", "normalised-hash", "folded-tool"])
def test_the_compiled_vm_defines_the_decision_the_interpreter_defines(extra):
    """The VM answers undefined where the interpreter answers (regorus' VM and an `else` chain
    that ends undefined): the engine then falls back and logs, but a conflict the VM would have
    reported is lost. Every shipped input shape must be answered by the VM itself."""
    from policies.backends import compile_vm, dumps_input
    from policies.bundle import load_bundle

    compiled = compile_vm(load_bundle(SHIPPED_BUNDLE_DIR))
    base = {"tenant": "acme", "user": None, "channel": "mcp", "upstream": "fx", "phase": "result",
            "tool": {"name": "fx__weather", "claimed_name": "fx__weather", "verified": True, "source": "mcp"},
            "session": {"id": "none", "age_s": 0, "tokens": 0}, "span": {"bytes": 10, "tokens": 3},
            "gate": {"injection": 0.0, "secret": 0.0, "findings": []}}
    compiled.vm.set_input_json(dumps_input({**base, **extra}))
    assert compiled.vm.execute_entry_point("data.lethe.decision") != '"<undefined>"'
