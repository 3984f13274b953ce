# decision: what happens to one piece of content before it may enter the KV cache.
#
# Query: data.lethe.decision
# Input:
#   {
#     "tenant":  string,
#     "user":    string | null,
#     "channel": "tool" | "mcp" | "tool_definition" | "tool_call_arguments" |
#                "user" | "assistant" | "system" | "developer"          (absent: "tool", a chat tool result)
#     "upstream": string      (mcp only: the upstream server the proxy routed to)
#     "phase":   "result" | "arguments" | "definition"
#                             (mcp only: a tool's result, a call's arguments, a tool's listing)
#     "content_sha256": string                                         (optional)
#     "content_norm_sha256": string   (optional: the hash of the content's normalised form, NFKC,
#                                      ignorables removed, all whitespace removed)
#     "session": {"id": string, "age_s": number, "tokens": number,
#                 "quarantined_hashes": [string, ...]}                  (optional list)
#     "tool":    {"name": string, "claimed_name": string | null, "verified": boolean,
#                 "source": "gateway" | "mcp" | "client",
#                 "folded": [string, ...]}   (optional: the names' Unicode folds, for blocking)
#                | string    (a bare name: what the caller claims, treated as
#                             {"name": s, "claimed_name": s, "verified": false, "source": "client"})
#                (null or absent allowed on user/assistant/system/developer)
#                `name` is the trust-relevant name: on chat, the function name the gateway's own
#                model called under the result's tool_call_id (source "gateway"); on mcp, the
#                upstream route the result came from (source "mcp"). `verified` is true only when
#                such a server-side record backs `name` and the client's claim agrees with it.
#     "span":    {"bytes": number, "tokens": number},
#     "gate":    {"injection": number in [0, 1], "secret": number in [0, 1],
#                 "findings": [{"kind": string, "rule_id": string, "layer": string, "score": number,
#                               "count": number}],   (one per kind, rule and layer: its highest score, how many)
#                 "scorer": optional "stack" | "byte_gate" (what produced `injection`)}
#   }
# Output: {"action": "allow" | "quarantine" | "redact" | "forget" | "amortize", "reasons": [string, ...],
#          "redact_kinds": [string, ...]   (only with action "redact": the finding kinds to cut out),
#          "non_text": "pass" | "withhold"  (only on channel "mcp": images, audio and blobs the gate cannot read)}
#
# Every reason starts with the name of the rule that fired ("injection_threshold: ...").
# All rules that fire are reported; the action comes from the highest-ranked one:
#   0 input_invalid        quarantine   the input does not have the documented shape
#   1 quarantined_content  quarantine   content_sha256 or content_norm_sha256 is in
#                                       session.quarantined_hashes: bytes quarantined once stay
#                                       quarantined on every channel, also with trivial changes
#   1 blocked_tool         quarantine   tool.name or tool.claimed_name is blocked globally or for
#                                       the tenant (a claim is enough to block, never to trust;
#                                       matched by tool_key: case, "functions.", _ - . and space
#                                       ignored, and on any of tool.folded or a comma-joined part)
#   2 injection_threshold  quarantine   injection score at or over the tenant's threshold
#                                       (trusted tools use thresholds.trusted_injection: only a
#                                       verified identity from the gateway or the mcp proxy);
#                                       not on the tenant's principal_channels (default user,
#                                       system, developer: the principal's own words instruct)
#   3 span_limit           quarantine   span longer than max_span_tokens
#   3 session_budget       quarantine   session would grow past max_session_tokens
#   4 secret_threshold     redact       secret score at or over the tenant's threshold
#   4 sensitive_finding    redact       the gate found a kind listed in sensitive_kinds
#     (redact: the gateway cuts every finding of a sensitive kind out, re-scans, and admits only
#      the redacted text. Rank 4 yields forget (the model reads the result for one turn, then it
#      is erased exactly) when the tenant sets sensitive_action: "forget"; amortize only when it
#      sets amortize_opt_in: true and sensitive_action: "amortize"; allow only when it sets
#      admit_sensitive: true and sensitive_action: "allow")
#   9 default_allow        allow        nothing above fired
package lethe

import rego.v1

decision := object.union_n([
	{"action": decision_action, "reasons": [hit[1] | some hit in decision_ranked]},
	decision_redact,
	decision_non_text,
])

# [rank, reason, action] sorts by rank, then reason: deterministic in every engine.
decision_ranked := sort([[h.rank, h.reason, h.action] | some h in decision_hits])

decision_action := decision_ranked[0][2]

decision_redact := {"redact_kinds": sort([k | some k in tenant_settings.sensitive_kinds])} if decision_action == "redact"

else := {}

decision_non_text := {"non_text": tenant_settings.mcp.non_text} if input.channel == "mcp"

else := {}

decision_fired contains {"rank": 0, "action": "quarantine", "reason": sprintf("input_invalid: %s", [problem])} if {
	some problem in decision_input_problems
}

decision_fired contains {"rank": 1, "action": "quarantine", "reason": msg} if {
	decision_input_ok
	some digest in quarantined_digest
	msg := sprintf("quarantined_content: content %s was quarantined earlier in session %v (channel %s)", [digest, input.session.id, decision_channel])
}

# The exact-bytes hash when it was quarantined, else the normalised form's (one reason, not two).
# (A set without `else`: regorus' compiled VM turns an undefined else-chain into an undefined
# decision.)
quarantined_list := object.get(object.get(input, "session", {}), "quarantined_hashes", [])

exact_quarantined if object.get(input, "content_sha256", null) in quarantined_list

quarantined_digest contains input.content_sha256 if exact_quarantined

quarantined_digest contains sprintf("%s (normalised)", [input.content_norm_sha256]) if {
	not exact_quarantined
	object.get(input, "content_norm_sha256", null) in quarantined_list
}

decision_fired contains {"rank": 1, "action": "quarantine", "reason": msg} if {
	decision_input_ok
	some joined in tool_names
	some name in split(joined, ",")
	tool_key(name) in blocked_keys
	msg := sprintf("blocked_tool: tool %s is blocked for tenant %s", [name, input.tenant])
}

# Blocking matches a name's key, not its spelling, so a client cannot rename a blocked tool past
# the list (red team #13 F7): case, surrounding space, an OpenAI-style "functions." prefix and the
# separators "_", "-", "." and space do not make another tool. The gateway adds the names' Unicode
# folds (NFKC, invisible characters removed, look-alike letters folded) as `input.tool.folded`.
# Trust stays exact: a trusted name must be verified as written (see tool_trusted).
tool_key(name) := k if {
	bare := trim_prefix(lower(trim_space(name)), "functions.")
	k := replace(replace(replace(replace(bare, "_", ""), "-", ""), ".", ""), " ", "")
}

blocked_keys := {tool_key(t) | some t in blocked_tools}

decision_fired contains {"rank": 2, "action": "quarantine", "reason": msg} if {
	decision_input_ok
	not decision_channel in tenant_settings.principal_channels
	input.gate.injection >= injection_limit
	msg := sprintf("injection_threshold: injection %.2f >= %.2f%s", [input.gate.injection, injection_limit, trusted_note])
}

decision_fired contains {"rank": 3, "action": "quarantine", "reason": msg} if {
	decision_input_ok
	input.span.tokens > tenant_settings.max_span_tokens
	msg := sprintf("span_limit: span %v tokens > %v", [input.span.tokens, tenant_settings.max_span_tokens])
}

decision_fired contains {"rank": 3, "action": "quarantine", "reason": msg} if {
	decision_input_ok
	total := input.session.tokens + input.span.tokens
	total > tenant_settings.max_session_tokens
	msg := sprintf("session_budget: session %v + span %v tokens > %v", [input.session.tokens, input.span.tokens, tenant_settings.max_session_tokens])
}

decision_fired contains {"rank": 4, "action": sensitive_action, "reason": msg} if {
	decision_input_ok
	input.gate.secret >= tenant_settings.thresholds.secret
	msg := sprintf("secret_threshold: secret %.2f >= %.2f", [input.gate.secret, tenant_settings.thresholds.secret])
}

decision_fired contains {"rank": 4, "action": sensitive_action, "reason": msg} if {
	decision_input_ok
	some finding in input.gate.findings
	finding.kind in tenant_settings.sensitive_kinds
	msg := sprintf("sensitive_finding: %s finding %s (layer %s)", [finding.kind, finding.rule_id, finding.layer])
}

# default_allow cannot be one more `decision_fired` rule: it would depend on the set it adds to.
decision_hits := decision_fired if count(decision_fired) > 0

else := {{"rank": 9, "action": "allow", "reason": "default_allow: no rule fired"}}

# Channels (see the header). "tool" when absent, so a caller that predates channels keeps its meaning.
decision_channels := {"tool", "mcp", "tool_definition", "tool_call_arguments", "user", "assistant", "system", "developer"}

tool_channels := {"tool", "mcp", "tool_definition", "tool_call_arguments"}

decision_channel := object.get(input, "channel", "tool")

# The byte gate alone and the probe stack are different scores with different operating points
# (gate/README.md measures both on kinds never trained on): each has its own default threshold.
injection_limit := tenant_settings.thresholds.trusted_injection if tool_trusted

else := tenant_settings.thresholds.injection_byte_gate if input.gate.scorer == "byte_gate"

else := tenant_settings.thresholds.injection

trusted_note := sprintf(" (trusted tool %s)", [tool_identity.name]) if tool_trusted

else := sprintf(" (tool name %s is unverified: trust not applied)", [tool_identity.claimed_name]) if {
	tool_identity.verified != true
	tool_identity.claimed_name in trusted_tools
}

else := ""

# The tool's identity (see the header): a bare string is a claim, never verified.
tool_identity := {"name": input.tool, "claimed_name": input.tool, "verified": false, "source": "client"} if {
	is_string(input.tool)
}

else := input.tool if is_object(input.tool)

else := {}

# Every name a tool goes by: blocking applies to any of them.
tool_names := {n | some key in ["name", "claimed_name"]; n := object.get(tool_identity, key, null); non_empty_string(n)} | {n |
	some n in object.get(tool_identity, "folded", [])
	non_empty_string(n)
}

# Trust needs a server-side record: the gateway's own tool call, or the mcp proxy's route.
tool_trusted if {
	tool_identity.verified == true
	tool_identity.source in {"gateway", "mcp"}
	tool_identity.name in trusted_tools
}

# Amortize (a Leyline splice, not an erasure) needs both switches, so a typo in one
# of them cannot silently turn erasure off.
sensitive_action := "amortize" if {
	tenant_settings.amortize_opt_in == true
	tenant_settings.sensitive_action == "amortize"
}

# Admitting sensitive content and keeping it (until retention or an explicit erasure) likewise
# needs two switches: a review workflow that forgets through the erasure API opts in this way.
else := "allow" if {
	tenant_settings.admit_sensitive == true
	tenant_settings.sensitive_action == "allow"
}

else := "forget" if tenant_settings.sensitive_action == "forget"

else := "redact"

# Input checks. A field check is a rule, never `not f(input.x)`: with input.x undefined
# that expression is true in regorus but undefined in OPA.
decision_input_ok if count(decision_valid) == count(decision_checks)

decision_input_problems contains msg if {
	some field, msg in decision_checks
	not field in decision_valid
}

decision_checks := {
	"tenant": "tenant must be a non-empty string",
	"channel": "channel must be one of tool, mcp, tool_definition, tool_call_arguments, user, assistant, system, developer",
	"tool": "tool must be a non-empty string or {name: non-empty string, claimed_name: string or null, verified: boolean, source: gateway, mcp or client} (null allowed on user, assistant, system, developer)",
	"content": "content_sha256 and content_norm_sha256 must be strings and session.quarantined_hashes a list of strings",
	"injection": "gate.injection must be a number in [0, 1]",
	"secret": "gate.secret must be a number in [0, 1]",
	"findings": "gate.findings must be a list",
	"span": "span.tokens must be a number",
	"session": "session.tokens must be a number",
}

decision_valid contains "tenant" if non_empty_string(input.tenant)

decision_valid contains "channel" if decision_channel in decision_channels

decision_valid contains "tool" if non_empty_string(input.tool)

decision_valid contains "tool" if {
	non_empty_string(input.tool.name)
	claimed := object.get(input.tool, "claimed_name", null)
	any_of_null_or_string(claimed)
	is_boolean(input.tool.verified)
	input.tool.source in {"gateway", "mcp", "client"}
}

decision_valid contains "tool" if {
	not decision_channel in tool_channels
	object.get(input, "tool", null) == null
}

decision_valid contains "content" if {
	is_string(object.get(input, "content_sha256", ""))
	is_string(object.get(input, "content_norm_sha256", ""))
	hashes := quarantined_list
	is_array(hashes)
	every h in hashes { is_string(h) }
}

decision_valid contains "injection" if unit_number(input.gate.injection)

decision_valid contains "secret" if unit_number(input.gate.secret)

decision_valid contains "findings" if is_array(input.gate.findings)

decision_valid contains "span" if is_number(input.span.tokens)

decision_valid contains "session" if is_number(input.session.tokens)

any_of_null_or_string(x) if x == null

any_of_null_or_string(x) if is_string(x)
