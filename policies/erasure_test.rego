package lethe.erasure_test

import rego.v1

req(actor_tenant, user, roles, target_tenant, owner) := {
	"actor": {"tenant": actor_tenant, "user": user, "roles": roles},
	"target": {"tenant": target_tenant, "session_id": "s-42", "session_owner": owner},
	"action": "forget",
}

test_session_owner_may_forget if {
	d := data.lethe.erasure with input as req("acme", "alice", [], "acme", "alice")
	d == {"allow": true, "reasons": ["session_owner: alice owns session s-42"]}
}

test_non_owner_is_denied if {
	d := data.lethe.erasure with input as req("acme", "bob", ["analyst"], "acme", "alice")
	d == {"allow": false, "reasons": ["no_grant: actor is neither tenant admin, compliance officer nor session owner"]}
}

test_tenant_admin_may_forget_any_session_of_tenant if {
	d := data.lethe.erasure with input as req("acme", "root", ["tenant_admin"], "acme", "alice")
	d.allow == true
	d.reasons == ["tenant_admin: role tenant_admin in tenant acme"]
}

test_compliance_role_across_sessions_of_tenant if {
	d := data.lethe.erasure with input as req("acme", "carol", ["compliance"], "acme", "alice")
	d.allow == true
}

test_cross_tenant_denied_even_for_admin_and_compliance if {
	d := data.lethe.erasure with input as req("acme", "root", ["tenant_admin", "compliance"], "globex", "alice")
	d == {"allow": false, "reasons": ["cross_tenant: actor of tenant acme may not erase in tenant globex"]}
}

test_cross_tenant_denied_for_same_user_name if {
	d := data.lethe.erasure with input as req("acme", "alice", [], "globex", "alice")
	d.allow == false
	"cross_tenant: actor of tenant acme may not erase in tenant globex" in d.reasons
}

test_anonymous_actor_does_not_own_ownerless_session if {
	d := data.lethe.erasure with input as req("acme", null, [], "acme", null)
	d.allow == false
}

test_unknown_action_denied if {
	i := object.union(req("acme", "alice", [], "acme", "alice"), {"action": "amortize"})
	d := data.lethe.erasure with input as i
	d == {"allow": false, "reasons": ["unknown_action: amortize is not an erasure action"]}
}

test_malformed_input_denied if {
	d := data.lethe.erasure with input as {"actor": {"tenant": "acme"}, "action": "forget"}
	d.allow == false
	"input_invalid: target.tenant must be a non-empty string" in d.reasons
}

test_roles_come_from_data if {
	d := data.lethe.erasure with input as req("acme", "dpo", ["dpo"], "acme", "alice")
		with data.lethe.erasure_rights.compliance_roles as ["dpo"]
	d.allow == true
}
