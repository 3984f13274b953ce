# Per-tenant settings shared by the decision, tenancy and retention policies.
#
# Data (policies/data/*.json, all under the `lethe` namespace):
#   data.lethe.defaults            settings every tenant starts from
#   data.lethe.tenants[<tenant>]   partial overrides, deep-merged over the defaults
#                                  (objects merge key by key; lists and scalars replace)
#
# Blocked tools are the one exception to "tenant overrides replace": a tenant may add
# blocked tools but can never unblock a tool the operator blocked globally.
#
# MCP tools are named "<upstream>/<tool>" by the proxy, from the upstream it routed the call to,
# never from a name the client asserts. Trust listed under `mcp.trusted_tools` therefore applies
# on channel "mcp" only: a chat client naming its tool message "docs/search" gains nothing.
package lethe

import rego.v1

tenant_overrides := object.get(data.lethe.tenants, input.tenant, {})

tenant_settings := object.union(data.lethe.defaults, tenant_overrides)

blocked_tools := (({t | some t in data.lethe.defaults.blocked_tools} | {t | some t in object.get(tenant_overrides, "blocked_tools", [])}) | {t | some t in data.lethe.defaults.mcp.blocked_tools}) | {t | some t in object.get(object.get(tenant_overrides, "mcp", {}), "blocked_tools", [])}

trusted_tools := {t | some t in tenant_settings.mcp.trusted_tools} - blocked_tools if input.channel == "mcp"

else := {t | some t in tenant_settings.trusted_tools} - blocked_tools

# Input-shape helpers shared by all four policies.
non_empty_string(x) if {
	is_string(x)
	x != ""
}

unit_number(x) if {
	is_number(x)
	x >= 0
	x <= 1
}
