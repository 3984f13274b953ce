# tenancy: which cache-salt scope a request gets.
#
# Query: data.lethe.tenancy
# Input:  {"tenant": string, "user": string | null, "public_prefix": bool}
# Output: {"scope": "tenant" | "tenant_user" | "public", "scope_key": string, "epoch": number}
#
# Rego only names the scope; the gateway turns (scope, scope_key, epoch) into a salt with
# HMAC-SHA256 under the server's secret (policies.derive_salt), so no secret lives here.
#
# Data: tenant_settings.tenancy = {"scope": "tenant" | "tenant_user", "epoch": number,
#                                  "public_prefix_allowed": bool}
#       data.lethe.public.epoch   epoch of the one salt shared by all public prefixes
#
# Rules:
#   public       input.public_prefix is true and the tenant allows public prefixes
#   tenant       the tenant's scope is "tenant": every user of the tenant shares a salt
#   tenant_user  the tenant's scope is "tenant_user" and input.user is a non-empty string
# A tenant_user tenant without a user is undefined on purpose: the gateway refuses the
# request instead of silently sharing one salt between anonymous callers.
# scope_key is a JSON array so that no tenant or user name can forge another's key.
# Bumping an epoch in the data (and reloading) rotates every salt of that scope.
package lethe

import rego.v1

tenancy := {"scope": "public", "scope_key": "public", "epoch": data.lethe.public.epoch} if {
	tenancy_tenant_ok
	input.public_prefix == true
	tenant_settings.tenancy.public_prefix_allowed == true
}

else := {"scope": "tenant", "scope_key": json.marshal([input.tenant]), "epoch": tenant_settings.tenancy.epoch} if {
	tenancy_tenant_ok
	tenant_settings.tenancy.scope == "tenant"
}

else := {"scope": "tenant_user", "scope_key": json.marshal([input.tenant, input.user]), "epoch": tenant_settings.tenancy.epoch} if {
	tenancy_tenant_ok
	tenant_settings.tenancy.scope == "tenant_user"
	non_empty_string(input.user)
}

tenancy_tenant_ok if non_empty_string(input.tenant)
