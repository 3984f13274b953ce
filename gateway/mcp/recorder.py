"""Group commit for the proxy's records: one writer thread commits whatever concurrent calls have
queued, in one durable transaction.

Each decision must be durable before the agent sees its outcome (fail closed), and a durable
commit costs an fsync (2-10 ms here). Calls arriving while one batch commits join the next, so
eight concurrent agents share commits instead of queueing for one each. When the ledger and the
audit log live in one database (the default: `LETHE_AUDIT_DATABASE_URL` unset), a batch's
crossings and audit records are one transaction: one fsync, and never a crossing without its
record. A caller's future resolves only after its batch is committed; a failed batch fails every
call in it, and the caller shows the agent an error, never the result.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
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


class Recorder:
    """`submit` queues a crossing and its audit records; its future is the last audit index, set once durable."""

    def __init__(self, ledger: Ledger, audit: AuditLog) -> None:
        self._ledger, self._audit = ledger, audit
        self.shared = ledger.crossings.database == getattr(audit, "database", None)
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
        rows = [(e.crossing, e.withhold) for e in batch]
        records = [r for e in batch for r in e.records]
        try:
            if self.shared:
                indices = self._audit.append_many(records, alongside=lambda conn: CrossingLog.insert(conn, rows))
            else:  # two databases: the crossing first, so an audit record never names a missing crossing
                self._ledger.crossings.write(rows)
                indices = self._audit.append_many(records)
        except BaseException as exc:  # noqa: BLE001 - every waiting call learns of the failure
            for e in batch:
                e.done.set_exception(exc)
            return
        end = 0
        for e in batch:
            end += len(e.records)
            e.done.set_result(indices[end - 1])
