"""Group commit of the proxy's records: durable before the agent sees anything, one transaction per batch.

Concurrent agents (the SDK's real client, one session each) call tools through one in-process
proxy whose upstream is the fixture server as a real process; the ledger and the audit log share
one SQLite file, as they do by default. A real SQLite write lock, held by another connection,
makes the calls wait at their commit, so they queue for the same batch.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from audit import AuditLog, verify_export
from gate import Gate
from gateway.config import Settings
from gateway.mcp import Caller, Guard, McpSettings, Proxy, UpstreamSpec
from gateway.mcp.recorder import InlineFirst, LoopRecorder, RecorderStopped, WriterLink, local_writer
from gateway.mcp.run import writer_link
from gateway.mcp.writer import WriterError, WriterProcess, stores
from gateway.tenants import Principal
from ledger import Crossing, CrossingLog, Ledger
from policies import PolicyEngine

FIXTURE = Path(__file__).with_name("mcp_upstream.py")
ACME = Caller(Principal("acme", "agent"), None)
CALLS = 12
FAIL_AUDIT = ("CREATE TRIGGER injected_failure BEFORE INSERT ON audit_records "
              "BEGIN SELECT RAISE(ABORT, 'injected: disk quota exceeded'); END")


@pytest.fixture(params=["in-process", "writer-process", "inline-first"])
def writer(request: pytest.FixtureRequest) -> str:
    """Commits in the proxy's own recorder thread (stdio), in a writer process, or on the event loop
    while the lock is free and in the writer process otherwise (`lethe mcp --http`'s default)."""
    return str(request.param)


def _link(deployment: Settings, ledger: Ledger, audit: AuditLog, writer: str) -> WriterLink | None:
    if writer == "in-process":
        return None
    link = writer_link(deployment, ledger, audit)
    assert isinstance(link, InlineFirst) == (writer == "inline-first")
    return link


def _stores(tmp: Path, writer: str) -> tuple[Proxy, Ledger, AuditLog, Path]:
    deployment = Settings(data_dir=tmp, audit_batch_size=8, database_url=None, audit_database_url=None,
                          audit_key_path=None, audit_key_pem=None, mcp_inline_commit=writer == "inline-first")
    ledger, audit = stores(deployment)
    settings = McpSettings(upstreams=[UpstreamSpec(name="fx", command=[sys.executable, str(FIXTURE)])],
                           call_timeout_s=20)
    guard = Guard(Gate(), PolicyEngine(), ledger, audit, settings.max_result_bytes,
                  _link(deployment, ledger, audit, writer))
    assert guard.recorder.shared  # one database: the crossing and its records are one transaction
    return Proxy(settings, guard, ledger), ledger, audit, tmp / "lethe.db"


def _concurrently(proxy: Proxy, calls: list[tuple[str, dict[str, Any]]], db: Path,
                  while_locked: str | None = None) -> list[tuple[Any, str | None]]:
    """Each call from its own client session, all at once. With `while_locked`, another connection
    holds the database's write lock while the calls are made, runs that statement, then commits."""
    out: list[tuple[Any, str | None]] = [(None, None)] * len(calls)

    async def one(i: int, name: str, args: dict[str, Any]) -> None:
        async with Client(proxy.server(lambda _ctx: ACME)) as client:
            try:
                out[i] = (await client.call_tool(name, args), None)
            except Exception as exc:
                out[i] = (None, str(exc))

    async def go() -> None:
        async with proxy.running():
            async with Client(proxy.server(lambda _ctx: ACME)) as warm:
                await warm.call_tool("fx__weather", {"city": "Oslo"})  # the upstream link and definitions
            lock = None
            if while_locked is not None:
                lock = sqlite3.connect(db, isolation_level=None)
                lock.execute("BEGIN IMMEDIATE")
            async with anyio.create_task_group() as tg:
                for i, (name, args) in enumerate(calls):
                    tg.start_soon(one, i, name, args)
                if lock is not None:
                    await anyio.sleep(1)  # not a timing assertion: calls that queue later fail the same way
                    lock.execute(while_locked)
                    lock.execute("COMMIT")
                    lock.close()

    anyio.run(go)
    return out


def _verifies(audit: AuditLog, tmp: Path) -> None:
    export = tmp / "audit.json"
    audit.export(export)
    report = verify_export(export, public_key_pem=audit.signer.verifier.public_key_pem)
    assert report.ok, report.errors


def test_concurrent_calls_each_commit_exactly_one_crossing_and_their_records(tmp_path: Path, writer: str) -> None:
    proxy, ledger, audit, db = _stores(tmp_path, writer)
    calls = [("fx__weather", {"city": f"city-{i}"}) if i % 3 else ("fx__read_file", {"path": f"{i}/credentials"})
             for i in range(CALLS)]
    results = _concurrently(proxy, calls, db, while_locked="SELECT 1")  # all wait on one lock: shared commits
    stamps = [r.meta["io.lethe/decision"] for r, error in results if error is None]
    assert len(stamps) == CALLS, [e for _, e in results if e]
    crossings = {c.id: c for c in ledger.crossings.list("acme")}
    assert len({s["crossing"] for s in stamps}) == CALLS and all(s["crossing"] in crossings for s in stamps)
    assert len(crossings) == CALLS + 1  # and the warm-up call's
    records = audit.list(tenant="acme", limit=1000)
    per_crossing = Counter((r.body["crossing"], r.body["kind"]) for r in records)
    assert set(per_crossing.values()) == {1} and len(per_crossing) == 2 * (CALLS + 1)
    assert {c for c, _ in per_crossing} == set(crossings)
    for s in stamps:  # the index the agent was told is its own result record, durable in the log
        record = audit.get(s["audit_index"])
        assert (record.body["kind"], record.body["crossing"]) == ("mcp-result", s["crossing"])
        assert record.body["decision"]["action"] == s["action"] == crossings[s["crossing"]].action
    assert Counter(s["action"] for s in stamps) == {"allow": 8, "redact": 4}
    # the calls' records queued at one lock shared a transaction; each is in the log before its result
    assert len({r.time for r in records if r.body["kind"] == "mcp-call"}) < CALLS + 1
    index = {(r.body["crossing"], r.body["kind"]): r.index for r in records}
    assert all(index[(c, "mcp-call")] < index[(c, "mcp-result")] for c in crossings)
    _verifies(audit, tmp_path)


def test_a_call_whose_record_fails_to_commit_never_reaches_the_upstream(tmp_path: Path, writer: str) -> None:
    """Red team F4: the call's record is durable before the upstream is called, so a call the
    proxy could not record was never made (the fixture's `touch` leaves no file)."""
    proxy, ledger, audit, db = _stores(tmp_path, writer)
    touched = tmp_path / "touched"
    results = _concurrently(proxy, [("fx__touch", {"path": str(touched)}) for _ in range(CALLS)], db,
                            while_locked=FAIL_AUDIT)
    for result, error in results:
        assert result is None and error is not None
        assert "lethe could not screen this call: the call could not be recorded (IntegrityError); " \
               "the upstream was not called" in error
    assert not touched.exists()
    # all or nothing: only the warm-up call's crossing and records
    assert [c.tool for c in ledger.crossings.list("acme")] == ["fx__weather"] and audit.size == 2


def test_a_result_whose_record_fails_to_commit_is_not_passed_on_and_its_call_stays_recorded(
        tmp_path: Path, writer: str) -> None:
    """The call's record committed, the upstream ran, the result's commit failed: the agent gets an
    error naming the call's audit record, never the result, and the log still names the call."""
    proxy, ledger, audit, db = _stores(tmp_path, writer)
    touched = tmp_path / "touched"
    results = _concurrently(proxy, [("fx__touch", {"path": str(touched)})], db,
                            while_locked=FAIL_AUDIT.replace("BEFORE INSERT ON audit_records",
                                                            "BEFORE INSERT ON audit_records WHEN NEW.kind = 'mcp-result'"))
    [(result, error)] = results
    assert result is None and error is not None and "done" not in error
    assert touched.read_text() == "called\n"
    calls = [r for r in audit.list(tenant="acme", limit=100) if r.body["tool"] == "fx__touch"]
    assert [r.body["kind"] for r in calls] == ["mcp-call"]
    assert f"the upstream was called (audit record {calls[0].index}) but nothing of its result was passed on" in error
    assert calls[0].body["crossing"] not in {c.id for c in ledger.crossings.list("acme")}
    _verifies(audit, tmp_path)


def test_a_failed_commit_fails_every_waiting_call_and_records_nothing_of_it(tmp_path: Path, writer: str) -> None:
    proxy, ledger, audit, db = _stores(tmp_path, writer)
    results = _concurrently(proxy, [("fx__read_file", {"path": f"{i}/credentials"}) for i in range(CALLS)], db,
                            while_locked=FAIL_AUDIT)
    for result, error in results:
        assert result is None and error is not None
        assert "lethe could not screen this call: the call could not be recorded (IntegrityError)" in error
        assert "AKIA" not in error and "REDACTED" not in error  # neither the result nor its redaction
    # all or nothing: only the warm-up call's crossing and records; the failed calls' crossings,
    # written in the same transaction as their audit records, were rolled back with them
    assert [c.tool for c in ledger.crossings.list("acme")] == ["fx__weather"] and audit.size == 2
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TRIGGER injected_failure")
    [(result, error)] = _concurrently(proxy, [("fx__weather", {"city": "Paris"})], db)
    assert error is None and json.loads(json.dumps(result.meta))["io.lethe/decision"]["action"] == "allow"
    _verifies(audit, tmp_path)


def test_a_writer_process_that_dies_fails_closed_and_is_replaced(tmp_path: Path) -> None:
    """Killed between batches: the next batch is either committed by a new writer or fails (it is
    never reported committed when it was not), and the one after is committed by a new writer."""
    settings = Settings(data_dir=tmp_path, database_url=None, audit_database_url=None, audit_key_path=None,
                        audit_key_pem=None)
    ledger, audit = stores(settings)
    writer = WriterProcess(settings)
    recorder = LoopRecorder(ledger, audit, writer)

    async def commit(n: int) -> int:
        crossing = CrossingLog.new(tenant="acme", session_id=None, channel="mcp", upstream="fx", tool="fx__weather",
                                   phase="result", content_sha256="0" * 64, action="allow", meta={})
        record = {"kind": "mcp-result", "tenant": "acme", "tool": "fx__weather", "n": n,
                  "content_sha256": "0" * 64, "crossing": crossing.id}
        return await asyncio.wrap_future(recorder.submit(crossing, [], [record]))

    committed: dict[int, int] = {}

    async def go() -> None:
        async with recorder.running():
            committed[0] = await commit(0)
            killed = writer.pid
            os.kill(killed, signal.SIGKILL)
            try:
                committed[1] = await commit(1)
            except WriterError as exc:
                assert exc.kind == "writer process died"
            committed[2] = await commit(2)
            assert writer.pid != killed
    anyio.run(go)
    for n, index in committed.items():
        assert audit.get(index).body["n"] == n
    assert len(ledger.crossings.list("acme")) == len(committed) == audit.size


def _entry(n: int) -> tuple[Crossing, list[str], list[dict[str, Any]]]:
    crossing = CrossingLog.new(tenant="acme", session_id=None, channel="mcp", upstream="fx", tool="fx__weather",
                               phase="result", content_sha256="0" * 64, action="allow", meta={})
    return crossing, [], [{"kind": "mcp-result", "tenant": "acme", "tool": "fx__weather", "n": n,
                           "content_sha256": "0" * 64, "crossing": crossing.id}]


def _loop_recorder(tmp: Path, commit_timeout_s: float = 30.0) -> tuple[LoopRecorder, WriterProcess, AuditLog, Path]:
    settings = Settings(data_dir=tmp, database_url=None, audit_database_url=None, audit_key_path=None,
                        audit_key_pem=None, mcp_commit_timeout_s=commit_timeout_s)
    ledger, audit = stores(settings)
    writer = WriterProcess(settings)
    return LoopRecorder(ledger, audit, writer), writer, audit, tmp / "lethe.db"


async def _failure(future: Any) -> WriterError | None:
    """The writer's failure of a submitted record, or None if it committed."""
    try:
        await asyncio.wrap_future(future)
    except WriterError as exc:
        return exc
    return None


def test_a_loop_recorder_that_is_not_serving_refuses_records_at_once(tmp_path: Path) -> None:
    recorder, _, audit, _ = _loop_recorder(tmp_path)
    before = recorder.submit(*_entry(0))
    assert isinstance(before.exception(timeout=0), RecorderStopped)

    async def serve_then_stop() -> None:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(1)))
    anyio.run(serve_then_stop)
    after = recorder.submit(*_entry(2))
    assert isinstance(after.exception(timeout=0), RecorderStopped)
    assert [audit.get(i).body["n"] for i in range(audit.size)] == [1]


def test_stopping_fails_every_record_not_known_durable_and_never_reports_one_committed_that_is_not(
        tmp_path: Path) -> None:
    """Calls queued on the loop, one from a worker thread (a large result screened off the loop),
    and one in flight behind a held write lock: when the proxy stops, each future is settled; the
    ones reported committed are in the log, the rest failed with RecorderStopped."""
    recorder, _, audit, db = _loop_recorder(tmp_path)
    futures = []

    async def go() -> None:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))  # the writer is up
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")  # the next batch waits in the writer, in flight
            futures.extend(recorder.submit(*_entry(n)) for n in (1, 2, 3))
            futures.append(await anyio.to_thread.run_sync(recorder.submit, *_entry(4)))
            await anyio.sleep(0.2)
        lock.execute("ROLLBACK")
        lock.close()
    anyio.run(go)
    outcomes = [f.exception(timeout=0) or f.result() for f in futures]
    assert all(isinstance(o, (int, RecorderStopped)) for o in outcomes), outcomes
    assert any(isinstance(o, RecorderStopped) for o in outcomes)  # the locked batch was not durable
    durable = {audit.get(i).body["n"] for i in range(audit.size)}
    for n, outcome in zip((1, 2, 3, 4), outcomes):
        if isinstance(outcome, int):
            assert audit.get(outcome).body["n"] == n and n in durable


def test_a_writer_killed_mid_commit_fails_the_batch_in_flight_and_the_next_batch_commits(tmp_path: Path) -> None:
    recorder, writer, audit, db = _loop_recorder(tmp_path)

    async def go() -> tuple[BaseException | None, int]:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            in_flight = recorder.submit(*_entry(1))
            await anyio.sleep(0.3)  # the writer holds the batch, waiting for the lock
            os.kill(writer.pid, signal.SIGKILL)
            failure = await _failure(in_flight)
            lock.execute("ROLLBACK")
            lock.close()
            return failure, await asyncio.wrap_future(recorder.submit(*_entry(2)))
    failure, index = anyio.run(go)
    assert isinstance(failure, WriterError) and failure.kind == "writer process died"
    assert [audit.get(i).body["n"] for i in range(audit.size)] == [0, 2] and audit.get(index).body["n"] == 2


def test_a_stopped_writer_fails_its_batch_at_the_commit_timeout_and_a_new_writer_commits_the_next(
        tmp_path: Path) -> None:
    """SIGSTOP: the writer neither answers nor dies. The calls must not hang: past
    LETHE_MCP_COMMIT_TIMEOUT_S the batch fails (never reported committed), the stopped writer is
    killed (so its late commit is never read as another batch's answer), and a new one commits."""
    recorder, writer, audit, _ = _loop_recorder(tmp_path, commit_timeout_s=1.0)

    async def go() -> tuple[BaseException | None, int, int]:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            stopped = writer.pid
            os.kill(stopped, signal.SIGSTOP)
            failure = await _failure(recorder.submit(*_entry(1)))
            return failure, stopped, await asyncio.wrap_future(recorder.submit(*_entry(2)))
    failure, stopped, index = anyio.run(go)
    assert isinstance(failure, WriterError) and failure.kind == "commit timed out"
    assert "LETHE_MCP_COMMIT_TIMEOUT_S" in str(failure)
    assert not Path(f"/proc/{stopped}").exists() or "zombie" in Path(f"/proc/{stopped}/status").read_text()
    assert audit.get(index).body["n"] == 2 and [audit.get(i).body["n"] for i in range(audit.size)] == [0, 2]


def _dead(pid: int) -> None:
    """Wait, without letting the loop run (so no EOF is read there), until a killed child is gone."""
    while any(p.pid == pid for p in multiprocessing.active_children()):
        time.sleep(0.001)


def test_pipelined_batches_each_get_their_own_indices_in_the_order_sent(tmp_path: Path) -> None:
    """Two batches in flight behind a held write lock and many queued behind them, entries of one to
    three records: once the lock goes, every future's index is its own entry's last record."""
    recorder, _, audit, db = _loop_recorder(tmp_path)
    futures: dict[int, Any] = {}

    async def go() -> None:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            for n in range(1, 121):
                crossing, withhold, records = _entry(n)
                futures[n] = recorder.submit(crossing, withhold, records * (1 + n % 3))
                if n % 7 == 0:
                    await anyio.sleep(0.01)  # the first batches leave one by one, into the pipeline
            lock.execute("ROLLBACK")
            lock.close()
            await asyncio.wait([asyncio.wrap_future(f) for f in futures.values()])
    anyio.run(go)
    for n, future in futures.items():
        assert audit.get(future.result()).body["n"] == n
        assert audit.get(future.result() + 1).body["n"] != n if future.result() + 1 < audit.size else True
    assert sum(1 + n % 3 for n in futures) + 1 == audit.size


def test_a_writer_found_dead_at_a_send_fails_the_batches_it_held_and_the_new_batches_commit_in_order(
        tmp_path: Path) -> None:
    """The writer dies holding a batch (waiting for a write lock); before the loop reads the EOF, a
    new call is sent: the held batch fails, a new writer takes the new calls, in the order sent."""
    recorder, writer, audit, db = _loop_recorder(tmp_path)

    async def go() -> tuple[BaseException | None, list[int]]:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            held = recorder.submit(*_entry(1))
            await anyio.sleep(0.3)  # sent: the writer waits for the lock
            os.kill(writer.pid, signal.SIGKILL)
            _dead(writer.pid)  # dead, and the loop has not run since
            later = [recorder.submit(*_entry(n)) for n in (2, 3)]  # the first send finds it dead
            failure = await _failure(held)
            lock.execute("ROLLBACK")
            lock.close()
            return failure, [await asyncio.wrap_future(f) for f in later]
    failure, indices = anyio.run(go)
    assert isinstance(failure, WriterError) and failure.kind == "writer process died"
    assert [audit.get(i).body["n"] for i in range(audit.size)] == [0, 2, 3]
    assert [audit.get(i).body["n"] for i in indices] == [2, 3]


def test_under_a_storm_of_writer_kills_every_index_reported_is_its_own_entrys_and_the_log_verifies(
        tmp_path: Path) -> None:
    """The red team's storm, at the recorder: submitters keep two batches in flight while the
    writer is SIGKILLed every 30-120 ms. Every call either fails (WriterError) or gets the index
    of its own last record, no index twice; afterwards a new writer commits and the log verifies."""
    recorder, writer, audit, _ = _loop_recorder(tmp_path)
    outcomes: dict[int, int | BaseException] = {}
    rng = random.Random(7)

    async def submitter(first: int) -> None:
        for n in range(first, first + 60):
            crossing, withhold, records = _entry(n)
            try:
                outcomes[n] = await asyncio.wrap_future(recorder.submit(crossing, withhold, records * (1 + n % 3)))
            except WriterError as exc:
                outcomes[n] = exc

    async def storm() -> None:
        for _ in range(25):
            await anyio.sleep(rng.uniform(0.03, 0.12))
            try:
                os.kill(writer.pid, signal.SIGKILL)
            except (ProcessLookupError, AttributeError, TypeError):  # between writers
                pass

    async def go() -> int:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            async with anyio.create_task_group() as tg:
                for k in range(6):
                    tg.start_soon(submitter, 1000 * (k + 1))
                tg.start_soon(storm)
            return await asyncio.wrap_future(recorder.submit(*_entry(1)))
    last = anyio.run(go)
    committed = {n: i for n, i in outcomes.items() if isinstance(i, int)}
    assert all(isinstance(o, (int, WriterError)) for o in outcomes.values())
    assert committed and len(committed) < len(outcomes)  # the storm both failed calls and let calls through
    assert len(set(committed.values())) == len(committed)
    for n, index in committed.items():
        assert audit.get(index).body["n"] == n
        assert index + 1 == audit.size or audit.get(index + 1).body["n"] != n  # its last record
    assert audit.get(last).body["n"] == 1
    _verifies(audit, tmp_path)


def _inline_recorder(tmp: Path) -> tuple[LoopRecorder, InlineFirst, WriterProcess, AuditLog, Ledger, Path]:
    settings = Settings(data_dir=tmp, database_url=None, audit_database_url=None, audit_key_path=None,
                        audit_key_pem=None)
    ledger, audit = stores(settings)
    link = writer_link(settings, ledger, audit)
    assert isinstance(link, InlineFirst)
    process = link.fallback
    assert isinstance(process, WriterProcess)
    return LoopRecorder(ledger, audit, link), link, process, audit, ledger, tmp / "lethe.db"


def test_with_the_lock_free_a_batch_is_durable_before_submit_returns_and_the_log_verifies(tmp_path: Path) -> None:
    recorder, link, _, audit, ledger, _ = _inline_recorder(tmp_path)

    async def go() -> list[int]:
        async with recorder.running():
            futures = [recorder.submit(*_entry(n)) for n in range(5)]
            assert all(f.done() for f in futures)  # committed on the loop, inside submit: no hand-off
            from_thread = await anyio.to_thread.run_sync(recorder.submit, *_entry(5))  # a guard thread's call
            return [f.result() for f in futures] + [await asyncio.wrap_future(from_thread)]
    indices = anyio.run(go)
    assert link.inline == 6 and [audit.get(i).body["n"] for i in indices] == list(range(6))
    assert len(ledger.crossings.list("acme")) == 6 == audit.size
    _verifies(audit, tmp_path)


def test_a_lock_held_elsewhere_never_blocks_the_loop_and_the_writer_process_commits_in_order_once_free(
        tmp_path: Path) -> None:
    """Another writer (the chat endpoint, a replica) holds the SQLite lock: the calls go to the
    writer process, none is reported committed while the lock is held, and the loop keeps running
    (were the inline commit to wait for the lock, it would block this very loop, which releases it).
    Once free, they commit in the order sent; with the process idle again, commits return to the loop."""
    recorder, link, _, audit, _, db = _inline_recorder(tmp_path)

    async def go() -> tuple[list[int], int]:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            futures = []
            for n in (1, 2, 3):
                futures.append(recorder.submit(*_entry(n)))
                await anyio.sleep(0.1)  # separate batches, each sent while the lock is held
            assert not any(f.done() for f in futures) and link.inline == 1
            lock.execute("ROLLBACK")
            lock.close()
            indices = [await asyncio.wrap_future(f) for f in futures]
            after = recorder.submit(*_entry(4))
            assert after.done()
            return indices, after.result()
    indices, last = anyio.run(go)
    assert [audit.get(i).body["n"] for i in indices] == [1, 2, 3] and indices == sorted(indices)
    assert link.inline == 2 and audit.get(last).body["n"] == 4 and audit.size == 5
    _verifies(audit, tmp_path)


def test_an_inline_commit_that_fails_fails_its_batch_at_once_and_records_nothing_of_it(tmp_path: Path) -> None:
    recorder, link, _, audit, ledger, db = _inline_recorder(tmp_path)

    async def go() -> tuple[BaseException | None, int]:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            with sqlite3.connect(db) as conn:
                conn.execute(FAIL_AUDIT)
            failed = recorder.submit(*_entry(1))
            assert failed.done()
            with sqlite3.connect(db) as conn:
                conn.execute("DROP TRIGGER injected_failure")
            return failed.exception(), await asyncio.wrap_future(recorder.submit(*_entry(2)))
    failure, index = anyio.run(go)
    assert type(failure).__name__ == "IntegrityError" and "injected: disk quota exceeded" in str(failure)
    assert [audit.get(i).body["n"] for i in range(audit.size)] == [0, 2] and audit.get(index).body["n"] == 2
    assert len(ledger.crossings.list("acme")) == 2 and link.inline == 2  # the failed batch's crossing rolled back too


def test_commits_stay_off_the_loop_for_two_databases_or_when_turned_off(tmp_path: Path) -> None:
    """Two databases are two transactions: a lock found busy at the second would leave the first
    committed, so a writer that does not wait is refused there, and the proxy keeps the process."""
    base = {"data_dir": tmp_path, "database_url": None, "audit_key_path": None, "audit_key_pem": None}
    apart = Settings(**base, audit_database_url=f"sqlite:///{tmp_path / 'audit-apart.db'}")
    ledger, audit = stores(apart)
    with pytest.raises(ValueError, match="one database"):
        local_writer(ledger, audit, wait=False)
    assert isinstance(writer_link(apart, ledger, audit), WriterProcess)
    off = Settings(**base, audit_database_url=None, mcp_inline_commit=False)
    assert isinstance(writer_link(off, *stores(off)), WriterProcess)


def test_a_commit_stalled_by_a_slow_disk_sends_the_next_batches_to_the_writer_process(tmp_path: Path) -> None:
    """The red team's slow disk (an fsync delayed 20 s) froze the loop, and every agent, for each
    commit. Injected here: a commit on the loop that takes longer than `STALL_S`. That batch is
    committed; the next ones go to the writer process (where the commit timeout holds) for `BACKOFF_S`."""
    settings = Settings(data_dir=tmp_path, database_url=None, audit_database_url=None, audit_key_path=None,
                        audit_key_pem=None)
    ledger, audit = stores(settings)
    inline = local_writer(ledger, audit, wait=False)

    def slow_disk(rows: Any, records: Any) -> list[int]:
        indices = inline(rows, records)
        time.sleep(InlineFirst.STALL_S * 2)
        return indices
    link = InlineFirst(slow_disk, WriterProcess(settings))
    recorder = LoopRecorder(ledger, audit, link)

    async def go() -> list[int]:
        async with recorder.running():
            stalled = recorder.submit(*_entry(0))
            assert stalled.done()  # committed on the loop, slowly
            later = [recorder.submit(*_entry(n)) for n in (1, 2)]
            assert not any(f.done() for f in later)  # handed to the writer process
            return [stalled.result()] + [await asyncio.wrap_future(f) for f in later]
    indices = anyio.run(go)
    assert link.inline == 1 and [audit.get(i).body["n"] for i in indices] == [0, 1, 2]
    _verifies(audit, tmp_path)


def test_under_a_lock_held_past_the_commit_timeout_every_call_fails_at_its_own_timeout(tmp_path: Path) -> None:
    """The red team's 40 s lock: the first call failed at the 3 s commit timeout, the next waited 36 s,
    since its replacement writer opened its stores (which takes the lock) inside the 120 s start-up
    allowance. Now each call fails within its own commit timeout while the lock is held, and once
    it is released the next call commits. (The 30 s bound only keeps a regression from hanging the suite.)"""
    recorder, writer, audit, db = _loop_recorder(tmp_path, commit_timeout_s=1.0)

    async def go() -> tuple[list[BaseException | None], int]:
        async with recorder.running():
            await asyncio.wrap_future(recorder.submit(*_entry(0)))
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            failures = []
            with anyio.fail_after(30):
                for n in (1, 2, 3):
                    failures.append(await _failure(recorder.submit(*_entry(n))))
            lock.execute("ROLLBACK")
            lock.close()
            return failures, await asyncio.wrap_future(recorder.submit(*_entry(4)))
    failures, index = anyio.run(go)
    assert all(isinstance(f, WriterError) and f.kind == "commit timed out" for f in failures), failures
    assert [audit.get(i).body["n"] for i in range(audit.size)] == [0, 4] and audit.get(index).body["n"] == 4


def test_a_call_its_caller_abandons_still_gets_its_outcome_recorded(tmp_path: Path) -> None:
    """Red team F4: an agent that gives up on a call the upstream is running (the MCP client
    cancels it) leaves the call's record and a crossing that says the caller went away: the
    upstream ran, and the log says so and what became of it."""
    proxy, ledger, audit, _ = _stores(tmp_path, "inline-first")

    async def go() -> None:
        async with proxy.running(), Client(proxy.server(lambda _ctx: ACME)) as client:
            with anyio.move_on_after(1):
                await client.call_tool("fx__hang", {})
            for _ in range(100):  # the cancellation reaches the proxy's handler asynchronously
                if any(c.tool == "fx__hang" for c in ledger.crossings.list("acme")):
                    break
                await anyio.sleep(0.1)
    anyio.run(go)
    [crossing] = [c for c in ledger.crossings.list("acme") if c.tool == "fx__hang"]
    assert crossing.action == "quarantine" and crossing.meta["decision"]["reasons"] == ["caller_gone: CancelledError"]
    records = {r.body["kind"]: r for r in audit.list(tenant="acme", limit=100) if r.body["tool"] == "fx__hang"}
    assert set(records) == {"mcp-call", "mcp-result"}
    assert records["mcp-call"].body["crossing"] == records["mcp-result"].body["crossing"] == crossing.id
    assert crossing.meta["call"]["audit_index"] == records["mcp-call"].index
    _verifies(audit, tmp_path)


def test_a_database_deleted_under_the_proxy_fails_every_call_and_none_reaches_the_upstream(
        tmp_path: Path, writer: str) -> None:
    """Red team F9: records committed into a database file deleted under the proxy were lost.
    Each call now fails at its record's commit, naming the file, and never reaches the upstream."""
    proxy, _, _, db = _stores(tmp_path, writer)
    touched = tmp_path / "touched"
    out: list[str] = []

    async def go() -> None:
        async with proxy.running(), Client(proxy.server(lambda _ctx: ACME)) as client:
            await client.call_tool("fx__weather", {"city": "Oslo"})  # the stores are open
            for f in tmp_path.glob("lethe.db*"):
                f.unlink()
            for _ in range(2):
                with pytest.raises(Exception) as raised:
                    await client.call_tool("fx__touch", {"path": str(touched)})
                out.append(str(raised.value))
    anyio.run(go)
    for error in out:
        assert "the call could not be recorded (AuditError); the upstream was not called" in error
    assert not touched.exists()
