"""The segment ledger: which message occupies which token range of a session's KV cache.

The kernel owns the cache; the ledger owns the bookkeeping. Every mutation is one database
transaction that first locks the session row (PostgreSQL `FOR UPDATE`, SQLite's writer lock), so
replicas sharing a database serialize per session, and (with `check_invariants`) re-verifies the
tiling before commit, so a violation rolls the whole operation back.
"""
from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import structlog
from sqlalchemy import Connection, Row, bindparam, delete, exc, insert, select, update

from .content import ContentStore
from .errors import LedgerError, UnknownSegment, UnknownSession
from .invariants import verify_tiling
from .records import CONTENT_RETIRED, IN_CACHE, Segment, SegmentState, SessionRecord
from .schema import WRITE, make_engine, metadata, segments, sessions

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


@dataclass(frozen=True)
class TurnWrite:
    """What `write_turn` changed, so that `undo_turn` can put the session back exactly."""

    session_id: str
    appended: tuple[Segment, ...]
    superseded: tuple[Segment, ...]  # as they were before the write
    token_count: int
    next_seq: int


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
        metadata.create_all(self._engine, checkfirst=True)
        self.content = ContentStore(self._engine, self._serial)

    def close(self) -> None:
        self._engine.dispose()

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
    ) -> Segment:
        """Add a segment at the tail of the cache: [token_count, token_count + n_tokens).

        For a QUARANTINED segment, `n_tokens` counts the stub that entered the cache in place of
        the content; `content` is what identifies it (typically the original tool result, so that a
        re-sent history finds the segment with `find_by_content`).
        """
        state = SegmentState(state)
        if state not in _APPENDABLE:
            raise LedgerError(f"append takes a live or quarantined segment, not {state.value}")
        if n_tokens < 0:
            raise LedgerError(f"n_tokens must be >= 0, got {n_tokens}")
        with self._write(session_id) as (conn, sess):
            seg = Segment(
                id=_new_segment_id(), session_id=session_id, seq=sess.next_seq, role=role, tool=tool,
                content_sha256=self.content.put_in(conn, content), start=sess.token_count,
                end=sess.token_count + n_tokens, state=state, created_at=self._clock(),
                data_class=data_class, meta=dict(meta or {}),
            )
            conn.execute(_INSERT_SEGMENT, {
                "id": seg.id, "session_id": session_id, "seq": seg.seq, "role": role, "tool": tool,
                "content_sha256": seg.content_sha256, "tok_start": seg.start, "tok_end": seg.end, "state": state.value,
                "created_at": seg.created_at, "data_class": data_class, "meta": seg.meta,
            })
            conn.execute(_ADVANCE_SESSION, {"session_id": session_id, "new_count": seg.end, "new_seq": seg.seq + 1})
        log.debug("ledger.append", session_id=session_id, segment_id=seg.id, state=state.value, n_tokens=n_tokens)
        return seg

    def write_turn(self, session_id: str, *, keep: int, new: Sequence[NewSegment]) -> TurnWrite:
        """One chat turn's ledger writes in one transaction: all or nothing.

        The conversation is the session's non-superseded segments in seq order. Every segment
        after its first `keep` leaves it (SUPERSEDED, empty range at the cut), forgotten ones
        included: a rewritten history must not keep dead segments in its middle, where every
        later request would mismatch them. Then `new` is appended at the cut.
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
                seg = Segment(id=_new_segment_id(), session_id=session_id, seq=seq, role=item.role, tool=item.tool,
                              content_sha256=self.content.put_in(conn, item.content), start=at,
                              end=at + item.n_tokens, state=state, created_at=self._clock(),
                              data_class=item.data_class, meta=dict(item.meta))
                conn.execute(_INSERT_SEGMENT, {
                    "id": seg.id, "session_id": session_id, "seq": seg.seq, "role": seg.role, "tool": seg.tool,
                    "content_sha256": seg.content_sha256, "tok_start": seg.start, "tok_end": seg.end,
                    "state": state.value, "created_at": seg.created_at, "data_class": seg.data_class,
                    "meta": seg.meta})
                appended.append(seg)
                seq, at = seq + 1, seg.end
            conn.execute(_ADVANCE_SESSION, {"session_id": session_id, "new_count": at, "new_seq": seq})
        log.debug("ledger.write_turn", session_id=session_id, superseded=len(cut), appended=len(appended))
        return TurnWrite(session_id, tuple(appended), tuple(cut), sess.token_count, sess.next_seq)

    def undo_turn(self, write: TurnWrite) -> None:
        """Put the session back as it was before `write` (a later step of the turn failed)."""
        with self._write(write.session_id) as (conn, _sess):
            ids = [s.id for s in write.appended]
            if ids:
                conn.execute(delete(segments).where(segments.c.id.in_(ids)))
            for seg in write.superseded:
                conn.execute(update(segments).where(segments.c.id == seg.id)
                             .values(state=seg.state.value, tok_start=seg.start, tok_end=seg.end))
            conn.execute(_ADVANCE_SESSION, {"session_id": write.session_id, "new_count": write.token_count,
                                            "new_seq": write.next_seq})
            self.content.release(conn, [s.content_sha256 for s in write.appended])
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
        return result

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
        return result

    def truncate(self, session_id: str, n_tokens: int) -> list[Segment]:
        """The client rewrote history: segments starting at or after `n_tokens` become SUPERSEDED
        with empty ranges at `n_tokens`. Content is kept (history). Returns the newly superseded.
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
