"""Group commit for the proxy's records: one recorder thread commits whatever concurrent calls have
queued, in one durable transaction, itself (`local_writer`) or through a writer process (writer.py).

Each decision must be durable before the agent sees its outcome (fail closed), and a durable
commit costs an fsync (1-4 ms on the development VM's disk). Calls arriving while one batch commits join the next, so
eight concurrent agents share commits instead of queueing for one each. When the ledger and the
audit log live in one database (the default: `LETHE_AUDIT_DATABASE_URL` unset), a batch's
crossings and audit records are one transaction: one fsync, and never a crossing without its
record. A caller's future resolves only after its batch is committed; a failed batch fails every
call in it, and the caller shows the agent an error, never the result.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

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


class Recorder:
    """`submit` queues a crossing and its audit records; its future is the last audit index, set once durable."""

    def __init__(self, ledger: Ledger, audit: AuditLog, writer: Writer | None = None) -> None:
        self.shared = ledger.crossings.database == getattr(audit, "database", None)
        self._write = writer or local_writer(ledger, audit)
        self._queue: queue.SimpleQueue[_Entry] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, crossing: Crossing, withhold: Iterable[str], records: list[dict[str, Any]]) -> Future[int]:
        entry = _Entry(crossing, list(withhold), records)
        entry.done.set_running_or_notify_cancel()  # a caller that gives up cannot cancel the commit of its records
        self._ensure_thread()
        self._queue.put(entry)
        return entry.done

    def write(self, crossing: Crossing, withhold: Iterable[str], records: list[dict[str, Any]]) -> int:
        """`submit`, then wait for the commit."""
        return self.submit(crossing, withhold, records).result()

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
            self._commit(batch)

    def _commit(self, batch: list[_Entry]) -> None:
        try:
            indices = self._write([(e.crossing, e.withhold) for e in batch], [r for e in batch for r in e.records])
        except BaseException as exc:  # noqa: BLE001 - every waiting call learns of the failure
            for e in batch:
                e.done.set_exception(exc)
            return
        end = 0
        for e in batch:
            end += len(e.records)
            e.done.set_result(indices[end - 1])
