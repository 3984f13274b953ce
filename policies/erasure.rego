# erasure: who may forget what.
#
# Query: data.lethe.erasure
# Input:  {"actor":  {"tenant": string, "user": string | null, "roles": [string, ...]},
#          "target": {"tenant": string, "session_id": string, "session_owner": string | null},
#          "action": "forget"}
# Output: {"allow": bool, "reasons": [string, ...]}
#
# Data: data.lethe.erasure_rights = {"admin_roles": [...], "compliance_roles": [...], "actions": [...]}
#
# Grants (any one suffices, and only within one tenant):
#   tenant_admin     the actor holds an admin role of the target's tenant
#   compliance_role  the actor holds a compliance role: any session of its own tenant
#   session_owner    the actor is the user who owns the target session
# Denials (any one wins over every grant):
#   input_invalid    the input does not have the documented shape
#   cross_tenant     actor and target belong to different tenants; no role crosses tenants
#   unknown_action   the action is not listed in data.lethe.erasure_rights.actions
#   no_grant         none of the grants applies
package lethe

import rego.v1

erasure := {"allow": true, "reasons": sort([r | some r in erasure_grants])} if {
	count(erasure_denials) == 0
} else := {"allow": false, "reasons": sort([r | some r in erasure_denials])}

erasure_denials contains sprintf("input_invalid: %s", [problem]) if {
	some problem in erasure_input_problems
}

erasure_denials contains msg if {
	erasure_input_ok
	input.actor.tenant != input.target.tenant
	msg := sprintf("cross_tenant: actor of tenant %s may not erase in tenant %s", [input.actor.tenant, input.target.tenant])
}

erasure_denials contains msg if {
	erasure_input_ok
	not input.action in data.lethe.erasure_rights.actions
	msg := sprintf("unknown_action: %v is not an erasure action", [input.action])
}

erasure_denials contains "no_grant: actor is neither tenant admin, compliance officer nor session owner" if {
	erasure_input_ok
	count(erasure_grants) == 0
}

erasure_grants contains sprintf("tenant_admin: role %s in tenant %s", [role, input.actor.tenant]) if {
	some role in input.actor.roles
	role in data.lethe.erasure_rights.admin_roles
}

erasure_grants contains sprintf("compliance_role: role %s in tenant %s", [role, input.actor.tenant]) if {
	some role in input.actor.roles
	role in data.lethe.erasure_rights.compliance_roles
}

erasure_grants contains sprintf("session_owner: %s owns session %s", [input.actor.user, input.target.session_id]) if {
	non_empty_string(input.actor.user)
	input.actor.user == input.target.session_owner
}

# Field checks are rules, never `not f(input.x)` (see decision.rego).
erasure_input_ok if count(erasure_valid) == count(erasure_checks)

erasure_input_problems contains msg if {
	some field, msg in erasure_checks
	not field in erasure_valid
}

erasure_checks := {
	"actor_tenant": "actor.tenant must be a non-empty string",
	"target_tenant": "target.tenant must be a non-empty string",
	"session_id": "target.session_id must be a non-empty string",
	"roles": "actor.roles must be a list",
}

erasure_valid contains "actor_tenant" if non_empty_string(input.actor.tenant)

erasure_valid contains "target_tenant" if non_empty_string(input.target.tenant)

erasure_valid contains "session_id" if non_empty_string(input.target.session_id)

erasure_valid contains "roles" if is_array(input.actor.roles)
