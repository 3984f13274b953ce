"""Group commit for the proxy's records: whatever concurrent calls have queued is committed in one
durable transaction, by a thread in this process (`Recorder`, stdio) or from the event loop
(`LoopRecorder`, `lethe mcp --http`): on the loop itself while the SQLite lock is free
(`InlineFirst`), else by a writer process the loop talks to directly (writer.py).

Each decision must be durable before the agent sees its outcome (fail closed), and a durable
commit costs an fsync (1-4 ms on the development VM's disk). Calls arriving while one batch commits join the next, so
eight concurrent agents share commits instead of queueing for one each. When the ledger and the
audit log live in one database (the default: `LETHE_AUDIT_DATABASE_URL` unset), a batch's
crossings and audit records are one transaction: one fsync, and never a crossing without its
record. A caller's future resolves only after its batch is committed; a failed batch fails every
call in it, and the caller shows the agent an error, never the result.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from audit import AuditLog, LogBusy
from ledger import Crossing, CrossingLog, Ledger

log = structlog.get_logger(__name__)

MAX_BATCH = 64
PIPELINE = 2  # batches a `LoopRecorder` keeps in flight: the writer starts the next as it answers one


@dataclass
class _Entry:
    crossing: Crossing | None  # None: records alone (an MCP call's, committed before its upstream is called)
    withhold: list[str]
    records: list[dict[str, Any]]
    done: Future[int] = field(default_factory=Future)


Rows = list[tuple[Crossing, list[str]]]
Writer = Callable[[Rows, list[dict[str, Any]]], list[int]]  # (crossings, records) -> audit indices, once durable


class RecorderStopped(Exception):
    """A record was submitted while the loop recorder was not running (before the proxy started
    serving, or after it stopped): nothing was committed, so nothing may be acted on."""


def shared_database(ledger: Ledger, audit: AuditLog) -> bool:
    """Whether the ledger and the audit log live in one database: a batch is then one transaction."""
    return ledger.crossings.database == getattr(audit, "database", None)


def local_writer(ledger: Ledger, audit: AuditLog, wait: bool = True) -> Writer:
    """Commits in this process: one transaction when both stores share a database. With
    `wait=False` a write lock held by another writer raises `audit.LogBusy`, nothing written (only
    for shared stores: with two databases the crossing would be committed before the lock was found)."""
    shared = shared_database(ledger, audit)
    if not (wait or shared):
        raise ValueError("a writer that does not wait for the lock needs the ledger and the audit log in one "
                         "database (LETHE_AUDIT_DATABASE_URL unset)")

    def write(rows: Rows, records: list[dict[str, Any]]) -> list[int]:
        if shared:
            return audit.append_many(records, alongside=lambda conn: CrossingLog.insert(conn, rows), wait=wait)
        ledger.crossings.write(rows)  # two databases: the crossing first, so no record names a missing one
        return audit.append_many(records)
    return write


def _arguments(batch: list[_Entry]) -> tuple[Rows, list[dict[str, Any]]]:
    return [(e.crossing, e.withhold) for e in batch if e.crossing is not None], [r for e in batch for r in e.records]


def _resolve(batch: list[_Entry], indices: list[int] | BaseException) -> None:
    """Each entry's future: the audit index of its last record, or the batch's failure."""
    if isinstance(indices, BaseException):
        for e in batch:
            e.done.set_exception(indices)
        return
    end = 0
    for e in batch:
        end += len(e.records)
        e.done.set_result(indices[end - 1])


def _entry(crossing: Crossing | None, withhold: Iterable[str], records: list[dict[str, Any]]) -> _Entry:
    entry = _Entry(crossing, list(withhold), records)
    entry.done.set_running_or_notify_cancel()  # a caller that gives up cannot cancel the commit of its records
    return entry


class Recorder:
    """`submit` queues a crossing and its audit records; its future is the last audit index, set once
    durable. One thread of this process commits each batch with a synchronous `Writer`."""

    def __init__(self, ledger: Ledger, audit: AuditLog, writer: Writer | None = None) -> None:
        self.shared = shared_database(ledger, audit)
        self._write = writer or local_writer(ledger, audit)
        self._queue: queue.SimpleQueue[_Entry] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Nothing to start: the thread starts with the first submission."""
        yield

    def submit(self, crossing: Crossing | None, withhold: Iterable[str],
               records: list[dict[str, Any]]) -> Future[int]:
        entry = _entry(crossing, withhold, records)
        self._ensure_thread()
        self._queue.put(entry)
        return entry.done

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lethe-mcp-recorder", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                indices: list[int] | BaseException = self._write(*_arguments(batch))
            except BaseException as exc:  # noqa: BLE001 - every waiting call learns of the failure
                indices = exc
            _resolve(batch, indices)


class WriterLink(Protocol):
    """A writer the event loop drives without a thread (writer.py's `WriterProcess`): `open` binds it
    to the running loop, `send` hands it one batch (at most `PIPELINE` unanswered at once), and
    `answered` is called on the loop once per batch, in the order sent, with its indices or its
    failure."""

    def open(self, loop: asyncio.AbstractEventLoop, answered: Callable[[list[int] | Exception], None]) -> None: ...

    def send(self, rows: Rows, records: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class InlineFirst:
    """A `WriterLink` that commits a batch on the event loop, inside the `send` that hands it over,
    when the database's write lock is free and the `fallback` link (the writer process) holds no
    batch; otherwise the batch goes to the fallback.

    Why: `lethe bench mcp` (8 agents, 2-core AMD EPYC) measured the wait for a batch committed by
    the writer process at 3.6-5.1 ms (p50), most of it a wait for the CPU: the child, the proxy
    and the agents queue for the same cores, then the answer waits for the loop's turn. On the loop
    the commit is its own work (about a millisecond) and one fsync (0.2 ms on that disk), with no
    hand-off. The loop is blocked for that time, so `build` (run.py) uses this for a local SQLite
    file only, never a network database; and `write` must not wait for a lock
    (`local_writer(wait=False)`): a lock held by another writer (the chat endpoint, a replica) sends
    the batch to the fallback, whose commit timeout bounds the wait. Any other failure fails the
    batch: its calls get errors, never results. While the fallback holds batches, new ones follow
    them there, so answers come in the order the batches were sent.

    A slow disk would stall the loop, and every agent with it, for each commit, past the commit
    timeout (a red team's 20 s fsync froze the proxy 20 s): a commit here that took over `STALL_S`
    sends the batches of the next `BACKOFF_S` to the fallback, where the commit timeout holds and
    the loop keeps serving. What is left: one commit's stall, at most once per `BACKOFF_S`.
    """

    STALL_S = 0.1  # a healthy commit here takes about a millisecond
    BACKOFF_S = 60.0

    def __init__(self, write: Writer, fallback: WriterLink) -> None:
        self._write = write
        self.fallback = fallback  # the writer process
        self._held = 0  # batches with the fallback and not yet answered
        self._answered: Callable[[list[int] | Exception], None] | None = None
        self._inline_from = 0.0  # time.monotonic() from which commits may run here again
        self.inline = 0  # batches committed on the loop (for the tests)

    def open(self, loop: asyncio.AbstractEventLoop, answered: Callable[[list[int] | Exception], None]) -> None:
        self._answered = answered
        self.fallback.open(loop, self._from_fallback)

    def send(self, rows: Rows, records: list[dict[str, Any]]) -> None:
        if self._answered is None:
            raise RecorderStopped("the inline writer is not open; nothing was recorded")
        if not self._held and time.monotonic() >= self._inline_from:
            outcome = self._commit_here(rows, records)
            if outcome is not None:
                self._answered(outcome)
                return
        self._held += 1  # before the send: a dying writer may answer this very batch inside it
        try:
            self.fallback.send(rows, records)
        except BaseException:
            self._held -= 1
            raise

    def _commit_here(self, rows: Rows, records: list[dict[str, Any]]) -> list[int] | Exception | None:
        """The batch's indices or its failure; None if another writer holds the lock (the fallback
        waits for it, within its timeout)."""
        started = time.monotonic()
        try:
            outcome: list[int] | Exception | None = self._write(rows, records)
            self.inline += 1
        except LogBusy:
            outcome = None
        except Exception as exc:  # noqa: BLE001 - the batch fails, nothing of it is acted on
            outcome = exc
        self._stalled(time.monotonic() - started)
        return outcome

    def _stalled(self, seconds: float) -> None:
        if seconds > self.STALL_S:
            self._inline_from = time.monotonic() + self.BACKOFF_S
            log.warning("mcp.inline_commit_stalled", seconds=round(seconds, 3), backoff_s=self.BACKOFF_S,
                        hint="the database's disk is slow: commits go to the writer process meanwhile "
                             "(LETHE_MCP_INLINE_COMMIT=false keeps them there)")

    def _from_fallback(self, indices: list[int] | Exception) -> None:
        self._held -= 1
        assert self._answered is not None
        self._answered(indices)

    def close(self) -> None:
        self._answered = None
        self.fallback.close()


class LoopRecorder:
    """The same contract, batched and committed from the proxy's event loop through a `WriterLink`.

    Why not a thread: under load the loop thread holds the GIL, and a recorder thread waits for it
    to take each batch, to send it and to read its indices back; its results then reach the loop
    through a thread-safe callback, one more turn of a busy loop. Here a call queued on the loop
    is sent at once when fewer than `PIPELINE` batches are in flight, and the indices are read and
    the futures resolved in the callback the loop runs when an answer arrives; the calls queued
    meanwhile go out as the next batch from that same callback. With two in flight the writer
    starts the next batch as soon as it has answered one, instead of idling until a busy loop
    reads the answer and sends more. `submit` may be called from any thread; the entries only
    change hands on the loop. Submitting while the recorder is not `running` fails the future at
    once (`RecorderStopped`), and stopping fails whatever is queued or in flight: never a result
    whose records are not known to be durable.
    """

    def __init__(self, ledger: Ledger, audit: AuditLog, link: WriterLink) -> None:
        self.shared = shared_database(ledger, audit)
        self._link = link
        self._queue: deque[_Entry] = deque()
        self._in_flight: deque[list[_Entry]] = deque()  # sent and unanswered, oldest first
        self._pumping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def submit(self, crossing: Crossing | None, withhold: Iterable[str],
               records: list[dict[str, Any]]) -> Future[int]:
        entry = _entry(crossing, withhold, records)
        loop = self._loop
        if loop is None:
            entry.done.set_exception(_stopped("is not serving (its recorder is stopped)"))
        elif threading.get_ident() == self._loop_thread:
            self._enqueue(entry)
        else:
            try:
                loop.call_soon_threadsafe(self._enqueue, entry)
            except RuntimeError:  # the loop closed between the check and the call
                entry.done.set_exception(_stopped("stopped"))
        return entry.done

    def _enqueue(self, entry: _Entry) -> None:
        if self._loop is None:  # stopped while the entry was on its way to the loop
            entry.done.set_exception(_stopped("stopped"))
            return
        self._queue.append(entry)
        self._pump()

    def _pump(self) -> None:
        """Send the queued calls as batches while fewer than `PIPELINE` are in flight (an answer pumps
        again). Not re-entrant: a send that fails earlier batches (a dead writer) answers them from
        inside it, and a batch sent from there would reach the writer ahead of the one being sent."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while len(self._in_flight) < PIPELINE and self._queue:
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
                self._in_flight.append(batch)
                try:
                    self._link.send(*_arguments(batch))
                except Exception as exc:  # noqa: BLE001 - the link could not take it: the batch fails, nothing is acted on
                    self._in_flight.pop()
                    _resolve(batch, exc)
        finally:
            self._pumping = False

    def _answered(self, indices: list[int] | Exception) -> None:
        _resolve(self._in_flight.popleft() if self._in_flight else [], indices)
        self._pump()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Commit batches for the lifetime of the block (the proxy's `running`)."""
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._link.open(self._loop, self._answered)
        try:
            yield
        finally:
            self._loop = self._loop_thread = None
            # A batch in flight may or may not be durable: it fails with the rest, before the link
            # closes (so no error there can leave a call waiting).
            unsettled = [e for batch in self._in_flight for e in batch] + [*self._queue]
            self._in_flight.clear()
            self._queue.clear()
            _resolve(unsettled, _stopped("stopped before this decision was recorded"))
            self._link.close()


def _stopped(what: str) -> RecorderStopped:
    return RecorderStopped(f"the proxy {what}; nothing was recorded or passed on")
