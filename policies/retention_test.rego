package lethe.retention_test

import rego.v1

tenants := {"acme": {"retention": {
	"classes": {"normal": 86400},
	"tools": {"search.internal": {"normal": 3600, "quarantined": 60}},
}}}

clean := {"injection": 0, "secret": 0, "findings": []}

keep(tenant, tool, state, gate) := r if {
	r := data.lethe.retention with input as {"tenant": tenant, "tool": tool, "state": state, "gate": gate}
		with data.lethe.tenants as tenants
}

test_normal_result_kept_30_days if {
	keep("nobody", "web.fetch", "live", clean) == {"data_class": "normal", "ttl_seconds": 2592000}
}

test_secret_kept_zero_seconds if {
	keep("nobody", "web.fetch", "live", {"injection": 0, "secret": 0.8, "findings": []}) == {"data_class": "secret", "ttl_seconds": 0}
}

test_secret_beats_quarantine if {
	finding := {"kind": "secret", "rule_id": "pem", "layer": "regex", "score": 1}
	keep("acme", "web.fetch", "quarantined", {"injection": 0.9, "secret": 0, "findings": [finding]}).data_class == "secret"
}

test_quarantined_kept_7_days if {
	keep("nobody", "web.fetch", "quarantined", clean) == {"data_class": "quarantined", "ttl_seconds": 604800}
}

test_amortized_class if {
	keep("nobody", "web.fetch", "amortized", clean).data_class == "amortized"
}

test_tenant_class_override if {
	keep("acme", "web.fetch", "live", clean).ttl_seconds == 86400
	keep("acme", "web.fetch", "quarantined", clean).ttl_seconds == 604800
}

test_tenant_tool_override_beats_class_override if {
	keep("acme", "search.internal", "live", clean).ttl_seconds == 3600
	keep("acme", "search.internal", "quarantined", clean).ttl_seconds == 60
}

test_null_ttl_means_keep if {
	r := data.lethe.retention with input as {"tenant": "archive", "tool": "t", "state": "live", "gate": clean}
		with data.lethe.tenants as {"archive": {"retention": {"classes": {"normal": null}}}}
	r == {"data_class": "normal", "ttl_seconds": null}
}

test_unknown_state_is_undefined if {
	not keep("acme", "web.fetch", "archived", clean)
}

test_missing_gate_is_undefined if {
	not data.lethe.retention with input as {"tenant": "acme", "tool": "t", "state": "live"}
}

# ---- kv_priority ---------------------------------------------------------------------------

seg(role, tool, state) := {"role": role, "tool": tool, "state": state, "n_tokens": 10}

kv(tenant, segments) := r if {
	r := data.lethe.kv_priority with input as {"tenant": tenant, "segments": segments}
		with data.lethe.tenants as {"acme": {"trusted_tools": ["search.internal"], "kv": {"offload_min_priority": 60}}}
}

test_kv_system_prompt_pinned_high if {
	kv("nobody", [seg("system", null, "live")]).segments == [{"priority": 90, "duration_s": null}]
}

test_kv_turns_high_while_recent_then_default if {
	r := kv("nobody", [seg("user", null, "live"), seg("assistant", null, "live"), seg("tool", "web.fetch", "live")])
	r.segments == [{"priority": 50, "duration_s": 600}, {"priority": 50, "duration_s": 600}, {"priority": 50, "duration_s": 600}]
	r.default_priority == 35
}

test_kv_quarantine_and_amortize_stubs_low if {
	r := kv("nobody", [seg("tool", "web.fetch", "quarantined"), seg("tool", "web.fetch", "amortized")])
	r.segments == [{"priority": 10, "duration_s": null}, {"priority": 10, "duration_s": null}]
}

test_kv_trusted_tool_result_pinned_for_an_hour if {
	kv("acme", [seg("tool", "search.internal", "live")]).segments == [{"priority": 80, "duration_s": 3600}]
	kv("nobody", [seg("tool", "search.internal", "live")]).segments == [{"priority": 50, "duration_s": 600}]
}

test_kv_offload_minimum_per_tenant if {
	kv("nobody", []).offload_min_priority == 30
	kv("acme", []) == {"default_priority": 35, "offload_min_priority": 60, "segments": []}
}

test_kv_malformed_segment_is_undefined if {
	not kv("nobody", [seg("tool", "t", "forgotten")])
	not kv("nobody", [{"tool": "t", "state": "live"}])
	not data.lethe.kv_priority with input as {"tenant": "acme"}
}
