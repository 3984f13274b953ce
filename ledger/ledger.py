"""The segment ledger: which message occupies which token range of a session's KV cache.

The kernel owns the cache; the ledger owns the bookkeeping. Every mutation is one database
transaction that first locks the session row (PostgreSQL `FOR UPDATE`, SQLite's writer lock), so
replicas sharing a database serialize per session, and (with `check_invariants`) re-verifies the
tiling before commit, so a violation rolls the whole operation back.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import structlog
from sqlalchemy import Connection, Row, bindparam, delete, exc, insert, or_, select, update

from .content import ContentStore, sha256_hex
from .crossings import CrossingLog
from .errors import ErasureIncomplete, LedgerError, UnknownSegment, UnknownSession
from .invariants import verify_tiling
from .toolcalls import ToolCallLog
from .records import CONTENT_RETIRED, IN_CACHE, Segment, SegmentState, SessionRecord
from .schema import WRITE, blobs, intents, make_engine, metadata, segments, sessions

log = structlog.get_logger(__name__)

_APPENDABLE = frozenset({SegmentState.LIVE, SegmentState.QUARANTINED})
_AMORTIZABLE = frozenset({SegmentState.LIVE, SegmentState.AMORTIZED})
_IN_CACHE_VALUES = [s.value for s in IN_CACHE]

# The append path's statements, built once: constructing and cache-keying a Core statement per
# call cost more CPU than the SQLite write itself (~2 ms of a 2.7 ms append).
_LOCK_SESSION = select(sessions).where(sessions.c.id == bindparam("session_id")).with_for_update()
_INSERT_SEGMENT = insert(segments)
_ADVANCE_SESSION = (update(sessions).where(sessions.c.id == bindparam("session_id"))
                    .values(token_count=bindparam("new_count"), next_seq=bindparam("new_seq")))


@dataclass(frozen=True)
class NewSegment:
    """A segment a turn will append: everything `append` takes."""

    role: str
    tool: str | None
    content: bytes
    n_tokens: int
    state: SegmentState = SegmentState.LIVE
    data_class: str = "normal"
    meta: dict[str, Any] = field(default_factory=dict)
    replacement: bytes | None = None  # a redacted tool result: only these bytes are stored (see `append`)


@dataclass(frozen=True)
class Intent:
    """Work a committed turn still owes (its audit records, its post-turn forgets), stored in the
    turn's own transaction so that a crash before the work is done cannot lose it."""

    id: str
    session_id: str
    kind: str
    payload: dict[str, Any]
    created_at: datetime


IntentsOf = Callable[[Sequence[Segment]], Sequence[tuple[str, dict[str, Any]]]]
"""Given a turn's appended segments, the (kind, payload) of each intent to store with them."""


@dataclass(frozen=True)
class TurnWrite:
    """What `write_turn` changed, so that `undo_turn` can put the session back exactly."""

    session_id: str
    appended: tuple[Segment, ...]
    superseded: tuple[Segment, ...]  # as they were before the write
    token_count: int
    next_seq: int
    intents: tuple[Intent, ...] = ()


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _utc(value: datetime) -> datetime:
    """SQLite drops the zone; every datetime the ledger stores and returns is UTC."""
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _new_segment_id() -> str:
    return "seg_" + secrets.token_hex(12)


def _segment(row: Row[Any]) -> Segment:
    return Segment(
        id=row.id,
        session_id=row.session_id,
        seq=row.seq,
        role=row.role,
        tool=row.tool,
        content_sha256=row.content_sha256,
        start=row.tok_start,
        end=row.tok_end,
        state=SegmentState(row.state),
        created_at=_utc(row.created_at),
        data_class=row.data_class,
        meta=dict(row.meta),
        replacement_sha256=row.replacement_sha256,
    )


def _session(row: Row[Any]) -> SessionRecord:
    return SessionRecord(
        id=row.id, tenant=row.tenant, user=row.user, created_at=_utc(row.created_at), salt_scope=row.salt_scope
    )


def _shift_after(conn: Connection, session_id: str, seq: int, delta: int) -> None:
    """Renumber every segment after `seq` by `delta` tokens (dead ones too: they keep their place)."""
    if delta:
        conn.execute(
            update(segments)
            .where(segments.c.session_id == session_id, segments.c.seq > seq)
            .values(tok_start=segments.c.tok_start + delta, tok_end=segments.c.tok_end + delta)
        )


class Ledger:
    """Per-session segment lists persisted through SQLAlchemy (SQLite by default, PostgreSQL supported)."""

    def __init__(
        self, url: str, *, check_invariants: bool = True, clock: Callable[[], datetime] = _utcnow
    ) -> None:
        self._engine = make_engine(url)
        self._check = check_invariants
        self._clock = clock
        # An in-memory SQLite database is one shared connection; threads must take turns on it.
        in_memory = self._engine.dialect.name == "sqlite" and self._engine.url.database in (None, "", ":memory:")
        self._serial: AbstractContextManager[object] = threading.RLock() if in_memory else nullcontext()
        self._sqlite_file = self._engine.dialect.name == "sqlite" and not in_memory
        metadata.create_all(self._engine, checkfirst=True)
        self.content = ContentStore(self._engine, self._serial)
        self.crossings = CrossingLog(self._engine, self._serial)
        self.tool_calls = ToolCallLog(self._engine, self._serial)

    def close(self) -> None:
        self._engine.dispose()

    # -- erasure at rest --------------------------------------------------------------------------

    def scrub(self, timeout_s: float = 5.0) -> None:
        """Make erased content unrecoverable from the database files (SQLite); raises ErasureIncomplete.

        With `secure_delete=ON` (set on every connection) a deleted row's bytes are zeroed in its
        page, but in WAL mode the page images from before the delete stay in `lethe.db-wal` until
        a checkpoint copies the zeroed pages back and the WAL is truncated. `wal_checkpoint(TRUNCATE)`
        does both; it cannot while a reader still holds a snapshot older than the erasure, which
        is reported, not ignored. PostgreSQL: nothing to do per erasure; see `vacuum()` and
        ledger/README.md for what stays in dead tuples and WAL until then.
        """
        if not self._sqlite_file:
            return
        deadline = time.monotonic() + timeout_s
        while True:  # another connection's checkpoint in progress answers busy at once: retry
            busy, wal_frames = self._checkpoint(max(deadline - time.monotonic(), 0.0))
            if not busy:
                return
            if time.monotonic() >= deadline:
                raise ErasureIncomplete(
                    f"erased content may still be in the SQLite WAL ({wal_frames} frames): readers or other "
                    f"checkpoints kept it busy for {timeout_s:g} s; the rows are erased, call Ledger.scrub() again"
                )
            time.sleep(0.02)

    def _checkpoint(self, timeout_s: float) -> tuple[int, int]:
        with self._serial:
            raw = self._engine.raw_connection()
            try:
                cursor = raw.cursor()
                cursor.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
                busy, wal_frames, _copied = cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                cursor.execute("PRAGMA busy_timeout=30000")
                cursor.close()
            finally:
                raw.close()
        return busy, wal_frames

    def vacuum(self) -> None:
        """Rewrite the ledger's storage so that no erased byte survives in it (run off-peak).

        SQLite: VACUUM (rebuilds the file: free pages and their history go) and a truncating
        checkpoint. PostgreSQL: VACUUM FULL of the ledger tables (a new heap and TOAST file; the
        old files are unlinked, with dead tuples in them) and a CHECKPOINT, after which the WAL
        segments holding the old rows are recycled; archived WAL (archive_command) and base
        backups keep them until their own expiry, which this cannot reach (ledger/README.md).
        """
        if self._engine.dialect.name == "sqlite":
            if self._sqlite_file:  # outside any transaction: the raw connection is in autocommit
                with self._serial:
                    raw = self._engine.raw_connection()
                    try:
                        raw.cursor().execute("VACUUM")
                    finally:
                        raw.close()
        else:
            with self._engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql(f"VACUUM (FULL, ANALYZE) {blobs.name}, {segments.name}, {sessions.name}")
                try:
                    conn.exec_driver_sql("CHECKPOINT")
                except exc.DBAPIError as err:  # needs superuser or pg_checkpoint
                    log.warning("ledger.vacuum_checkpoint_refused", error=str(err.orig).strip())
        self.scrub()
        log.info("ledger.vacuum", backend=self._engine.dialect.name)

    def holders(self, sha256: str) -> list[Segment]:
        """Every segment, in any session, that still holds stored content with this digest."""
        with self._read() as conn:
            rows = conn.execute(select(segments).where(
                segments.c.state != SegmentState.FORGOTTEN.value,
                or_(segments.c.content_sha256 == sha256, segments.c.replacement_sha256 == sha256),
            ).order_by(segments.c.session_id, segments.c.seq)).all()
        return [seg for seg in map(_segment, rows) if not (seg.state is SegmentState.QUARANTINED and seg.content_retired)]

    def _erased(self, digests: set[str]) -> None:
        """After an erasing commit: every digest no segment holds any more must be gone, on disk too."""
        for digest in sorted(digests):
            if not self.holders(digest) and self.content.exists(digest):
                raise ErasureIncomplete(f"content {digest} has no holder but is still stored; nothing may report "
                                        "this erasure as done (delete it with ContentStore.delete, then scrub)")
        self.scrub()

    # -- transactions -----------------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._serial, self._engine.connect() as conn, conn.begin():
            yield conn

    @contextmanager
    def _write(self, session_id: str) -> Iterator[tuple[Connection, Row[Any]]]:
        """One transaction holding the session's lock; invariants are verified before commit."""
        with self._serial, self._engine.connect().execution_options(**{WRITE: True}) as conn, conn.begin():
            row = conn.execute(_LOCK_SESSION, {"session_id": session_id}).first()
            if row is None:
                raise UnknownSession(f"session {session_id!r} does not exist; create it with create_session first")
            yield conn, row
            if self._check:
                self._verify(conn, session_id)

    def _verify(self, conn: Connection, session_id: str, cache_len: int | None = None) -> None:
        count = conn.execute(select(sessions.c.token_count).where(sessions.c.id == session_id)).scalar_one()
        verify_tiling(session_id, self._segments(conn, session_id, include_dead=True), count, cache_len)

    # -- sessions ---------------------------------------------------------------------------------

    def create_session(
        self, session_id: str, tenant: str, user: str | None = None, salt_scope: str | None = None
    ) -> SessionRecord:
        record = SessionRecord(id=session_id, tenant=tenant, user=user, created_at=self._clock(), salt_scope=salt_scope)
        try:
            with self._serial, self._engine.connect().execution_options(**{WRITE: True}) as conn, conn.begin():
                conn.execute(
                    insert(sessions).values(
                        id=session_id, tenant=tenant, user=user, salt_scope=salt_scope,
                        created_at=record.created_at, token_count=0, next_seq=0,
                    )
                )
        except exc.IntegrityError:
            raise LedgerError(f"session {session_id!r} already exists; session ids must be unique") from None
        log.info("ledger.session_created", session_id=session_id, tenant=tenant)
        return record

    def get_session(self, session_id: str, tenant: str | None = None) -> SessionRecord | None:
        """The session, or None if absent or owned by another tenant (tenant=None: unscoped, admin)."""
        query = select(sessions).where(sessions.c.id == session_id)
        if tenant is not None:
            query = query.where(sessions.c.tenant == tenant)
        with self._read() as conn:
            row = conn.execute(query).first()
        return None if row is None else _session(row)

    def list_sessions(self, tenant: str | None = None) -> list[SessionRecord]:
        query = select(sessions).order_by(sessions.c.created_at, sessions.c.id)
        if tenant is not None:
            query = query.where(sessions.c.tenant == tenant)
        with self._read() as conn:
            return [_session(r) for r in conn.execute(query)]

    # -- reads ------------------------------------------------------------------------------------

    def _segments(self, conn: Connection, session_id: str, *, include_dead: bool) -> list[Segment]:
        query = select(segments).where(segments.c.session_id == session_id).order_by(segments.c.seq)
        if not include_dead:
            query = query.where(segments.c.state.in_(_IN_CACHE_VALUES))
        return [_segment(r) for r in conn.execute(query)]

    def _require_session(self, conn: Connection, session_id: str) -> int:
        count = conn.execute(select(sessions.c.token_count).where(sessions.c.id == session_id)).scalar_one_or_none()
        if count is None:
            raise UnknownSession(f"session {session_id!r} does not exist; create it with create_session first")
        return count

    def segments(self, session_id: str, *, include_dead: bool = True) -> list[Segment]:
        """The session's segments in seq order (= cache order); dead ones have empty ranges."""
        with self._read() as conn:
            self._require_session(conn, session_id)
            return self._segments(conn, session_id, include_dead=include_dead)

    def get_segment(self, session_id: str, segment_id: str) -> Segment | None:
        with self._read() as conn:
            row = conn.execute(
                select(segments).where(segments.c.session_id == session_id, segments.c.id == segment_id)
            ).first()
        return None if row is None else _segment(row)

    def find_by_content(self, session_id: str, content_sha256: str) -> list[Segment]:
        """Segments of the session whose client-sent content has this digest, in seq order."""
        with self._read() as conn:
            rows = conn.execute(
                select(segments)
                .where(segments.c.session_id == session_id, segments.c.content_sha256 == content_sha256)
                .order_by(segments.c.seq)
            )
            return [_segment(r) for r in rows]

    def token_count(self, session_id: str) -> int:
        with self._read() as conn:
            return self._require_session(conn, session_id)

    def check_invariants(self, session_id: str, cache_len: int | None = None) -> None:
        """Raise LedgerInvariantError unless the segments tile [0, token_count) (and match the cache)."""
        with self._read() as conn:
            self._require_session(conn, session_id)
            self._verify(conn, session_id, cache_len)

    def expired(self, now: datetime, ttl_for: Callable[[SessionRecord, Segment], float | None]) -> list[Segment]:
        """Segments still in the cache whose age in seconds exceeds `ttl_for(session, segment)`.

        None from `ttl_for` keeps the segment. A naive `now` is taken as UTC. Across all sessions,
        ordered by session and seq, for the retention sweeper to forget.
        """
        now = _utc(now)
        query = (
            select(segments, sessions.c.tenant, sessions.c.user, sessions.c.salt_scope,
                   sessions.c.created_at.label("session_created_at"))
            .join(sessions, sessions.c.id == segments.c.session_id)
            .where(segments.c.state.in_(_IN_CACHE_VALUES))
            .order_by(segments.c.session_id, segments.c.seq)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        out = []
        for row in rows:
            seg = _segment(row)
            if seg.content_retired:
                continue
            record = SessionRecord(
                id=row.session_id, tenant=row.tenant, user=row.user,
                created_at=_utc(row.session_created_at), salt_scope=row.salt_scope,
            )
            ttl = ttl_for(record, seg)
            if ttl is not None and (now - seg.created_at).total_seconds() > ttl:
                out.append(seg)
        return out

    # -- mutations --------------------------------------------------------------------------------

    def _load(self, conn: Connection, session_id: str, segment_ids: Sequence[str]) -> list[Segment]:
        rows = conn.execute(
            select(segments).where(segments.c.session_id == session_id, segments.c.id.in_(segment_ids))
        ).all()
        found = {r.id: _segment(r) for r in rows}
        missing = [i for i in segment_ids if i not in found]
        if missing:
            raise UnknownSegment(f"session {session_id!r} has no segment {', '.join(missing)}; nothing was changed")
        return sorted(found.values(), key=lambda s: s.seq)

    def append(
        self,
        session_id: str,
        *,
        role: str,
        tool: str | None,
        content: bytes,
        n_tokens: int,
        state: SegmentState = SegmentState.LIVE,
        data_class: str = "normal",
        meta: dict[str, Any] | None = None,
        replacement: bytes | None = None,
    ) -> Segment:
        """Add a segment at the tail of the cache: [token_count, token_count + n_tokens).

        For a QUARANTINED segment, `n_tokens` counts the stub that entered the cache in place of
        the content; `content` is what identifies it (typically the original tool result, so that a
        re-sent history finds the segment with `find_by_content`).

        With `replacement` (a redacted tool result), only the replacement is stored: `content`
        gives the segment its identity (its digest), but its bytes, which held the secret, are not
        kept anywhere.
        """
        state = SegmentState(state)
        if state not in _APPENDABLE:
            raise LedgerError(f"append takes a live or quarantined segment, not {state.value}")
        if n_tokens < 0:
            raise LedgerError(f"n_tokens must be >= 0, got {n_tokens}")
        with self._write(session_id) as (conn, sess):
            seg = Segment(
                id=_new_segment_id(), session_id=session_id, seq=sess.next_seq, role=role, tool=tool,
                content_sha256=self._stored(conn, content, replacement, state, meta or {}),
                start=sess.token_count, end=sess.token_count + n_tokens, state=state, created_at=self._clock(),
                data_class=data_class, meta=dict(meta or {}),
                replacement_sha256=self.content.put_in(conn, replacement) if replacement is not None else None,
            )
            conn.execute(_INSERT_SEGMENT, {
                "id": seg.id, "session_id": session_id, "seq": seg.seq, "role": role, "tool": tool,
                "content_sha256": seg.content_sha256, "tok_start": seg.start, "tok_end": seg.end, "state": state.value,
                "created_at": seg.created_at, "data_class": data_class, "meta": seg.meta,
                "replacement_sha256": seg.replacement_sha256,
            })
            conn.execute(_ADVANCE_SESSION, {"session_id": session_id, "new_count": seg.end, "new_seq": seg.seq + 1})
        log.debug("ledger.append", session_id=session_id, segment_id=seg.id, state=state.value, n_tokens=n_tokens)
        return seg

    def _stored(self, conn: Connection, content: bytes, replacement: bytes | None, state: SegmentState,
                meta: Mapping[str, Any]) -> str:
        """The digest of a new segment's content, stored in the blob store only when its bytes are
        to be kept: not a redacted result's (only its replacement is kept), nor a quarantined
        one's born retired (bytes a boundary already withheld, red team 14: pasted into chat they
        were kept here though the MCP proxy had kept only their digests)."""
        if replacement is not None or (state is SegmentState.QUARANTINED and meta.get(CONTENT_RETIRED)):
            return sha256_hex(content)
        return self.content.put_in(conn, content)

    def write_turn(self, session_id: str, *, keep: int, new: Sequence[NewSegment],
                   intents_of: IntentsOf | None = None) -> TurnWrite:
        """One chat turn's ledger writes in one transaction: all or nothing.

        The conversation is the session's non-superseded segments in seq order. Every segment
        after its first `keep` leaves it (SUPERSEDED, empty range at the cut), forgotten ones
        included: a rewritten history must not keep dead segments in its middle, where every
        later request would mismatch them. Then `new` is appended at the cut, and with it the
        intents `intents_of` names for the appended segments (see `Intent`).
        """
        with self._write(session_id) as (conn, sess):
            conversation = [s for s in self._segments(conn, session_id, include_dead=True)
                            if s.state is not SegmentState.SUPERSEDED]
            kept, cut = conversation[:keep], conversation[keep:]
            at = kept[-1].end if kept else 0
            if cut:
                conn.execute(update(segments).where(segments.c.id.in_([s.id for s in cut]))
                             .values(state=SegmentState.SUPERSEDED.value, tok_start=at, tok_end=at))
            seq, appended = sess.next_seq, []
            for item in new:
                state = SegmentState(item.state)
                if state not in _APPENDABLE or item.n_tokens < 0:
                    raise LedgerError(f"a turn appends live or quarantined segments of >= 0 tokens, not {item}")
                replacement = item.replacement
                seg = Segment(id=_new_segment_id(), session_id=session_id, seq=seq, role=item.role, tool=item.tool,
                              content_sha256=self._stored(conn, item.content, replacement, state, item.meta),
                              start=at, end=at + item.n_tokens, state=state, created_at=self._clock(),
                              data_class=item.data_class, meta=dict(item.meta),
                              replacement_sha256=None if replacement is None else self.content.put_in(conn, replacement))
                conn.execute(_INSERT_SEGMENT, {
                    "id": seg.id, "session_id": session_id, "seq": seg.seq, "role": seg.role, "tool": seg.tool,
                    "content_sha256": seg.content_sha256, "tok_start": seg.start, "tok_end": seg.end,
                    "state": state.value, "created_at": seg.created_at, "data_class": seg.data_class,
                    "meta": seg.meta, "replacement_sha256": seg.replacement_sha256})
                appended.append(seg)
                seq, at = seq + 1, seg.end
            conn.execute(_ADVANCE_SESSION, {"session_id": session_id, "new_count": at, "new_seq": seq})
            owed = self._store_intents(conn, session_id, intents_of(appended) if intents_of else ())
        log.debug("ledger.write_turn", session_id=session_id, superseded=len(cut), appended=len(appended),
                  intents=len(owed))
        return TurnWrite(session_id, tuple(appended), tuple(cut), sess.token_count, sess.next_seq, owed)

    def _store_intents(self, conn: Connection, session_id: str,
                       items: Sequence[tuple[str, dict[str, Any]]]) -> tuple[Intent, ...]:
        owed = tuple(Intent("int_" + secrets.token_hex(12), session_id, kind, payload, self._clock())
                     for kind, payload in items)
        if owed:
            conn.execute(insert(intents), [{"id": i.id, "session_id": i.session_id, "kind": i.kind,
                                            "payload": i.payload, "created_at": i.created_at} for i in owed])
        return owed

    def pending_intents(self, kind: str | None = None, session_id: str | None = None) -> list[Intent]:
        """Intents not yet done, oldest first (all sessions unless `session_id`)."""
        query = select(intents).order_by(intents.c.created_at, intents.c.id)
        if kind is not None:
            query = query.where(intents.c.kind == kind)
        if session_id is not None:
            query = query.where(intents.c.session_id == session_id)
        with self._read() as conn:
            return [Intent(r.id, r.session_id, r.kind, dict(r.payload), _utc(r.created_at)) for r in conn.execute(query)]

    def intent_done(self, intent_id: str) -> None:
        """The intent's work is done (and durable where it went): drop it. Idempotent."""
        with self._serial, self._engine.connect().execution_options(**{WRITE: True}) as conn, conn.begin():
            conn.execute(delete(intents).where(intents.c.id == intent_id))

    def undo_turn(self, write: TurnWrite) -> None:
        """Put the session back as it was before `write` (a later step of the turn failed)."""
        with self._write(write.session_id) as (conn, _sess):
            ids = [s.id for s in write.appended]
            if write.intents:
                conn.execute(delete(intents).where(intents.c.id.in_([i.id for i in write.intents])))
            if ids:
                conn.execute(delete(segments).where(segments.c.id.in_(ids)))
            for seg in write.superseded:
                conn.execute(update(segments).where(segments.c.id == seg.id)
                             .values(state=seg.state.value, tok_start=seg.start, tok_end=seg.end))
            conn.execute(_ADVANCE_SESSION, {"session_id": write.session_id, "new_count": write.token_count,
                                            "new_seq": write.next_seq})
            self.content.release(conn, [d for s in write.appended for d in (s.content_sha256, s.replacement_sha256) if d])
        log.info("ledger.undo_turn", session_id=write.session_id, removed=len(write.appended))

    def forget(self, session_id: str, segment_ids: Sequence[str]) -> list[Segment]:
        """Exact erasure in the ledger: all listed segments become FORGOTTEN with empty ranges and
        every later segment moves down; stored content no other non-forgotten segment references
        is deleted in the same transaction. All or nothing. Already forgotten segments stay as
        they are (a repeated erasure request is not an error). Returns the segments, seq order.
        """
        ids = list(dict.fromkeys(segment_ids))
        if not ids:
            return []
        with self._write(session_id) as (conn, sess):
            targets = self._load(conn, session_id, ids)
            targets = sorted(targets + self._superseded_copies(conn, session_id, targets), key=lambda s: s.seq)
            ids = [s.id for s in targets]
            # Right to left: each shift then moves only segments whose positions are still final.
            removed = 0
            for seg in reversed(targets):
                if seg.state is SegmentState.FORGOTTEN:
                    continue
                conn.execute(
                    update(segments).where(segments.c.id == seg.id)
                    .values(state=SegmentState.FORGOTTEN.value, tok_end=segments.c.tok_start)
                )
                _shift_after(conn, session_id, seg.seq, -seg.n_tokens)
                removed += seg.n_tokens
            conn.execute(
                update(sessions).where(sessions.c.id == session_id).values(token_count=sess.token_count - removed)
            )
            erased = self.content.release(
                conn, [d for s in targets for d in (s.content_sha256, s.replacement_sha256)]
            )
            result = self._load(conn, session_id, ids)
        log.info("ledger.forget", session_id=session_id, segment_ids=ids, tokens=removed, blobs_erased=len(erased))
        self._erased({d for s in targets for d in (s.content_sha256, s.replacement_sha256) if d})
        return result

    @staticmethod
    def _superseded_copies(conn: Connection, session_id: str, targets: list[Segment]) -> list[Segment]:
        """Superseded segments of the session holding the same content as a forget target.

        A history rewrite leaves the old segment SUPERSEDED with its blob; when the client re-sends
        the content and it is forgotten, the superseded copy must go too, or the blob survives.
        """
        digests = {s.content_sha256 for s in targets}
        rows = conn.execute(select(segments).where(
            segments.c.session_id == session_id, segments.c.state == SegmentState.SUPERSEDED.value,
            segments.c.content_sha256.in_(digests), segments.c.id.not_in([s.id for s in targets]),
        )).all()
        return [_segment(r) for r in rows]

    def sweep_superseded(self, now: datetime, ttl_for: Callable[[SessionRecord, Segment], float | None]) -> list[Segment]:
        """Retention for superseded segments (out of the cache, content still stored): forget each
        whose age exceeds `ttl_for(session, segment)` (None keeps it). Returns the forgotten ones.

        No kernel work is needed (their ranges are empty), so this runs in the ledger alone; the
        caller writes the audit records."""
        now = _utc(now)
        query = (select(segments).where(segments.c.state == SegmentState.SUPERSEDED.value)
                 .order_by(segments.c.session_id, segments.c.seq))
        with self._read() as conn:
            rows = conn.execute(query).all()
        due: dict[str, list[str]] = {}
        for seg in map(_segment, rows):
            record = self.get_session(seg.session_id)
            ttl = ttl_for(record, seg) if record is not None else None
            if ttl is not None and (now - seg.created_at).total_seconds() > ttl:
                due.setdefault(seg.session_id, []).append(seg.id)
        return [seg for sid, ids in due.items() for seg in self.forget(sid, ids)]

    def retire_content(self, session_id: str, segment_ids: Sequence[str]) -> list[Segment]:
        """Retention for quarantined segments: the stub stays in the cache, the withheld content goes.

        Each listed quarantined segment is marked retired (once) and its blob erased unless
        another segment still holds the same bytes; its hash stays, so a re-sent history still
        finds it. Returns the segments this call retired; others (not quarantined, or retired
        already) are left as they are.
        """
        with self._write(session_id) as (conn, _sess):
            targets = [s for s in self._load(conn, session_id, list(dict.fromkeys(segment_ids)))
                       if s.state is SegmentState.QUARANTINED and not s.content_retired]
            for seg in targets:
                conn.execute(update(segments).where(segments.c.id == seg.id)
                             .values(meta={**seg.meta, CONTENT_RETIRED: True}))
            erased = self.content.release(conn, [s.content_sha256 for s in targets])
            retired = self._load(conn, session_id, [s.id for s in targets]) if targets else []
        log.info("ledger.retire_content", session_id=session_id, segment_ids=[s.id for s in retired],
                 blobs_erased=len(erased))
        self._erased({s.content_sha256 for s in retired})
        return retired

    def amortize(
        self, session_id: str, segment_id: str, replacement_tokens: int, replacement_content: bytes
    ) -> Segment:
        """Replace a segment's tokens with `replacement_tokens` tokens of `replacement_content`;
        later segments move by the difference. NOT erasure: later tokens still carry the original's
        influence, and `content_sha256` keeps naming the original content.
        """
        if replacement_tokens < 0:
            raise LedgerError(f"replacement_tokens must be >= 0, got {replacement_tokens}")
        with self._write(session_id) as (conn, sess):
            (seg,) = self._load(conn, session_id, [segment_id])
            if seg.state not in _AMORTIZABLE:
                raise LedgerError(
                    f"segment {segment_id} is {seg.state.value}; only live or amortized segments amortize"
                )
            digest = self.content.put_in(conn, replacement_content)
            delta = replacement_tokens - seg.n_tokens
            conn.execute(
                update(segments).where(segments.c.id == segment_id).values(
                    state=SegmentState.AMORTIZED.value, tok_end=seg.start + replacement_tokens,
                    replacement_sha256=digest,
                )
            )
            _shift_after(conn, session_id, seg.seq, delta)
            conn.execute(
                update(sessions).where(sessions.c.id == session_id).values(token_count=sess.token_count + delta)
            )
            if seg.replacement_sha256 != digest:
                self.content.release(conn, [seg.replacement_sha256])
            (result,) = self._load(conn, session_id, [segment_id])
        log.info("ledger.amortize", session_id=session_id, segment_id=segment_id, delta=delta)
        if seg.replacement_sha256 and seg.replacement_sha256 != digest:
            self._erased({seg.replacement_sha256})
        return result

    def truncate(self, session_id: str, n_tokens: int) -> list[Segment]:
        """The client rewrote history: segments starting at or after `n_tokens` become SUPERSEDED
        with empty ranges at `n_tokens`. Content is kept (history) until a forget of the same content
        in the session, an explicit forget of the superseded segment, or `sweep_superseded`.
        Returns the newly superseded.
        """
        with self._write(session_id) as (conn, sess):
            if not 0 <= n_tokens <= sess.token_count:
                raise LedgerError(
                    f"cannot truncate session {session_id!r} to {n_tokens}: it holds {sess.token_count} tokens"
                )
            alive = self._segments(conn, session_id, include_dead=False)
            for seg in alive:
                if seg.start < n_tokens < seg.end:
                    raise LedgerError(
                        f"segment {seg.id} spans [{seg.start}, {seg.end}) across {n_tokens}; "
                        "truncate only at a segment boundary"
                    )
            victims = [s.id for s in alive if s.start >= n_tokens]
            if victims:
                conn.execute(
                    update(segments).where(segments.c.id.in_(victims)).values(state=SegmentState.SUPERSEDED.value)
                )
            conn.execute(
                update(segments)
                .where(segments.c.session_id == session_id, segments.c.tok_start >= n_tokens)
                .values(tok_start=n_tokens, tok_end=n_tokens)
            )
            conn.execute(update(sessions).where(sessions.c.id == session_id).values(token_count=n_tokens))
            result = self._load(conn, session_id, victims) if victims else []
        log.info("ledger.truncate", session_id=session_id, n_tokens=n_tokens, superseded=len(result))
        return result
