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
