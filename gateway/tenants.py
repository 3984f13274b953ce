"""Tenants and API keys. A key is shown once at creation and stored only as its SHA-256.

Keys carry 256 bits of randomness, so a plain hash is enough: nothing is gained by a slow KDF
against guessing, and lookups stay O(1) per request. A store made with `cache_s` also remembers,
for that long, whom a key it found belongs to (`cached`): a caller on an event loop then answers
most requests without a database read or a thread hop. Only found keys are remembered, by their
hash, so a new key works at once and a key deleted from the database stops working within `cache_s`.
"""
from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from sqlalchemy import Boolean, Column, DateTime, ForeignKey, MetaData, String, Table, create_engine, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

if TYPE_CHECKING:
    from ledger import SessionRecord
    from policies import PolicyEngine

KEY_PREFIX = "lth_"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")

_meta = MetaData()
tenants_table = Table(
    "gateway_tenants", _meta,
    Column("name", String(64), primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
)
keys_table = Table(
    "gateway_api_keys", _meta,
    Column("key_sha256", String(64), primary_key=True),
    Column("tenant", String(64), ForeignKey("gateway_tenants.name"), nullable=True),
    Column("user", String(128), nullable=True),
    Column("roles", String(256), nullable=False, default=""),
    Column("is_admin", Boolean, nullable=False, default=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (None only for the global admin), an optional user, and roles."""

    tenant: str | None
    user: str | None = None
    roles: tuple[str, ...] = field(default=())
    is_admin: bool = False

    def audit_viewer(self, sees: Callable[[dict[str, Any]], bool] | None = None) -> "AuditViewer":
        """Only the global admin sees every tenant's audit records; a tenant admin sees its own;
        `sees` narrows a user's view to its own sessions (see Sessions.audit_filter)."""
        return AuditViewer(tenant=self.tenant or "", is_admin=self.is_admin and self.tenant is None, sees=sees)

    def owner_only(self, policy: "PolicyEngine") -> bool:
        """Whether this caller sees only its own sessions: a non-admin of a tenant whose cache scope
        is per user (`tenant_user`, the default). A tenancy the policy cannot answer counts as per
        user (the closed side). One rule for the chat API and the MCP proxy."""
        if self.is_admin:
            return False
        try:
            scope = policy.tenancy({"tenant": self.tenant, "user": self.user, "public_prefix": False}).scope
        except Exception:  # noqa: BLE001 - any policy failure closes the view, never widens it
            return True
        return scope == "tenant_user"

    def may_see(self, policy: "PolicyEngine", record: "SessionRecord") -> bool:
        """Whether this caller may see `record`, a session of its own tenant."""
        return not self.owner_only(policy) or (record.user is not None and record.user == self.user)

    def policy_actor(self) -> dict[str, object]:
        roles = list(self.roles) + (["tenant_admin"] if self.is_admin and self.tenant else [])
        return {"tenant": self.tenant, "user": self.user, "roles": roles}


@dataclass(frozen=True)
class AuditViewer:
    tenant: str
    is_admin: bool
    sees: Callable[[dict[str, Any]], bool] | None = None


class TenantError(ValueError):
    pass


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantStore:
    def __init__(self, engine: Engine, admin_key: str | None = None, cache_s: float = 0.0) -> None:
        self._engine = engine
        self._admin_sha = hash_key(admin_key) if admin_key else None
        self._cache_s = cache_s
        self._found: dict[str, tuple[Principal, float]] = {}  # key hash -> (principal, monotonic expiry)
        _meta.create_all(engine)

    @classmethod
    def from_url(cls, url: str, admin_key: str | None = None, cache_s: float = 0.0) -> "TenantStore":
        return cls(create_engine(url), admin_key, cache_s)

    def create_tenant(self, name: str) -> None:
        if not _NAME.match(name):
            raise TenantError(f"tenant name {name!r} must match {_NAME.pattern}")
        try:
            with self._engine.begin() as c:
                c.execute(insert(tenants_table).values(name=name, created_at=datetime.now(timezone.utc)))
        except IntegrityError:
            raise TenantError(f"tenant {name!r} already exists") from None

    def tenants(self) -> list[str]:
        with self._engine.connect() as c:
            return [r.name for r in c.execute(select(tenants_table.c.name).order_by(tenants_table.c.name))]

    def create_key(self, tenant: str | None, *, user: str | None = None, roles: tuple[str, ...] = (),
                   admin: bool = False) -> str:
        """Return a new key (shown once). tenant=None with admin=True makes a global admin key."""
        if tenant is None and not admin:
            raise TenantError("a key needs --tenant, or --admin for a global admin key")
        if tenant is not None and tenant not in self.tenants():
            raise TenantError(f"unknown tenant {tenant!r}; create it with `lethe tenant create {tenant}`")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        with self._engine.begin() as c:
            c.execute(insert(keys_table).values(
                key_sha256=hash_key(key), tenant=tenant, user=user, roles=",".join(roles),
                is_admin=admin, created_at=datetime.now(timezone.utc)))
        return key

    def authenticate(self, key: str) -> Principal | None:
        digest = hash_key(key)
        if self._admin_sha is not None and secrets.compare_digest(digest, self._admin_sha):
            return Principal(tenant=None, is_admin=True)
        with self._engine.connect() as c:
            row = c.execute(select(keys_table).where(keys_table.c.key_sha256 == digest)).first()
        if row is None:
            self._found.pop(digest, None)  # gone from the database: forget it now, not at expiry
            return None
        roles = tuple(r for r in row.roles.split(",") if r)
        found = Principal(tenant=row.tenant, user=row.user, roles=roles, is_admin=row.is_admin)
        if self._cache_s > 0:
            if len(self._found) >= 4096:  # bounded: only keys that exist get here, but there may be many
                self._found.clear()
            self._found[digest] = (found, time.monotonic() + self._cache_s)
        return found

    def cached(self, key: str) -> Principal | None:
        """Whom `authenticate` found this key to belong to less than `cache_s` ago; None if it has
        not (then ask `authenticate`). No I/O: cheap enough for an event loop."""
        hit = self._found.get(hash_key(key))
        return hit[0] if hit is not None and hit[1] > time.monotonic() else None
