"""Content-addressed blob store (sha256 -> bytes) in `ledger_blobs`, sharing the ledger's database.

Content lives in the same database as the segments so that a forget erases the segment and its
stored content in one transaction: there is no window in which one is gone and the other is not.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import Connection, Engine, delete, exists, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from .records import CONTENT_RETIRED, SegmentState
from .schema import WRITE, blobs, segments

_INSERT: dict[str, Any] = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}  # each dialect's Insert has its upsert


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ContentStore:
    """Stores each distinct content once. `delete` is unconditional; the ledger erases through
    `release`, which keeps a blob while any non-forgotten segment still references it."""

    def __init__(self, engine: Engine, serial: AbstractContextManager[object]) -> None:
        self._engine = engine
        self._serial = serial
        upsert = _INSERT[engine.dialect.name](blobs)
        # Built once (see ledger._INSERT_SEGMENT); the no-op update locks an existing row.
        self._upsert = upsert.on_conflict_do_update(index_elements=[blobs.c.sha256], set_={"size": upsert.excluded.size})

    def put(self, data: bytes) -> str:
        with self._serial, self._engine.connect().execution_options(**{WRITE: True}) as conn, conn.begin():
            return self.put_in(conn, data)

    def get(self, sha256: str) -> bytes:
        with self._serial, self._engine.connect() as conn:
            data = conn.execute(select(blobs.c.data).where(blobs.c.sha256 == sha256)).scalar_one_or_none()
        if data is None:
            raise KeyError(f"content sha256 {sha256} is not stored: it was never appended, or a forget erased it")
        return bytes(data)

    def exists(self, sha256: str) -> bool:
        with self._serial, self._engine.connect() as conn:
            return conn.execute(select(exists().where(blobs.c.sha256 == sha256))).scalar_one()

    def delete(self, sha256: str) -> None:
        """Remove a blob whatever references it (administrative erasure). Missing blobs are fine."""
        with self._serial, self._engine.connect().execution_options(**{WRITE: True}) as conn, conn.begin():
            conn.execute(delete(blobs).where(blobs.c.sha256 == sha256))

    # -- inside a caller's transaction ------------------------------------------------------------

    def put_in(self, conn: Connection, data: bytes) -> str:
        """Insert or keep `data`; the no-op update locks the row (PostgreSQL) so a concurrent
        `release` cannot delete it between this put and the caller's commit."""
        digest = sha256_hex(data)
        conn.execute(self._upsert, {"sha256": digest, "size": len(data), "data": data})
        return digest

    def release(self, conn: Connection, digests: Iterable[str | None]) -> list[str]:
        """Delete each blob no segment (any session) still holds; returns those deleted.

        Forgotten segments hold nothing, nor do quarantined ones whose content retention retired
        (they keep only the hash). Rows are locked in sorted order first, so a concurrent `put_in`
        of the same content waits and either sees the blob gone (and re-inserts it) or is seen as
        a holder here.
        """
        deleted = []
        for digest in sorted({d for d in digests if d}):
            conn.execute(select(blobs.c.sha256).where(blobs.c.sha256 == digest).with_for_update()).all()
            holders = conn.execute(select(segments.c.state, segments.c.meta).where(
                segments.c.state != SegmentState.FORGOTTEN.value,
                or_(segments.c.content_sha256 == digest, segments.c.replacement_sha256 == digest),
            )).all()
            if any(not (h.state == SegmentState.QUARANTINED.value and h.meta.get(CONTENT_RETIRED)) for h in holders):
                continue
            if conn.execute(delete(blobs).where(blobs.c.sha256 == digest)).rowcount:
                deleted.append(digest)
        return deleted
