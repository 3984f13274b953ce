"""AuditLog: the append-only, signed Merkle log of erasures, stored with SQLAlchemy.

An append, under the database's write lock: read the head (``max(idx) + 1``) and the tree's right
edge (one stored node per set bit of the size), hash the new leaves, insert the record rows and the
perfect-subtree nodes they complete, sign a checkpoint when ``batch_size`` records have gathered
since the last one, commit. The index is returned only after the commit, so it is durable.
"""
from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy import Connection, func, insert, select

from . import db, layout
from .errors import AuditError, RecordNotFound
from .keys import Signer
from .layout import EXPORT_FORMAT
from .merkle import (
    CompactRange,
    ConsistencyProof,
    InclusionProof,
    consistency_ranges,
    cover,
    hash_leaf,
    inclusion_ranges,
    nodes_for,
    range_hash,
)
from .note import Checkpoint
from .records import AuditRecord, parse_time, rotation_message, validate

__all__ = ["EXPORT_FORMAT", "PROOF_FORMAT", "AuditLog"]

log = structlog.get_logger(__name__)

PROOF_FORMAT = "lethe-erasure-proof/1"
MAX_LIST = 1000


# Statements built once: building a select costs more than SQLite answers it (0.15 ms vs 0.02 ms),
# and these run in every append, under the write lock.
_SIZE = select(func.coalesce(func.max(db.records.c.idx) + 1, 0))
_HEAD = select(_SIZE.scalar_subquery(), select(func.coalesce(func.max(db.checkpoints.c.size), 0)).scalar_subquery())
_LATEST = select(db.checkpoints.c.size, db.checkpoints.c.note).order_by(db.checkpoints.c.size.desc()).limit(1)
_INSERT_RECORDS, _INSERT_NODES = insert(db.records), insert(db.nodes)  # built once: an append is latency-bound


@functools.lru_cache(maxsize=8)
def _time_us(text: str) -> int:
    """A record's stamped time in microseconds; a batch's records share one stamp, parsed once."""
    return _us(parse_time(text))


def _us(t: datetime) -> int:
    t = t if t.tzinfo else t.replace(tzinfo=timezone.utc)  # naive means UTC
    return int(t.timestamp() * 1_000_000)


def _record(row: Any) -> AuditRecord:
    body = json.loads(row.entry)
    return AuditRecord(row.idx, parse_time(body["time"]), body, row.leaf_hash.hex())


class AuditLog:
    """A transparency log of erasures. Safe to share between threads, processes and replicas."""

    def __init__(self, url: str, signer: Signer, *, origin: str = "lethe.local/audit", batch_size: int = 64) -> None:
        if not origin or "\n" in origin:
            raise AuditError("the audit origin must be one non-empty line, e.g. 'lethe.example.com/audit'")
        if batch_size < 1:
            raise AuditError("audit batch_size must be at least 1")
        self.origin = origin
        self.batch_size = batch_size
        self._signer = signer
        self._engine = db.make_engine(url)
        pg = self._engine.dialect.name == "postgresql"
        self._reader = self._engine.execution_options(isolation_level="AUTOCOMMIT") if pg else self._engine
        self._edge_cache = CompactRange()  # the right edge at the last size this process saw
        with db.write_transaction(self._engine) as conn:
            if conn.scalar(select(func.count()).select_from(db.keys)) == 0:
                self._add_key(conn, 0, signer, from_size=0)
                log.info("audit log created", origin=origin, key_id=signer.key_id)
            else:
                self._check_active_key(conn)

    @property
    def signer(self) -> Signer:
        return self._signer

    @property
    def size(self) -> int:
        with self._read() as conn:
            return self._size(conn)

    def close(self) -> None:
        self._engine.dispose()

    # --- appends -------------------------------------------------------------------------------

    def append(self, record: dict) -> int:
        """Validate, canonicalise and durably append one record; return its index."""
        return self.append_many([record])[0]

    @property
    def database(self) -> str:
        """The database this log lives in (password hidden): a store in the same one may share its commits."""
        return self._engine.url.render_as_string(hide_password=True)

    def append_many(self, records: Sequence[dict], *, alongside: Callable[[Connection], None] | None = None,
                    wait: bool = True) -> list[int]:
        """Append records in one transaction (one fsync): the way to batch for throughput.

        `alongside` writes another store's rows on this transaction's connection (a store in the
        same `database`), so they and the records commit together or not at all: one durable
        commit instead of two, and never one without the other. With `wait=False`, a write lock
        held by another writer raises `LogBusy` at once, and nothing (of either store) is written.
        """
        if not records:
            return []
        with db.write_transaction(self._engine, wait) as conn:
            if alongside is not None:
                alongside(conn)
            now = datetime.now(timezone.utc)
            size, signed = self._head(conn)
            indices, edge = self._append_locked(conn, size, [validate(r, now) for r in records])
            if edge.size - signed >= self.batch_size:
                self._checkpoint_locked(conn, edge)
        self._edge_cache = edge  # only after the commit: a rolled-back edge must not be reused
        return indices

    def append_keyed(self, keyed: Sequence[tuple[str, dict]]) -> list[int]:
        """Append each (key, record) unless a record with that key is in the log already; return
        each key's index. Exactly once across retries and crashes: the key is stored in the
        record's own transaction (the relay of a turn's audit intents, gateway/erasure.py)."""
        if not keyed:
            return []
        with db.write_transaction(self._engine) as conn:
            k = db.intents.c
            found = dict(conn.execute(select(k.key, k.idx).where(k.key.in_([key for key, _ in keyed]))).all())
            new = [(key, r) for key, r in keyed if key not in found]
            if new:
                size, signed = self._head(conn)
                now = datetime.now(timezone.utc)
                indices, edge = self._append_locked(conn, size, [validate(r, now) for _, r in new])
                conn.execute(insert(db.intents), [{"key": key, "idx": i} for (key, _), i in zip(new, indices)])
                found.update((key, i) for (key, _), i in zip(new, indices))
                if edge.size - signed >= self.batch_size:
                    self._checkpoint_locked(conn, edge)
        if new:
            self._edge_cache = edge
        return [found[key] for key, _ in keyed]

    def _append_locked(
        self, conn: Connection, size: int, prepared: Iterable[tuple[dict, bytes]]
    ) -> tuple[list[int], CompactRange]:
        edge = self._edge(conn, size)
        rows, node_rows = [], []
        for body, entry in prepared:
            leaf = hash_leaf(entry)
            rows.append({
                "idx": edge.size,
                "time_us": _time_us(body["time"]),
                "kind": body["kind"],
                "tenant": body.get("tenant"),
                "session": body.get("session"),
                "entry": entry,
                "leaf_hash": leaf,
            })
            node_rows += [{"id": db.node_id(lv, i), "hash": h} for lv, i, h in edge.append(leaf)]
        conn.execute(_INSERT_RECORDS, rows)
        conn.execute(_INSERT_NODES, node_rows)
        return [r["idx"] for r in rows], edge

    # --- checkpoints ---------------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """Sign the current tree head (or return the latest checkpoint if the tree has not grown)."""
        with db.write_transaction(self._engine) as conn:
            edge = self._edge(conn, self._size(conn))
            cp = self._checkpoint_locked(conn, edge)
        self._edge_cache = edge
        return cp

    def latest_checkpoint(self) -> Checkpoint:
        with self._read() as conn:
            row = conn.execute(select(db.checkpoints.c.note).order_by(db.checkpoints.c.size.desc()).limit(1)).first()
        return Checkpoint.from_note(row.note) if row else self.checkpoint()

    def checkpoints(self, *, max_size: int | None = None) -> list[Checkpoint]:
        """Every signed checkpoint (of at most ``max_size``), oldest first: what a monitor replays."""
        c = db.checkpoints.c
        query = select(c.note).order_by(c.size)
        if max_size is not None:
            query = query.where(c.size <= max_size)
        with self._read() as conn:
            return [Checkpoint.from_note(note) for note in conn.execute(query).scalars()]

    def _checkpoint_locked(self, conn: Connection, edge: CompactRange) -> Checkpoint:
        row = conn.execute(_LATEST).first()
        if row and row.size == edge.size:
            return Checkpoint.from_note(row.note)
        if row and row.size > edge.size:
            raise AuditError(
                f"the audit database holds {edge.size} records but checkpoint {row.size} was signed: "
                "records were deleted behind the log's back; restore the database from backup"
            )
        self._check_active_key(conn)
        cp = Checkpoint.sign(self.origin, edge.size, edge.root(), self._signer)
        conn.execute(insert(db.checkpoints), {
            "size": cp.size, "root_hash": cp.root_hash, "key_id": self._signer.key_id,
            "time_us": _us(datetime.now(timezone.utc)), "note": cp.note,
        })
        log.debug("audit checkpoint", size=cp.size, key_id=self._signer.key_id)
        return cp

    def _head(self, conn: Connection) -> tuple[int, int]:
        """(records, size of the latest checkpoint) in one round trip: appends are latency-bound."""
        row = conn.execute(_HEAD).one()
        return row[0], row[1]

    def _checkpoint_covering(self, index: int) -> Checkpoint:
        cp = self.latest_checkpoint()
        return cp if index < cp.size else self.checkpoint()

    # --- keys ----------------------------------------------------------------------------------

    def rotate_key(self, new_signer: Signer) -> int:
        """Hand the log over to ``new_signer``; return the index of the key-rotation record.

        The record carries the new public key and the old key's signature over the hand-over, and
        the checkpoint that first covers it is signed by the old key; later ones by the new key.
        """
        if new_signer.key_id == self._signer.key_id:
            raise AuditError("the new audit key is the key already in use")
        old = self._signer
        with db.write_transaction(self._engine) as conn:
            self._check_active_key(conn)
            key = {
                "origin": self.origin,
                "old_key_id": old.key_id,
                "old_key_name": old.name,
                "new_key_id": new_signer.key_id,
                "new_key_name": new_signer.name,
                "new_public_key": base64.b64encode(new_signer.verifier.raw).decode(),
            }
            key["signature"] = base64.b64encode(old.sign(rotation_message(key))).decode()
            (index,), edge = self._append_locked(conn, self._size(conn), [validate({"kind": "key-rotation", "key": key}, datetime.now(timezone.utc))])
            self._checkpoint_locked(conn, edge)
            seq = conn.scalar(select(func.max(db.keys.c.seq))) + 1
            self._add_key(conn, seq, new_signer, from_size=index + 2)
        self._edge_cache = edge
        self._signer = new_signer
        log.info("audit key rotated", index=index, old_key_id=old.key_id, new_key_id=new_signer.key_id)
        return index

    def keys(self) -> list[dict[str, Any]]:
        """The key chain, genesis first: what signs checkpoints from which size on."""
        with self._read() as conn:
            rows = conn.execute(select(db.keys).order_by(db.keys.c.seq)).all()
        return [{"key_id": r.key_id, "name": r.name, "public_key_pem": r.public_key_pem, "from_size": r.from_size} for r in rows]

    def public_key(self) -> dict[str, Any]:
        v = self._signer.verifier
        return {"name": v.name, "key_id": v.key_id, "public_key_pem": v.public_key_pem, "vkey": v.vkey, "keys": self.keys()}

    def _add_key(self, conn: Connection, seq: int, signer: Signer, *, from_size: int) -> None:
        conn.execute(insert(db.keys), {
            "seq": seq, "key_id": signer.key_id, "name": signer.name,
            "public_key_pem": signer.public_key_pem, "from_size": from_size,
        })

    def _check_active_key(self, conn: Connection) -> None:
        active = conn.execute(select(db.keys.c.key_id, db.keys.c.name).order_by(db.keys.c.seq.desc()).limit(1)).one()
        if (active.key_id, active.name) != (self._signer.key_id, self._signer.name):
            raise AuditError(
                f"this process signs with audit key {self._signer.name} {self._signer.key_id}, but the log's "
                f"active key is {active.name} {active.key_id} (rotated by another replica?); restart with that key"
            )

    # --- reads ---------------------------------------------------------------------------------

    def get(self, index: int) -> AuditRecord:
        with self._read() as conn:
            row = conn.execute(select(db.records).where(db.records.c.idx == index)).first()
        if row is None:
            raise RecordNotFound(f"no audit record {index}")
        return _record(row)

    def list(
        self,
        *,
        tenant: str | None = None,
        session: str | None = None,
        kind: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 50,
        after: int | None = None,
    ) -> list[AuditRecord]:
        """Records in index order, filtered; page with ``after`` = the last index seen. tenant None = all."""
        r = db.records.c
        query = select(db.records).order_by(r.idx).limit(max(1, min(limit, MAX_LIST)))
        for column, value in ((r.tenant, tenant), (r.session, session), (r.kind, kind)):
            if value is not None:
                query = query.where(column == value)
        if since is not None:
            query = query.where(r.time_us >= _us(since))
        if until is not None:
            query = query.where(r.time_us < _us(until))
        if after is not None:
            query = query.where(r.idx > after)
        with self._read() as conn:
            return [_record(row) for row in conn.execute(query)]

    # --- proofs --------------------------------------------------------------------------------

    def inclusion_proof(self, index: int, tree_size: int | None = None) -> InclusionProof:
        """Proof that record ``index`` is in the tree of ``tree_size`` (default: the latest checkpoint)."""
        size = self._checkpoint_covering(index).size if tree_size is None else tree_size
        ranges = inclusion_ranges(index, size)
        with self._read() as conn:
            nodes = self._nodes(conn, nodes_for(ranges), tree_size=size)
        return InclusionProof(index, size, tuple(range_hash(a, b, nodes) for a, b in ranges))

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> ConsistencyProof:
        """Proof that the tree of ``old_size`` is a prefix of ``new_size`` (default: the latest checkpoint)."""
        new = self.latest_checkpoint().size if new_size is None else new_size
        ranges = consistency_ranges(old_size, new)
        with self._read() as conn:
            nodes = self._nodes(conn, nodes_for(ranges), tree_size=new)
        return ConsistencyProof(old_size, new, tuple(range_hash(a, b, nodes) for a, b in ranges))

    def erasure_proof(self, index: int) -> dict[str, Any]:
        """Everything an auditor needs, offline, to check that record ``index`` is in the signed log."""
        record = self.get(index)
        cp = self._checkpoint_covering(index)
        key = next(k for k in reversed(self.keys()) if k["from_size"] <= cp.size)
        return {
            "format": PROOF_FORMAT,
            "record": record.to_dict(),
            "checkpoint": cp.note,
            "inclusion_proof": self.inclusion_proof(index, cp.size).to_dict(),
            "public_key": {"name": key["name"], "key_id": key["key_id"], "public_key_pem": key["public_key_pem"]},
        }

    def _read(self) -> Connection:
        """A connection for reads. On PostgreSQL in autocommit: no BEGIN/ROLLBACK round trips per
        proof, and rows never change, so one statement's snapshot is as good as a transaction's."""
        return self._reader.connect()

    def _size(self, conn: Connection) -> int:
        return conn.scalar(_SIZE)

    def _nodes(self, conn: Connection, keys: set[tuple[int, int]], tree_size: int = 0) -> dict[tuple[int, int], bytes]:
        if not keys:
            return {}
        ids = {db.node_id(level, index): (level, index) for level, index in keys}
        rows = conn.execute(select(db.nodes.c.id, db.nodes.c.hash).where(db.nodes.c.id.in_(list(ids))))
        found = {ids[r.id]: r.hash for r in rows}
        if len(found) != len(keys):
            if tree_size > self._size(conn):
                raise AuditError(f"the audit log has fewer than {tree_size} records")
            missing = sorted(keys - found.keys())[:3]
            raise AuditError(f"audit_nodes lacks nodes {missing}: the database was changed outside the log")
        return found

    def _edge(self, conn: Connection, size: int) -> CompactRange:
        cached = self._edge_cache
        if cached.size == size:  # nodes never change, so the same size means the same edge
            return cached.copy()
        keys = cover(0, size)
        nodes = self._nodes(conn, set(keys))
        return CompactRange(size, [nodes[k] for k in keys])

    # --- export --------------------------------------------------------------------------------

    def export(self, path: Path) -> None:
        """Write the self-contained export document (see ``export_chunks``) to ``path``."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(self.export_chunks())
        tmp.replace(path)

    def export_chunks(self) -> Iterator[str]:
        """The export as JSON text pieces: keys, every checkpoint, every record (streamed).

        The tree is first checkpointed so that every record is covered by a signature. A log that
        holds fewer records than its latest checkpoint is exported as it is, for the verifier to
        name what is missing.
        """
        cp = self.latest_checkpoint()
        if self.size > cp.size:
            cp = self.checkpoint()
        header = {"format": EXPORT_FORMAT, "origin": self.origin, "size": cp.size, "keys": self.keys()}
        with self._engine.connect() as conn:  # one transaction: streamed with a server-side cursor
            c = db.checkpoints.c
            notes = conn.execute(select(c.note).where(c.size <= cp.size).order_by(c.size))
            yield layout.head(header, (row.note for row in notes))
            rows = conn.execution_options(yield_per=2000).execute(
                select(db.records.c.idx, db.records.c.entry, db.records.c.leaf_hash)
                .where(db.records.c.idx < cp.size)
                .order_by(db.records.c.idx)
            )
            for i, row in enumerate(rows):
                yield ((b"" if i == 0 else layout.RECORD_SEPARATOR) + layout.record(row.idx, row.leaf_hash.hex(), row.entry)).decode()
        yield layout.TAIL.decode()
