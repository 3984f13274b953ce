"""Group commit for the proxy's records: whatever concurrent calls have queued is committed in one
durable transaction, by a recorder thread (`Recorder`: in process, `local_writer`, for the stdio
proxy) or by the event loop through a writer process (`LoopRecorder` and writer.py, for
`lethe mcp --http`).

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
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from audit import AuditLog
from ledger import Crossing, CrossingLog, Ledger

MAX_BATCH = 64


@dataclass
class _Entry:
    crossing: Crossing
    withhold: list[str]
    records: list[dict[str, Any]]
    done: Future[int] = field(default_factory=Future)


Rows = list[tuple[Crossing, list[str]]]
Writer = Callable[[Rows, list[dict[str, Any]]], list[int]]  # (crossings, records) -> audit indices, once durable


def local_writer(ledger: Ledger, audit: AuditLog) -> Writer:
    """Commits in this process: one transaction when both stores share a database."""
    shared = ledger.crossings.database == getattr(audit, "database", None)

    def write(rows: Rows, records: list[dict[str, Any]]) -> list[int]:
        if shared:
            return audit.append_many(records, alongside=lambda conn: CrossingLog.insert(conn, rows))
        ledger.crossings.write(rows)  # two databases: the crossing first, so no record names a missing one
        return audit.append_many(records)
    return write


def _rows(batch: list[_Entry]) -> tuple[Rows, list[dict[str, Any]]]:
    """A batch as one commit's arguments: its crossings, then all its audit records in order."""
    return [(e.crossing, e.withhold) for e in batch], [r for e in batch for r in e.records]


def _settle(batch: list[_Entry], commit: Callable[[], list[int]]) -> None:
    """Each call learns its last audit index once `commit` returns, or the error it raised."""
    try:
        indices = commit()
    except BaseException as exc:  # noqa: BLE001 - every waiting call learns of the failure
        _fail(batch, exc)
        return
    end = 0
    for e in batch:
        end += len(e.records)
        e.done.set_result(indices[end - 1])


def _fail(batch: list[_Entry], exc: BaseException) -> None:
    for e in batch:
        e.done.set_exception(exc)


class _Group:
    """What both recorders share: the entries they accept, and waiting for one to commit."""

    def __init__(self, ledger: Ledger, audit: AuditLog) -> None:
        self.shared = ledger.crossings.database == getattr(audit, "database", None)

    def submit(self, crossing: Crossing, withhold: Iterable[str], records: list[dict[str, Any]]) -> Future[int]:
        """Queue a crossing and its audit records; the future is the last audit index, set once durable."""
        entry = _Entry(crossing, list(withhold), records)
        entry.done.set_running_or_notify_cancel()  # a caller that gives up cannot cancel the commit of its records
        self._queue(entry)
        return entry.done

    def write(self, crossing: Crossing, withhold: Iterable[str], records: list[dict[str, Any]]) -> int:
        """`submit`, then wait for the commit (off the event loop's thread)."""
        return self.submit(crossing, withhold, records).result()

    def _queue(self, entry: _Entry) -> None:
        raise NotImplementedError

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The proxy starts serving on `loop` (called on it)."""

    def detach(self) -> None:
        """The proxy's loop stops serving (called on it)."""


class Recorder(_Group):
    """Commits on a thread of its own, in process (`local_writer`) or through a writer: the stdio
    proxy's (one agent, so no busy event loop to win the GIL back from)."""

    def __init__(self, ledger: Ledger, audit: AuditLog, writer: Writer | None = None) -> None:
        super().__init__(ledger, audit)
        self._write = writer or local_writer(ledger, audit)
        self._entries: queue.SimpleQueue[_Entry] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _queue(self, entry: _Entry) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lethe-mcp-recorder", daemon=True)
                self._thread.start()
        self._entries.put(entry)

    def _run(self) -> None:
        while True:
            batch = [self._entries.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._entries.get_nowait())
                except queue.Empty:
                    break
            _settle(batch, lambda: self._write(*_rows(batch)))


@runtime_checkable
class PipeWriter(Protocol):
    """A writer whose commit `send` starts and `receive` ends (writer.py's process); `fileno`
    turns readable when the answer is there."""

    def send(self, rows: Rows, records: list[dict[str, Any]]) -> None: ...
    def receive(self) -> list[int]: ...
    def fileno(self) -> int: ...
    def __call__(self, rows: Rows, records: list[dict[str, Any]]) -> list[int]: ...


class LoopRecorder(_Group):
    """The same group commit driven by the event loop itself (`lethe mcp --http`): the loop sends a
    batch down the writer process's pipe and reads the answer when the pipe turns readable
    (`add_reader`), with no thread between them. A recorder thread had to win the GIL back from
    the busy loop (up to a 5 ms switch interval) to send, again to read the answer, and then
    handed the futures back to the loop; here the answer is read, and the calls woken, in one pass
    of the loop. Calls arriving while a batch is in flight join the next, sent when the answer
    comes. Guard threads (large documents) may submit too: their entries are handed to the loop,
    and they block on the same futures."""

    def __init__(self, ledger: Ledger, audit: AuditLog, writer: PipeWriter) -> None:
        super().__init__(ledger, audit)
        self._writer = writer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._waiting: list[_Entry] = []
        self._in_flight: list[_Entry] | None = None
        self._fd = -1

    @property
    def in_flight(self) -> int:
        """How many calls' records the writer is committing now."""
        return len(self._in_flight or ())

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._loop_thread = loop, threading.get_ident()

    def detach(self) -> None:
        """Finish the batch in flight and commit what is queued, blocking (the loop is ending), so
        no accepted record is left uncommitted and no answer is left in the pipe for the next loop."""
        if self._in_flight is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._finish()
        self._loop = self._loop_thread = None
        while self._waiting:
            batch = self._take()
            _settle(batch, lambda: self._writer(*_rows(batch)))

    def _queue(self, entry: _Entry) -> None:
        loop = self._loop
        if loop is not None and threading.get_ident() == self._loop_thread:
            self._enqueue(entry)
            return
        try:
            if loop is None:
                raise RuntimeError("no event loop attached")
            loop.call_soon_threadsafe(self._enqueue, entry)
        except RuntimeError as exc:  # not serving, or the loop closed: fail closed, nothing is shown
            entry.done.set_exception(RuntimeError(f"the proxy is not serving ({exc}); records are committed "
                                                  "only inside `Proxy.running()`"))

    def _take(self) -> list[_Entry]:
        batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
        return batch

    def _enqueue(self, entry: _Entry) -> None:
        if self._loop is None:  # detached after the hand-off was scheduled
            entry.done.set_exception(RuntimeError("the proxy stopped serving before this record was committed"))
            return
        self._waiting.append(entry)
        if self._in_flight is None:
            self._send_next()

    def _send_next(self) -> None:
        """Send the queued calls as the next batch; a batch the writer cannot take fails, and the next is tried."""
        while self._waiting and self._in_flight is None and self._loop is not None:
            batch = self._take()
            try:
                self._writer.send(*_rows(batch))
            except BaseException as exc:  # noqa: BLE001 - every call in it learns of the failure
                _fail(batch, exc)
                continue
            self._in_flight, self._fd = batch, self._writer.fileno()
            self._loop.add_reader(self._fd, self._answered)

    def _answered(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._finish()
        self._send_next()

    def _finish(self) -> None:
        """Read the in-flight batch's answer (or learn the writer died) and settle its calls."""
        batch, self._in_flight = self._in_flight or [], None
        _settle(batch, self._writer.receive)
