package lethe.tenancy_test

import rego.v1

tenants := {
	"acme": {"tenancy": {"epoch": 4}},
	"shared": {"tenancy": {"scope": "tenant", "epoch": 2}},
	"private": {"tenancy": {"public_prefix_allowed": false}},
}

scope(i) := t if {
	t := data.lethe.tenancy with input as i
		with data.lethe.tenants as tenants
		with data.lethe.public as {"epoch": 7}
}

test_default_scope_is_tenant_user if {
	scope({"tenant": "acme", "user": "alice", "public_prefix": false}) == {"scope": "tenant_user", "scope_key": "[\"acme\",\"alice\"]", "epoch": 4}
}

test_tenant_scope_shares_salt_between_users if {
	a := scope({"tenant": "shared", "user": "alice", "public_prefix": false})
	b := scope({"tenant": "shared", "user": "bob", "public_prefix": false})
	a == b
	a == {"scope": "tenant", "scope_key": "[\"shared\"]", "epoch": 2}
}

test_public_prefix_uses_public_epoch if {
	scope({"tenant": "acme", "user": "alice", "public_prefix": true}) == {"scope": "public", "scope_key": "public", "epoch": 7}
}

test_tenant_can_refuse_public_prefixes if {
	scope({"tenant": "private", "user": "alice", "public_prefix": true}).scope == "tenant_user"
}

test_user_scope_without_user_is_undefined if {
	not scope({"tenant": "acme", "user": null, "public_prefix": false})
}

test_missing_tenant_is_undefined if {
	not scope({"tenant": "", "user": "alice", "public_prefix": true})
}

test_scope_key_cannot_be_forged_by_separator if {
	a := scope({"tenant": "a", "user": "b/c", "public_prefix": false})
	b := scope({"tenant": "a/b", "user": "c", "public_prefix": false})
	a.scope_key != b.scope_key
}

test_epoch_rotation_changes_only_that_tenant if {
	rotated := object.union(tenants, {"shared": {"tenancy": {"epoch": 3}}})
	t := data.lethe.tenancy with input as {"tenant": "shared", "user": "x", "public_prefix": false}
		with data.lethe.tenants as rotated
	t.epoch == 3
	scope({"tenant": "acme", "user": "x", "public_prefix": false}).epoch == 4
}
