"""Group commit for the proxy's records: one writer thread, one ledger transaction and one audit
append for whatever concurrent calls have queued.

Each decision must be durable before the agent sees its outcome (fail closed), and a durable
commit costs an fsync (2-10 ms here). Calls arriving while one batch commits join the next, so
eight concurrent agents share commits instead of queueing for sixteen of them. A caller still
waits for its own batch, and a failed batch fails every call in it.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from audit import AuditLog
from ledger import Crossing, Ledger

MAX_BATCH = 64


@dataclass
class _Entry:
    crossing: Crossing
    withhold: Iterable[str]
    records: list[dict[str, Any]]
    done: Future[int] = field(default_factory=Future)


class Recorder:
    """`write` blocks until the crossing and its audit records are committed; returns the last audit index."""

    def __init__(self, ledger: Ledger, audit: AuditLog) -> None:
        self._ledger, self._audit = ledger, audit
        self._queue: queue.SimpleQueue[_Entry] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def write(self, crossing: Crossing, withhold: Iterable[str], records: list[dict[str, Any]]) -> int:
        entry = _Entry(crossing, list(withhold), records)
        self._ensure_thread()
        self._queue.put(entry)
        return entry.done.result()

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
            self._ledger.crossings.write([(e.crossing, e.withhold) for e in batch])
            indices = self._audit.append_many([r for e in batch for r in e.records])
        except BaseException as exc:  # noqa: BLE001 - every waiting call learns of the failure
            for e in batch:
                e.done.set_exception(exc)
            return
        end = 0
        for e in batch:
            end += len(e.records)
            e.done.set_result(indices[end - 1])
