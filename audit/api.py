"""The audit HTTP API: a FastAPI router the gateway mounts. Read-only: appends come from the gateway.

Tenant scoping: a non-admin principal sees only its own tenant's records, and another tenant's
record answers 404 (not 403), so record indices do not leak which tenants exist. Checkpoints,
consistency proofs and the public key carry only hashes and are open to every principal
(the public key to anyone).
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from fastapi.responses import StreamingResponse

from .errors import AuditError, RecordNotFound
from .log import AuditLog
from .merkle import ProofError
from .records import AuditRecord

__all__ = ["Principal", "make_router"]

_INT64 = 2**63 - 1  # every index and size fits a database integer


class Principal(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def is_admin(self) -> bool: ...


def _visible(record: AuditRecord, who: Principal) -> bool:
    """Tenant scoping, then the principal's own narrowing (`sees`, e.g. to one user's sessions)."""
    sees = getattr(who, "sees", None)
    return (who.is_admin or record.body.get("tenant") == who.tenant) and (sees is None or sees(record.body))


def make_router(get_log: Callable[[], AuditLog], principal: Callable[..., Principal]) -> APIRouter:
    """Routes under /v1/audit. ``principal`` is the gateway's auth dependency."""
    router = APIRouter(prefix="/v1/audit", tags=["audit"])

    def visible_record(index: int, log: AuditLog, who: Principal) -> AuditRecord:
        try:
            record = log.get(index)
        except RecordNotFound:
            record = None
        if record is None or not _visible(record, who):
            raise HTTPException(404, f"no audit record {index}")
        return record

    @router.get("/records")
    def list_records(
        tenant: str | None = None,
        session: str | None = None,
        kind: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = Query(50, ge=1, le=1000),
        after: int | None = Query(None, ge=-1, le=_INT64),
        log: AuditLog = Depends(get_log),
        who: Principal = Depends(principal),
    ) -> dict[str, Any]:
        if not who.is_admin:
            if tenant is not None and tenant != who.tenant:
                raise HTTPException(403, "a tenant key lists only its own tenant's records")
            tenant = who.tenant
        records = log.list(tenant=tenant, session=session, kind=kind, since=since, until=until, limit=limit, after=after)
        return {  # a page may hold fewer than `limit` visible records: page on with next_after
            "records": [r.to_dict() for r in records if _visible(r, who)],
            "next_after": records[-1].index if len(records) == limit else None,
        }

    @router.get("/records/{index}")
    def get_record(index: int = Path(ge=0, le=_INT64), log: AuditLog = Depends(get_log), who: Principal = Depends(principal)) -> dict[str, Any]:
        record = visible_record(index, log, who)
        proof = log.erasure_proof(index)
        return {**record.to_dict(), "checkpoint": proof["checkpoint"], "inclusion_proof": proof["inclusion_proof"]}

    @router.get("/checkpoint")
    def checkpoint(log: AuditLog = Depends(get_log), _: Principal = Depends(principal)) -> dict[str, Any]:
        return log.latest_checkpoint().to_dict()

    @router.get("/consistency")
    def consistency(
        first: int = Query(..., ge=0, le=_INT64),
        second: int | None = Query(None, ge=0, le=_INT64),
        log: AuditLog = Depends(get_log),
        _: Principal = Depends(principal),
    ) -> dict[str, Any]:
        try:
            return log.consistency_proof(first, second).to_dict()
        except (ProofError, AuditError) as e:
            raise HTTPException(400, str(e)) from e

    @router.get("/erasures/{index}/proof")
    def erasure_proof(index: int = Path(ge=0, le=_INT64), log: AuditLog = Depends(get_log), who: Principal = Depends(principal)) -> dict[str, Any]:
        visible_record(index, log, who)
        return log.erasure_proof(index)

    @router.get("/public-key")
    def public_key(log: AuditLog = Depends(get_log)) -> dict[str, Any]:
        return log.public_key()

    @router.get("/export")
    def export(log: AuditLog = Depends(get_log), who: Principal = Depends(principal)) -> StreamingResponse:
        if not who.is_admin:
            raise HTTPException(403, "the full audit export needs an admin key")
        return StreamingResponse(log.export_chunks(), media_type="application/json")

    return router
