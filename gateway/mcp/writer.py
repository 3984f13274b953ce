"""The proxy's commits in a process of their own, so that they never wait for the proxy's GIL.

The recorder's thread gives up the GIL at every SQLite step of a commit (a dozen a batch) and, on
a busy proxy, waits for the event loop to hand it back each time. Here it only sends a batch down
a pipe and waits for the indices: the child builds the same stores from the same settings and
commits with `local_writer`, so the records, the transactions and the durability are the same.
A child that dies fails the batch in flight (the agents get errors, never results) and is
started again for the next one. Used by `lethe mcp --http`, which serves many agents at once; a
stdio proxy serves one and commits in-process.
"""
from __future__ import annotations

import multiprocessing
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from audit import AuditLog, Signer
from ledger import Ledger

from ..config import Settings
from ..logging import configure_logging
from .recorder import Rows, local_writer


class WriterError(Exception):
    """The writer process did not commit a batch. `kind` names the error there (`IntegrityError`),
    as an in-process commit's own type would be named to the agent."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def stores(settings: Settings) -> tuple[Ledger, AuditLog]:
    """This deployment's ledger and audit log (the chat endpoint's own stores)."""
    s = settings
    s.data_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(s.db_url, check_invariants=s.debug)
    signer = Signer.from_pem(s.audit_key_pem) if s.audit_key_pem else \
        Signer.load_or_create(s.resolved("audit_key_path", "audit-key.pem"))
    return ledger, AuditLog(s.audit_db_url, signer, origin=s.audit_origin, batch_size=s.audit_batch_size)


def _serve(conn: Connection, settings: Settings) -> None:
    """The child: commit each batch the proxy sends, answer its indices or the error, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the proxy's to handle; the pipe's close ends us
    configure_logging(settings.log_level, settings.log_json)
    write = local_writer(*stores(settings))
    while True:
        try:
            rows, records = conn.recv()
        except EOFError:  # the proxy is gone
            return
        try:
            conn.send(("ok", write(rows, records)))
        except Exception as exc:  # noqa: BLE001 - the proxy fails the batch's calls with it
            conn.send(("error", (type(exc).__name__, str(exc))))


class WriterProcess:
    """A `Writer` (recorder.py) whose commits run in a child process."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._process: Any = None
        self._start()

    def _start(self) -> None:
        if self._conn is not None:
            self._conn.close()
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._settings),
                                              name="lethe-mcp-writer", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent

    def __call__(self, rows: Rows, records: list[dict[str, Any]]) -> list[int]:
        with self._lock:
            if not self._process.is_alive():
                self._start()
            assert self._conn is not None
            try:
                self._conn.send((rows, records))
                status, value = self._conn.recv()
            except (EOFError, OSError) as exc:  # it died (or is dying): the next batch gets a new one
                self._process.kill()
                self._process.join()
                raise WriterError("writer process died", "the writer process died before answering; this batch "
                                  "may not be durable, so none of it is acted on") from exc
        if status != "ok":
            raise WriterError(*value)
        return list(value)

    @property
    def pid(self) -> int:
        return int(self._process.pid)
