"""The audit router through FastAPI's TestClient, with a header-based principal standing in for the gateway's."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from fastapi import FastAPI, Header
from fastapi.testclient import TestClient

from audit.api import make_router
from audit.merkle import ConsistencyProof
from audit.note import Checkpoint
from audit.verify import verify_erasure_proof, verify_export


@dataclass
class Who:
    tenant: str
    is_admin: bool


def principal(x_tenant: str = Header(), x_admin: str = Header("no")) -> Who:
    return Who(x_tenant, x_admin == "yes")


ACME = {"X-Tenant": "acme"}
GLOBEX = {"X-Tenant": "globex"}
ADMIN = {"X-Tenant": "ops", "X-Admin": "yes"}


@pytest.fixture
def client(sqlite_log, record):
    for i in range(12):
        sqlite_log.append(record(i, tenant="acme" if i % 3 else "globex"))
    app = FastAPI()
    app.include_router(make_router(lambda: sqlite_log, principal))
    return TestClient(app)


def test_list_is_tenant_scoped_and_paginated(client):
    acme = client.get("/v1/audit/records", headers=ACME).json()["records"]
    assert [r["index"] for r in acme] == [1, 2, 4, 5, 7, 8, 10, 11]
    assert {r["body"]["tenant"] for r in acme} == {"acme"}
    assert client.get("/v1/audit/records", params={"tenant": "globex"}, headers=ACME).status_code == 403
    page = client.get("/v1/audit/records", params={"limit": 5}, headers=ADMIN).json()
    assert [r["index"] for r in page["records"]] == [0, 1, 2, 3, 4] and page["next_after"] == 4
    rest = client.get("/v1/audit/records", params={"after": 4, "limit": 50}, headers=ADMIN).json()
    assert rest["records"][0]["index"] == 5 and rest["next_after"] is None
    assert [r["index"] for r in client.get("/v1/audit/records", params={"tenant": "globex"}, headers=ADMIN).json()["records"]] == [0, 3, 6, 9]


def test_get_record_has_an_inclusion_proof_and_hides_other_tenants(client):
    got = client.get("/v1/audit/records/4", headers=ACME)
    assert got.status_code == 200
    assert got.json()["inclusion_proof"]["leaf_index"] == 4
    assert client.get("/v1/audit/records/3", headers=ACME).status_code == 404  # globex's
    assert client.get("/v1/audit/records/99", headers=ACME).status_code == 404
    assert client.get("/v1/audit/erasures/3/proof", headers=ACME).status_code == 404
    assert client.get("/v1/audit/records/3", headers=ADMIN).status_code == 200


def test_erasure_proof_verifies_offline_with_the_served_public_key(client):
    key = client.get("/v1/audit/public-key").json()  # no auth
    assert key["vkey"].startswith("lethe.local/audit+" + key["key_id"] + "+")
    proof = client.get("/v1/audit/erasures/11/proof", headers=ACME).json()
    report = verify_erasure_proof(proof, public_key_pem=key["public_key_pem"])
    assert report.ok, report.summary()
    assert report.checked["inclusion_proofs"] == 1


def test_checkpoint_and_consistency(client, sqlite_log, record):
    old = Checkpoint.from_note(client.get("/v1/audit/checkpoint", headers=ACME).json()["note"])
    sqlite_log.append_many([record(i) for i in range(20)])
    new = sqlite_log.checkpoint()
    body = client.get("/v1/audit/consistency", params={"first": old.size, "second": new.size}, headers=ACME).json()
    ConsistencyProof.from_dict(body).verify(old.root_hash, new.root_hash)
    assert client.get("/v1/audit/consistency", params={"first": 99, "second": 3}, headers=ACME).status_code == 400


def test_export_is_admin_only_and_verifies(client, signer):
    assert client.get("/v1/audit/export", headers=ACME).status_code == 403
    doc = client.get("/v1/audit/export", headers=ADMIN).json()
    report = verify_export(doc, public_key_pem=signer.public_key_pem)
    assert report.ok and report.checked["records"] == 12, report.summary()
