# retention: how long a stored segment may live before the gateway forgets it.
#
# Query: data.lethe.retention
# Input:  {"tenant": string, "tool": string, "state": "live" | "quarantined" | "amortized",
#          "gate": {"injection": number, "secret": number, "findings": [...]}}   (as in decision)
# Output: {"data_class": "secret" | "quarantined" | "amortized" | "normal",
#          "ttl_seconds": number | null}     null means keep until erased explicitly
#
# Data: tenant_settings.retention = {
#         "classes": {"secret": s, "quarantined": s, "amortized": s, "normal": s},
#         "tools":   {<tool>: {<class>: s, ...}}        per-tool overrides
#       }
#
# Class, first match wins:
#   secret       secret score at or over the tenant's threshold, or a sensitive finding
#                (beats quarantined: a quarantine store must not become a secret store)
#   quarantined  state is "quarantined"
#   amortized    state is "amortized"
#   normal       everything else
# A malformed input (unknown state, gate without scores) is undefined, never "normal".
# TTL, first match wins: the tenant's per-tool value, then the class value (tenant
# overrides already merged over data.lethe.defaults).
package lethe

import rego.v1

retention := {"data_class": retention_class, "ttl_seconds": retention_ttl} if {
	non_empty_string(input.tenant)
	is_string(input.tool)
	input.state in {"live", "quarantined", "amortized"}
	unit_number(input.gate.secret)
	is_array(input.gate.findings)
}

retention_class := "secret" if {
	retention_sensitive
} else := "quarantined" if {
	input.state == "quarantined"
} else := "amortized" if {
	input.state == "amortized"
} else := "normal"

retention_sensitive if input.gate.secret >= tenant_settings.thresholds.secret

retention_sensitive if {
	some finding in input.gate.findings
	finding.kind in tenant_settings.sensitive_kinds
}

# One expression rather than `else`: regorus' compiled VM (0.13) left an `else` whose value is
# a reference undefined, where OPA and the interpreter agree; tests/policies checks all three.
retention_ttl := object.get(
	object.get(tenant_settings.retention.tools, input.tool, {}),
	retention_class,
	tenant_settings.retention.classes[retention_class],
)

# kv_priority: how dearly a session's KV cache is kept in memory (TensorRT-LLM's retention
# priorities). The gateway evicts whole idle sessions, lowest priority first, then least recently
# used; an evicted session at or above `offload_min_priority` is offloaded (and restored exactly),
# one below it is dropped and rebuilt from the ledger on its next turn.
#
# Query: data.lethe.kv_priority
# Input:  {"tenant": string,
#          "segments": [{"role": string, "tool": string | null,
#                        "state": "live" | "quarantined" | "amortized", "n_tokens": number}]}
#          (the session's segments now in the cache, oldest first)
# Output: {"default_priority": 0..100, "offload_min_priority": 0..100,
#          "segments": [{"priority": 0..100, "duration_s": number | null}]}   one per input segment
# A segment keeps `priority` for `duration_s` seconds after it entered, then reverts to
# `default_priority` (null: for ever). The gateway weighs the segments' current priorities by
# their tokens into the session's priority (one number, since sessions are evicted whole).
#
# Data: tenant_settings.kv = {"default_priority", "offload_min_priority",
#         "classes": {"system" | "pinned" | "turn" | "stub": {"priority", "duration_s"}}}
# Class of a segment:
#   stub    quarantined or amortized (what stands in for withheld content)
#   system  a live system or developer message
#   pinned  a live result of one of the tenant's trusted tools
#   turn    any other live segment (user, assistant, other tools): high while recent, then default
kv_priority := {
	"default_priority": tenant_settings.kv.default_priority,
	"offload_min_priority": tenant_settings.kv.offload_min_priority,
	"segments": [kv_segment(s) | some s in input.segments],
} if {
	non_empty_string(input.tenant)
	is_array(input.segments)
	every s in input.segments {
		kv_class(s)
	}
}

kv_segment(s) := {"priority": c.priority, "duration_s": c.duration_s} if {
	c := tenant_settings.kv.classes[kv_class(s)]
}

kv_class(s) := "stub" if {
	is_string(s.role)
	s.state in {"quarantined", "amortized"}
}

kv_class(s) := "system" if {
	s.state == "live"
	s.role in {"system", "developer"}
}

kv_class(s) := "pinned" if {
	s.state == "live"
	kv_pinned(s)
}

kv_class(s) := "turn" if {
	s.state == "live"
	is_string(s.role)
	not s.role in {"system", "developer"}
	not kv_pinned(s)
}

kv_pinned(s) if {
	s.role == "tool"
	s.tool in tenant_settings.trusted_tools
}
