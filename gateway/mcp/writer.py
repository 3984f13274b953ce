"""The proxy's commits in a process of their own, so that they never wait for the proxy's GIL.

A commit gives up the GIL at every SQLite step (a dozen a batch) and, on a busy proxy, would
wait for the event loop to hand it back each time. Here the proxy's loop only sends a batch down
a socket and reads the indices back (`LoopRecorder` in recorder.py): the child builds the same
stores from the same settings and commits with `local_writer`, so the records, the transactions
and the durability are the same. A child that dies fails the batch in flight (the agents get
errors, never results) and is started again for the next one; so is one whose batch was
abandoned half-way (the proxy stopping), since its answer would otherwise be read as the next
batch's. Used by `lethe mcp --http`, which serves many agents at once; a stdio proxy serves one
and commits in a thread of its own.

The wire: each message is a 4-byte big-endian length, then a pickle (the parent and its own
child, nobody else, hold the socket pair): a batch `(rows, records)` one way; back, `("ready",
None)` once the child has started (its stores open after, within the first batch's commit
timeout), then for each batch, in the order sent, `("ok",
indices)` or `("error", (kind, message))`. The proxy may send a batch before the one before it is
answered (the child reads it as soon as it has answered that one). The oldest batch not answered
within LETHE_MCP_COMMIT_TIMEOUT_S (from its send, from the answer before it, or from a new
child's ready) fails with every batch behind it, and its writer is killed and replaced.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import signal
import socket
import struct
from collections.abc import Callable
from typing import Any

from audit import AuditLog, Signer
from ledger import Ledger

from ..config import Settings
from ..logging import configure_logging
from ..storefiles import refuse_unwritable
from .recorder import Rows, local_writer

_LENGTH = struct.Struct("!I")
STARTUP_S = 120.0  # a new writer's own start (its imports), before its commit timeout runs


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
    refuse_unwritable((s.db_url, s.audit_db_url))
    ledger = Ledger(s.db_url, check_invariants=s.debug)
    signer = Signer.from_pem(s.audit_key_pem) if s.audit_key_pem else \
        Signer.load_or_create(s.resolved("audit_key_path", "audit-key.pem"))
    return ledger, AuditLog(s.audit_db_url, signer, origin=s.audit_origin, batch_size=s.audit_batch_size)


def _frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the proxy closed the socket")
        data += chunk
    return bytes(data)


def _serve(sock: socket.socket, settings: Settings) -> None:
    """The child: commit each batch the proxy sends, answer its indices or the error, until the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the proxy's to handle; the socket's close ends us
    configure_logging(settings.log_level, settings.log_json)
    sock.setblocking(True)
    # Ready before the stores open: opening them takes the database's write lock, and a lock held
    # elsewhere must be waited for within the first batch's commit timeout, not the start-up
    # allowance (a red team's replacement writer, started under a 40 s lock, held its calls 36 s).
    sock.sendall(_frame(("ready", None)))  # the commit timeout runs from here, not from the spawn
    write = local_writer(*stores(settings))
    while True:
        try:
            rows, records = pickle.loads(_read_exactly(sock, _LENGTH.unpack(_read_exactly(sock, 4))[0]))
        except EOFError:  # the proxy is gone
            return
        try:
            answer: tuple[str, Any] = ("ok", write(rows, records))
        except Exception as exc:  # noqa: BLE001 - the proxy fails the batch's calls with it
            answer = ("error", (type(exc).__name__, str(exc)))
        sock.sendall(_frame(answer))


class WriterProcess:
    """A `WriterLink` (recorder.py) whose commits run in a child process, read and written by the
    event loop's own callbacks on a non-blocking socket: no thread, no extra turn of the loop."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._answered: Callable[[list[int] | Exception], None] | None = None
        self._inbox = bytearray()
        self._outbox = bytearray()
        self._pending = 0  # batches sent and not yet answered (the oldest's deadline is armed)
        self._deadline: asyncio.TimerHandle | None = None
        self._ready = False  # the child has started (its first message)

    def open(self, loop: asyncio.AbstractEventLoop, answered: Callable[[list[int] | Exception], None]) -> None:
        self._loop, self._answered = loop, answered
        self._start()

    def _start(self) -> None:
        """A new child and socket pair (the first, or after a death: the child reloads the same stores)."""
        parent, child = socket.socketpair()
        self._process = self._context.Process(target=_serve, args=(child, self._settings),
                                              name="lethe-mcp-writer", daemon=True)
        self._process.start()
        child.close()
        parent.setblocking(False)
        self._sock, self._inbox, self._outbox, self._ready = parent, bytearray(), bytearray(), False
        assert self._loop is not None
        self._loop.add_reader(parent.fileno(), self._readable)

    def _stop(self, grace_s: float = 0.0) -> None:
        """Close the socket and end the child: it exits on the close when idle (`grace_s` to do so);
        one dead, dying, or holding an answer nobody will read is killed."""
        if self._sock is not None:
            assert self._loop is not None
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._process is not None:
            self._process.join(grace_s)
            self._process.kill()
            self._process.join()
            self._process = None

    def close(self) -> None:
        self._stop(grace_s=0.0 if self._pending else 5.0)
        self._pending = 0
        self._no_deadline()

    def send(self, rows: Rows, records: list[dict[str, Any]]) -> None:
        if self._loop is None:
            raise WriterError("writer not open", "the writer process is not open; nothing was recorded")
        if self._sock is None or not self._process.is_alive():
            self._died()  # batches still in flight there fail first
            self._start()
        if not self._pending:
            self._arm_oldest()
        self._pending += 1
        self._outbox += _frame((rows, records))
        self._flush()

    def _arm_oldest(self) -> None:
        """The oldest unanswered batch's deadline, from now: it was just sent, or the writer just
        answered the one before it (or became ready: a new writer's start has its own allowance)."""
        assert self._loop is not None
        self._no_deadline()
        seconds = self._settings.mcp_commit_timeout_s + (0.0 if self._ready else STARTUP_S)
        self._deadline = self._loop.call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        """No answer in LETHE_MCP_COMMIT_TIMEOUT_S (a stopped writer, a database lock held elsewhere):
        the batches in flight fail, and the writer is killed, so that a late commit is never read as another's."""
        self._fail_all(WriterError("commit timed out", f"the batch was not committed within "
                                 f"{self._settings.mcp_commit_timeout_s:g} s (LETHE_MCP_COMMIT_TIMEOUT_S); it "
                                 "may not be durable, so none of it is acted on; check the ledger and audit "
                                 "databases' locks and the writer process"))

    def _flush(self) -> None:
        assert self._sock is not None and self._loop is not None
        try:
            sent = self._sock.send(self._outbox)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._died()
            return
        del self._outbox[:sent]
        if self._outbox:
            self._loop.add_writer(self._sock.fileno(), self._flush)
        else:
            self._loop.remove_writer(self._sock.fileno())

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            chunk = self._sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._died()
            return
        self._inbox += chunk
        while len(self._inbox) >= _LENGTH.size:
            end = _LENGTH.size + _LENGTH.unpack_from(self._inbox)[0]
            if len(self._inbox) < end:
                return
            status, value = pickle.loads(self._inbox[_LENGTH.size:end])
            del self._inbox[:end]
            if status == "ready":
                self._ready = True
                if self._pending:  # batches sent before the writer was up: the oldest's timeout starts now
                    self._arm_oldest()
            else:
                self._answer(list(value) if status == "ok" else WriterError(*value))

    def _died(self) -> None:
        """The child is gone (or its socket broke): the batches in flight fail; the next batch starts a new child."""
        self._fail_all(WriterError("writer process died", "the writer process died before answering; this "
                                   "batch may not be durable, so none of it is acted on"))

    def _fail_all(self, error: WriterError) -> None:
        """Kill the writer and fail every batch it holds, oldest first (an answer may send a new
        batch, to a new writer: it is counted apart from the ones failing here)."""
        self._stop()
        self._no_deadline()
        failing, self._pending = self._pending, 0
        assert self._answered is not None
        for _ in range(failing):
            self._answered(error)

    def _answer(self, indices: list[int] | Exception) -> None:
        self._pending -= 1
        if self._pending:
            self._arm_oldest()  # the next batch's deadline, from this answer
        else:
            self._no_deadline()
        assert self._answered is not None
        self._answered(indices)

    def _no_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    @property
    def pid(self) -> int:
        return int(self._process.pid)
