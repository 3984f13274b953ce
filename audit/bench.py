"""`lethe bench audit`: append throughput and proof latency, as JSON numbers.

Appends are timed three ways: one durable ``append`` per record (one commit and fsync each), and
``append_many`` in batches of 64 (one commit per batch; the batching the issue allows). The tree is
then filled to ``records`` with ``append_many`` in batches of 10,000 (the same code path, larger
transactions), and inclusion and consistency proofs are generated from the database and verified
against the signed checkpoint at that size. An existing log with enough records is reused.
Separately, an honest export of 10^5 records is verified offline (``audit.verify``), timed whole.
"""
from __future__ import annotations

import hashlib
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .keys import Signer
from .log import AuditLog

__all__ = ["run_audit_bench"]

FILL_BATCH = 10_000
PROOF_SAMPLES = 300


def _record(i: int) -> dict[str, Any]:
    """A forget record of realistic size (its witness included)."""
    return {
        "kind": "forget",
        "tenant": f"tenant-{i % 17}",
        "session": f"session-{i % 1009}",
        "segment_id": f"seg-{i}",
        "span": [i % 4096, i % 4096 + 37],
        "token_count": 37,
        "content_sha256": hashlib.sha256(str(i).encode()).hexdigest(),
        "gate": {"verdict": "block", "rules": ["aws-key"]},
        "decision": {"action": "forget", "reasons": ["secret"], "bundle_hash": "b" * 64},
        "actor": "bench",
        "witness": {
            "kind": "never-saw", "equal": True, "argmax_equal": True,
            "max_abs_dk": 0.0, "max_abs_dv": 0.0, "max_abs_dlogits": 0.0,
            "digest_edited": "d" * 64, "digest_reference": "d" * 64, "survivors_sha256": "e" * 64,
            "tokens": 4096, "spans": [[i % 4096, i % 4096 + 37]],
        },
    }


def _rate(n: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return round(n / (time.perf_counter() - start), 1)


def _ms(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50": round(statistics.median(samples) * 1e3, 3),
        "p95": round(samples[int(len(samples) * 0.95) - 1] * 1e3, 3),
        "max": round(samples[-1] * 1e3, 3),
    }


def _fill(log: AuditLog, records: int, progress: bool) -> float:
    start, todo = time.perf_counter(), records - log.size
    bar = None
    if progress and todo > 0:
        from tqdm import tqdm

        bar = tqdm(total=todo, desc="audit fill", unit="rec")
    while (n := min(FILL_BATCH, records - log.size)) > 0:
        base = log.size
        log.append_many([_record(base + i) for i in range(n)])
        if bar:
            bar.update(n)
    if bar:
        bar.close()
    return round(time.perf_counter() - start, 1)


def _proofs(log: AuditLog) -> dict[str, Any]:
    cp = log.checkpoint()
    rng = random.Random(9162)
    inclusion, consistency = [], []
    for _ in range(PROOF_SAMPLES):
        index = rng.randrange(cp.size)
        start = time.perf_counter()
        proof = log.inclusion_proof(index, cp.size)
        proof.verify(bytes.fromhex(log.get(index).leaf_hash), cp.root_hash)
        inclusion.append(time.perf_counter() - start)
    older = log.checkpoints(max_size=cp.size - 1)
    for old in rng.sample(older, min(PROOF_SAMPLES, len(older))):
        start = time.perf_counter()
        log.consistency_proof(old.size, cp.size).verify(old.root_hash, cp.root_hash)
        consistency.append(time.perf_counter() - start)
    return {
        "tree_size": cp.size,
        "inclusion_ms": _ms(inclusion),
        "consistency_ms": _ms(consistency),
        "proof_hashes": len(log.inclusion_proof(0, cp.size).hashes),
        "note": "each sample = proof generation from the database + the record fetch (inclusion) + verification",
    }


def _bench_backend(url: str, key: Path, records: int, progress: bool) -> dict[str, Any]:
    log = AuditLog(url, Signer.load_or_create(key), batch_size=64)
    single, batched = 300, 64 * 100
    result: dict[str, Any] = {
        "append_single_per_s": _rate(single, lambda: [log.append(_record(i)) for i in range(single)]),
        "append_batched_64_per_s": _rate(
            batched, lambda: [log.append_many([_record(i) for i in range(64)]) for _ in range(batched // 64)]
        ),
    }
    result["fill_s"] = _fill(log, records, progress)
    result["fill_method"] = f"append_many in batches of {FILL_BATCH} (the normal append path)"
    result.update(_proofs(log))
    log.close()
    return result


def _timed_verify(path: Path, pem: str, workers: int, runs: int) -> dict[str, Any]:
    """The best of ``runs`` verifications with ``workers`` processes: wall seconds, this process's
    CPU seconds (a forked process's CPU is not counted in it), and how many processes read the records."""
    from .verify import verify_export

    seconds, cpu = [], []
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        report = verify_export(path, public_key_pem=pem, workers=workers)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if not report.ok:
            raise RuntimeError(f"the honest bench export did not verify: {report.errors[:3]}")
    return {"s": round(min(seconds), 3), "s_runs": [round(x, 3) for x in seconds], "cpu_s": round(min(cpu), 3),
            "checkpoints": report.checked.get("checkpoint_signatures", 0), "processes": report.processes}


def _verify_bench(tmp: Path, records: int, runs: int = 3) -> dict[str, Any]:
    """Offline verification of an honest export of ``records`` records, one signed checkpoint per
    64 (as the gateway batches), anchored to the pinned genesis key: file read, parse and every
    check, as ``python -m audit.verify`` runs them, on one core and on two (part of the records
    read in a forked process; the default from ``verify_records.PARALLEL_FROM`` bytes)."""
    signer = Signer.generate()
    log = AuditLog(f"sqlite:///{tmp / 'verify-bench.db'}", signer, batch_size=64)
    for start in range(0, records, FILL_BATCH):
        batch = [_record(i) for i in range(start, min(records, start + FILL_BATCH))]
        for k in range(0, len(batch), 64):
            log.append_many(batch[k : k + 64])
    path = tmp / "verify-bench.json"
    log.export(path)
    log.close()
    load_at_start = os.getloadavg()[0]
    one = _timed_verify(path, signer.public_key_pem, 1, runs)
    two = _timed_verify(path, signer.public_key_pem, 2, runs) if (os.cpu_count() or 1) >= 2 else None
    best = two if two is not None and two["s"] < one["s"] else one
    return {
        "records": records,
        "export_mb": round(path.stat().st_size / 1e6, 1),
        "checkpoints": one["checkpoints"],
        "verify_s": best["s"],
        "verify_s_is": "two_cores" if best is two else "one_core",
        "one_core_s": one["s"],
        "one_core_s_runs": one["s_runs"],
        "one_core_cpu_s": one["cpu_s"],
        "two_cores_s": two and two["s"],
        "two_cores_s_runs": two and two["s_runs"],
        "two_cores_parent_cpu_s": two and two["cpu_s"],
        "two_cores_processes": two and two["processes"],
        "records_per_s": round(records / best["s"]),
        "target_s": 1.0,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "load_average_1m_at_start": round(load_at_start, 2),
        "cpus": os.cpu_count(),
        "note": "file read + parse (the log's own layout, a block at a time: orjson, no duplicate name and RFC 8785 "
        "bodies proven by comparison) + every check (leaf hashes, tree, signatures, witnesses, key chain, header); "
        "two_cores: a forked process reads part of the records (two_cores_processes says whether it did); verify_s is the "
        "faster of one_core_s and two_cores_s (verify_s_is says which); CPU = this process only; wall times "
        "depend on the machine's load (load_average_1m)",
    }


def run_audit_bench(
    *,
    sqlite_path: Path | None = None,
    postgres_url: str | None = None,
    records: int = 1_000_000,
    verify_records: int = 100_000,
    progress: bool = True,
) -> dict[str, Any]:
    """Benchmark SQLite (a temporary file unless ``sqlite_path``) and, if given, PostgreSQL, and
    the offline verification of an honest export of ``verify_records`` records (0: skip)."""
    out: dict[str, Any] = {"records": records, "targets": {"append_per_s_sqlite": 2000, "proof_ms": 5, "verify_1e5_s": 1.0}}
    with tempfile.TemporaryDirectory() as tmp:
        if verify_records:
            out["verify"] = _verify_bench(Path(tmp), verify_records)
        path = Path(sqlite_path) if sqlite_path else Path(tmp) / "audit-bench.db"
        out["sqlite"] = _bench_backend(f"sqlite:///{path}", path.with_suffix(".key"), records, progress)
        if postgres_url:
            out["postgresql"] = _bench_backend(postgres_url, path.with_suffix(".pg.key"), records, progress)
    return out
