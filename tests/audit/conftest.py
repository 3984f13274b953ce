"""Shared fixtures: a signer, fresh SQLite and PostgreSQL logs, a record factory, an honest export, a forger."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from audit import AuditLog, Signer
from tests.conftest import fresh_pg_database



def forget_witness(span: list[int], tokens: int = 100) -> dict[str, Any]:
    """A never-saw witness of the shape ``kvkernel.witness.ForgetWitness.to_dict()`` gives."""
    return {
        "kind": "never-saw", "equal": True, "argmax_equal": True,
        "max_abs_dk": 0.0, "max_abs_dv": 0.0, "max_abs_dlogits": 0.0,
        "digest_edited": "e3b0c442", "digest_reference": "e3b0c442",
        "survivors_sha256": "0" * 64, "tokens": tokens, "spans": [list(span)],
    }


def amortize_witness(span: list[int]) -> dict[str, Any]:
    """The shape of ``kvkernel.witness.AmortizeWitness.to_dict()`` (its measured divergence included)."""
    return {
        "kind": "amortize", "never_saw": False, "span": list(span), "replacement_tokens": 3, "shift": -2,
        "kl_mean": 0.03, "kl_max": 0.2, "argmax_agreement": 0.9, "max_abs_dlogits": 1.5, "probe_positions": 8,
    }


def make_record(i: int, *, tenant: str = "acme", kind: str = "forget") -> dict[str, Any]:
    record: dict[str, Any] = {
        "kind": kind,
        "tenant": tenant,
        "session": f"s{i % 3}",
        "segment_id": f"seg-{i}",
        "span": [i, i + 5],
        "token_count": 5,
        "content_sha256": f"{i:064x}",
        "decision": {"action": kind, "reasons": ["secret"], "bundle_hash": "b" * 64},
        "actor": "test",
    }
    if kind in ("forget", "retention-forget"):
        record["witness"] = forget_witness(record["span"])
    if kind == "amortize":
        record["witness"] = amortize_witness(record["span"])
    return record


@pytest.fixture
def record() -> Callable[..., dict[str, Any]]:
    return make_record


@pytest.fixture
def signer() -> Signer:
    return Signer.generate()


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'audit.db'}"


@pytest.fixture
def sqlite_log(sqlite_url: str, signer: Signer) -> Iterator[AuditLog]:
    log = AuditLog(sqlite_url, signer, batch_size=8)
    yield log
    log.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database per test (dropped afterwards), so runs never collide."""
    yield from fresh_pg_database("audit_test")


def _load_forge() -> ModuleType:
    """tests/audit/forge.py, the attacker's toolkit (test directories are not packages here)."""
    spec = importlib.util.spec_from_file_location("audit_forge", Path(__file__).with_name("forge.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def forge() -> ModuleType:
    return _load_forge()


@pytest.fixture
def honest(tmp_path, signer) -> Iterator[tuple[AuditLog, dict[str, Any], Path]]:
    """A log of every kind (forgets, quarantines, amortizes, retention-forgets, policy bundles) and
    its export, parsed; the export file and the genesis key PEM lie in ``tmp_path``."""
    log = AuditLog(f"sqlite:///{tmp_path / 'honest.db'}", signer, batch_size=8)
    kinds = ["forget", "quarantine", "amortize", "retention-forget", "policy-bundle"]
    for start in range(0, 20, 4):  # checkpoints at 8 and 16; the export signs 20
        log.append_many([make_record(i, kind=kinds[i % 5]) for i in range(start, start + 4)])
    log.export(tmp_path / "export.json")
    (tmp_path / "genesis.pem").write_text(signer.public_key_pem)
    yield log, json.loads((tmp_path / "export.json").read_text()), tmp_path / "export.json"
    log.close()


@pytest.fixture
def two_processes() -> Callable[..., dict[str, Any]]:
    """``verify_export(path, workers=2)`` in a fresh interpreter (errors, checked, anchor, processes):
    the verifier forks only a one-threaded process, and in a whole test run earlier tests leave
    threads in this one."""
    return _two_processes


_TWO = ("import json, pathlib, sys; from audit.verify import verify_export; a = json.load(sys.stdin); "
        "r = verify_export(pathlib.Path(a.pop('path')), workers=2, **a); "
        "print(json.dumps({'errors': r.errors, 'checked': r.checked, 'anchor': r.anchor, 'processes': r.processes}))")


def _two_processes(path: Any, **kwargs: Any) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _TWO], input=json.dumps({"path": str(path), **kwargs}),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])
