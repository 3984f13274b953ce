package lethe.decision_test

import rego.v1

tenants := {
	"acme": {
		"thresholds": {"injection": 0.8},
		"trusted_tools": ["search.internal", "shell.exec"],
		"blocked_tools": ["browser.raw"],
	},
	"strict": {"thresholds": {"injection": 0.2, "secret": 0.1}},
	"optin": {"amortize_opt_in": true, "sensitive_action": "amortize"},
	"half": {"sensitive_action": "amortize"},
	"review": {"admit_sensitive": true, "sensitive_action": "allow"},
	"halfreview": {"sensitive_action": "allow"},
	"forgetful": {"sensitive_action": "forget"},
	"agents": {"mcp": {"trusted_tools": ["docs/search"], "blocked_tools": ["shell/exec"], "non_text": "pass"}},
}

defaults := object.union(data.lethe.defaults, {"blocked_tools": ["shell.exec"]})

clean := {"injection": 0.05, "secret": 0.01, "findings": []}

req(tenant, tool, gate) := {
	"tenant": tenant,
	"user": "alice",
	"session": {"id": "s1", "age_s": 12.5, "tokens": 1000},
	"tool": tool,
	"span": {"bytes": 800, "tokens": 200},
	"gate": gate,
}

decide(i) := d if {
	d := data.lethe.decision with input as i
		with data.lethe.tenants as tenants
		with data.lethe.defaults as defaults
}

test_clean_result_is_allowed if {
	decide(req("acme", "web.fetch", clean)) == {"action": "allow", "reasons": ["default_allow: no rule fired"]}
}

test_injection_over_default_threshold_quarantines if {
	d := decide(req("nobody", "web.fetch", {"injection": 0.98, "secret": 0, "findings": []}))
	d.action == "quarantine"
	d.reasons == ["injection_threshold: injection 0.98 >= 0.76"]
}

test_byte_gate_scores_use_the_byte_gate_threshold if {
	gate := {"injection": 0.6, "secret": 0, "findings": [], "scorer": "byte_gate"}
	d := decide(req("nobody", "web.fetch", gate))
	d.reasons == ["injection_threshold: injection 0.60 >= 0.50"]
	decide(req("nobody", "web.fetch", object.union(gate, {"scorer": "stack"}))).action == "allow"
}

test_tenant_threshold_override_quarantines_what_default_allows if {
	gate := {"injection": 0.3, "secret": 0, "findings": []}
	decide(req("nobody", "web.fetch", gate)).action == "allow"
	decide(req("strict", "web.fetch", gate)).action == "quarantine"
}

test_stricter_tenant_quarantines_low_scores if {
	d := decide(req("strict", "web.fetch", {"injection": 0.25, "secret": 0, "findings": []}))
	d.reasons == ["injection_threshold: injection 0.25 >= 0.20"]
}

# A tool identity the gateway verified: its own model called `name` under the result's call id.
issued(name) := {"name": name, "claimed_name": name, "verified": true, "source": "gateway"}

test_trusted_tool_uses_trusted_threshold if {
	d := decide(req("acme", issued("search.internal"), {"injection": 0.85, "secret": 0, "findings": []}))
	d.action == "allow"
	e := decide(req("acme", issued("search.internal"), {"injection": 0.999, "secret": 0, "findings": []}))
	e.reasons == ["injection_threshold: injection 1.00 >= 0.99 (trusted tool search.internal)"]
}

test_trust_is_per_tenant if {
	decide(req("nobody", issued("search.internal"), {"injection": 0.98, "secret": 0, "findings": []})).action == "quarantine"
}

test_a_claimed_tool_name_never_gets_trusted_treatment if {
	gate := {"injection": 0.85, "secret": 0, "findings": []}
	reason := "injection_threshold: injection 0.85 >= 0.80 (tool name search.internal is unverified: trust not applied)"
	decide(req("acme", "search.internal", gate)).reasons == [reason] # a bare name is a claim
	forged := {"name": "search.internal", "claimed_name": "search.internal", "verified": false, "source": "client"}
	decide(req("acme", forged, gate)).reasons == [reason]
	renamed := {"name": "web.fetch", "claimed_name": "search.internal", "verified": false, "source": "gateway"}
	decide(req("acme", renamed, gate)).reasons == [reason]
	asserted := {"name": "search.internal", "claimed_name": "search.internal", "verified": true, "source": "client"}
	decide(req("acme", asserted, gate)).action == "quarantine" # verified needs a server-side source
}

test_blocked_tools_apply_to_the_recorded_and_the_claimed_name if {
	recorded := {"name": "browser.raw", "claimed_name": "web.fetch", "verified": false, "source": "gateway"}
	decide(req("acme", recorded, clean)).reasons == ["blocked_tool: tool browser.raw is blocked for tenant acme"]
	claimed := {"name": "web.fetch", "claimed_name": "browser.raw", "verified": false, "source": "gateway"}
	decide(req("acme", claimed, clean)).reasons == ["blocked_tool: tool browser.raw is blocked for tenant acme"]
}

test_a_blocked_tool_is_blocked_under_any_spelling_of_its_name if {
	reason := "blocked_tool: tool %s is blocked for tenant acme"
	every name in ["BROWSER.RAW", " browser.raw\n", "browser-raw", "browser_raw", "browserraw", "functions.browser.raw"] {
		decide(req("acme", name, clean)).reasons == [sprintf(reason, [name])]
	}
	joined := {"name": "web.fetch,browser.raw", "claimed_name": "web.fetch,browser.raw", "verified": false, "source": "gateway"}
	decide(req("acme", joined, clean)).reasons == [sprintf(reason, ["browser.raw"])]
	folded := {"name": "bro\u200bwser.raw", "claimed_name": "bro\u200bwser.raw", "verified": false, "source": "client", "folded": ["browser.raw"]}
	decide(req("acme", folded, clean)).reasons == [sprintf(reason, ["browser.raw"])]
	decide(req("acme", "browser.rawer", clean)).action == "allow"
}

test_trust_stays_exact_when_blocking_does_not if {
	decide(req("acme", issued("SEARCH.INTERNAL"), {"injection": 0.85, "secret": 0, "findings": []})).action == "quarantine"
}

test_malformed_tool_identity_is_invalid if {
	reason := "input_invalid: tool must be a non-empty string or {name: non-empty string, claimed_name: string or null, verified: boolean, source: gateway, mcp or client} (null allowed on user, assistant, system, developer)"
	every tool in [
		{"name": "x", "claimed_name": null, "verified": "yes", "source": "gateway"},
		{"name": "x", "claimed_name": null, "verified": true, "source": "me"},
		{"name": "", "claimed_name": null, "verified": true, "source": "gateway"},
		{"name": "x", "claimed_name": 3, "verified": true, "source": "gateway"},
	] {
		decide(req("acme", tool, clean)).reasons == [reason]
	}
	decide(req("acme", {"name": "x", "verified": false, "source": "client"}, clean)).action == "allow"
}

test_tenant_blocked_tool_quarantines if {
	d := decide(req("acme", "browser.raw", clean))
	d == {"action": "quarantine", "reasons": ["blocked_tool: tool browser.raw is blocked for tenant acme"]}
}

test_tenant_cannot_trust_a_globally_blocked_tool if {
	d := decide(req("acme", "shell.exec", clean))
	d.reasons == ["blocked_tool: tool shell.exec is blocked for tenant acme"]
}

test_secret_score_leads_to_redact_by_default if {
	d := decide(req("acme", "web.fetch", {"injection": 0.1, "secret": 0.97, "findings": []}))
	d == {"action": "redact", "reasons": ["secret_threshold: secret 0.97 >= 0.50"], "redact_kinds": ["credential", "pii", "secret"]}
}

test_sensitive_finding_leads_to_redact_by_default if {
	finding := {"kind": "credential", "rule_id": "aws-access-key", "layer": "regex", "score": 1}
	d := decide(req("acme", "web.fetch", {"injection": 0.1, "secret": 0.2, "findings": [finding]}))
	d.action == "redact"
	d.reasons == ["sensitive_finding: credential finding aws-access-key (layer regex)"]
}

test_redact_kinds_follow_the_tenants_sensitive_kinds if {
	d := data.lethe.decision with input as req("t", "web.fetch", {"injection": 0, "secret": 0.9, "findings": []})
		with data.lethe.tenants as {"t": {"sensitive_kinds": ["secret"]}}
		with data.lethe.defaults as defaults
	d.redact_kinds == ["secret"]
}

test_forget_stays_available_by_tenant_policy if {
	d := decide(req("forgetful", "web.fetch", {"injection": 0.1, "secret": 0.97, "findings": []}))
	d == {"action": "forget", "reasons": ["secret_threshold: secret 0.97 >= 0.50"]}
}

test_only_redact_carries_redact_kinds if {
	not decide(req("acme", "web.fetch", clean)).redact_kinds
	not decide(req("forgetful", "web.fetch", {"injection": 0.1, "secret": 0.97, "findings": []})).redact_kinds
}

# The MCP proxy names the tool from the route it took: verified, source "mcp".
mcp_req(tenant, tool, gate) := object.union(req(tenant, {"name": tool, "claimed_name": tool, "verified": true, "source": "mcp"}, gate), {"channel": "mcp", "upstream": "docs", "phase": "result"})

test_mcp_trusted_tool_uses_trusted_threshold_on_channel_mcp_only if {
	gate := {"injection": 0.98, "secret": 0, "findings": []}
	decide(mcp_req("agents", "docs/search", gate)).action == "allow"
	decide(req("agents", "docs/search", gate)).action == "quarantine"
}

test_chat_trust_does_not_carry_over_to_mcp if {
	decide(mcp_req("acme", "search.internal", {"injection": 0.85, "secret": 0, "findings": []})).action == "quarantine"
}

test_mcp_blocked_tool_quarantines if {
	d := decide(mcp_req("agents", "shell/exec", clean))
	d.reasons == ["blocked_tool: tool shell/exec is blocked for tenant agents"]
}

test_non_text_is_withheld_by_default_and_passed_by_tenant_policy if {
	decide(mcp_req("acme", "web/fetch", clean)).non_text == "withhold"
	decide(mcp_req("agents", "web/fetch", clean)).non_text == "pass"
	not decide(req("agents", "web/fetch", clean)).non_text
}

test_amortize_only_with_explicit_opt_in if {
	gate := {"injection": 0.1, "secret": 0.9, "findings": []}
	decide(req("optin", "web.fetch", gate)).action == "amortize"
	decide(req("acme", "web.fetch", gate)).action == "redact"
}

test_admit_sensitive_only_with_both_switches if {
	gate := {"injection": 0.1, "secret": 0.9, "findings": []}
	d := decide(req("review", "read_file", gate))
	d.action == "allow"
	d.reasons == ["secret_threshold: secret 0.90 >= 0.50"]
	decide(req("halfreview", "read_file", gate)).action == "redact"
}

test_admitted_secret_still_quarantined_when_injected if {
	decide(req("review", "read_file", {"injection": 0.98, "secret": 0.9, "findings": []})).action == "quarantine"
}

test_sensitive_action_without_opt_in_flag_still_redacts if {
	decide(req("half", "web.fetch", {"injection": 0.1, "secret": 0.9, "findings": []})).action == "redact"
}

test_injection_outranks_secret_and_all_reasons_are_kept if {
	d := decide(req("acme", "web.fetch", {"injection": 0.99, "secret": 0.99, "findings": []}))
	d.action == "quarantine"
	d.reasons == ["injection_threshold: injection 0.99 >= 0.80", "secret_threshold: secret 0.99 >= 0.50"]
}

test_oversized_span_quarantines if {
	i := object.union(req("acme", "web.fetch", clean), {"span": {"bytes": 1, "tokens": 40000}})
	decide(i).reasons == ["span_limit: span 40000 tokens > 32768"]
}

test_session_budget_quarantines if {
	i := object.union(req("acme", "web.fetch", clean), {"session": {"id": "s1", "age_s": 1, "tokens": 131000}})
	decide(i).reasons == ["session_budget: session 131000 + span 200 tokens > 131072"]
}

test_malformed_input_quarantines if {
	d := decide({"tenant": "acme", "tool": "web.fetch", "gate": {"injection": "high"}})
	d.action == "quarantine"
	"input_invalid: gate.injection must be a number in [0, 1]" in d.reasons
	"input_invalid: span.tokens must be a number" in d.reasons
}

test_score_out_of_range_quarantines if {
	d := decide(req("acme", "web.fetch", {"injection": 1.5, "secret": 0, "findings": []}))
	d.reasons == ["input_invalid: gate.injection must be a number in [0, 1]"]
}

test_shipped_defaults_without_fixtures if {
	d := data.lethe.decision with input as req("nobody", "web.fetch", {"injection": 0.97, "secret": 0, "findings": []})
	d.action == "quarantine"
}

# --- channels ---------------------------------------------------------------------------------

on(channel, tool, gate) := object.union(req("nobody", tool, gate), {"channel": channel})

injected := {"injection": 0.98, "secret": 0, "findings": []}

secret := {"injection": 0.05, "secret": 0.97, "findings": []}

test_absent_channel_means_tool if {
	decide(req("nobody", "web.fetch", injected)) == decide(on("tool", "web.fetch", injected))
}

test_untrusted_channels_gate_injection if {
	every channel in ["tool", "mcp", "tool_definition", "tool_call_arguments", "assistant"] {
		decide(on(channel, "web.fetch", injected)).reasons == ["injection_threshold: injection 0.98 >= 0.76"]
	}
}

test_principal_channels_are_not_injection_gated if {
	every channel in ["user", "system", "developer"] {
		decide(on(channel, null, injected)) == {"action": "allow", "reasons": ["default_allow: no rule fired"]}
	}
}

test_secrets_are_redacted_on_every_channel if {
	every channel in ["tool", "mcp", "tool_definition", "tool_call_arguments", "user", "assistant", "system", "developer"] {
		decide(on(channel, "web.fetch", secret)).action == "redact"
	}
}

test_quarantined_bytes_stay_quarantined_on_every_channel if {
	every channel in ["tool", "user", "assistant", "system", "developer", "tool_call_arguments", "tool_definition", "mcp"] {
		i := object.union(on(channel, "web.fetch", clean), {
			"content_sha256": "ab12",
			"session": {"id": "s1", "age_s": 1, "tokens": 10, "quarantined_hashes": ["ff00", "ab12"]},
		})
		d := decide(i)
		d.action == "quarantine"
		d.reasons == [sprintf("quarantined_content: content ab12 was quarantined earlier in session s1 (channel %s)", [channel])]
	}
}

test_a_normalised_form_quarantined_earlier_stays_quarantined if {
	i := object.union(on("user", null, clean), {
		"content_sha256": "0000", "content_norm_sha256": "ab12",
		"session": {"id": "s1", "age_s": 1, "tokens": 10, "quarantined_hashes": ["ab12"]},
	})
	d := decide(i)
	d.action == "quarantine"
	d.reasons == ["quarantined_content: content ab12 (normalised) was quarantined earlier in session s1 (channel user)"]
}

test_an_exact_and_normalised_match_gives_one_reason if {
	i := object.union(on("user", null, clean), {
		"content_sha256": "ab12", "content_norm_sha256": "cd34",
		"session": {"id": "s1", "age_s": 1, "tokens": 10, "quarantined_hashes": ["ab12", "cd34"]},
	})
	decide(i).reasons == ["quarantined_content: content ab12 was quarantined earlier in session s1 (channel user)"]
}

test_other_hashes_are_not_quarantined if {
	i := object.union(on("user", null, clean), {
		"content_sha256": "0000",
		"session": {"id": "s1", "age_s": 1, "tokens": 10, "quarantined_hashes": ["ab12"]},
	})
	decide(i).action == "allow"
}

test_unknown_channel_is_invalid if {
	d := decide(on("telepathy", "web.fetch", clean))
	d.action == "quarantine"
	d.reasons == ["input_invalid: channel must be one of tool, mcp, tool_definition, tool_call_arguments, user, assistant, system, developer"]
}

test_tool_channels_need_a_tool_name if {
	d := decide(on("tool_call_arguments", null, clean))
	d.reasons == ["input_invalid: tool must be a non-empty string or {name: non-empty string, claimed_name: string or null, verified: boolean, source: gateway, mcp or client} (null allowed on user, assistant, system, developer)"]
}

test_malformed_quarantined_hashes_are_invalid if {
	i := object.union(on("user", null, clean), {"session": {"id": "s1", "age_s": 1, "tokens": 10, "quarantined_hashes": "ab12"}})
	decide(i).reasons == ["input_invalid: content_sha256 and content_norm_sha256 must be strings and session.quarantined_hashes a list of strings"]
}

test_blocked_tool_arguments_are_quarantined if {
	d := data.lethe.decision with input as object.union(on("tool_call_arguments", "browser.raw", clean), {"tenant": "acme"})
		with data.lethe.tenants as tenants
		with data.lethe.defaults as defaults
	d.reasons == ["blocked_tool: tool browser.raw is blocked for tenant acme"]
}

test_tenant_may_gate_user_text_too if {
	d := data.lethe.decision with input as object.union(on("user", null, injected), {"tenant": "paranoid"})
		with data.lethe.tenants as {"paranoid": {"principal_channels": []}}
		with data.lethe.defaults as defaults
	d.action == "quarantine"
}
