"""Two `lethe serve` processes on loopback sharing one PostgreSQL: a session moves between them.

The same scenario as `make compose-smoke` (deploy/two_replicas.py), without containers: two
replicas on free loopback ports (never fixed ones: a server left on one by a killed run would
answer in their place), one fresh database per run (dropped afterwards)
on the PostgreSQL at 127.0.0.1:5432, one audit key and one salt secret shared by both, policies
from the embedded engine. Replica 1 is SIGKILLed in the middle of a streamed turn and restarted.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy.two_replicas import Keys, Scenario, lethe_cli, table, wait_ready
from gateway.wiring import free_ports
from tests.conftest import fresh_pg_database

# Two model loads, two kernel calibrations and a restart: minutes on a busy 2-core machine.
pytestmark = [pytest.mark.model, pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(2400)]

@dataclass
class ServeProcess:
    """`lethe serve` in its own process, its log kept in a file."""

    name: str
    port: int
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port)],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT)
        wait_ready(self.url, alive=lambda: self.proc is not None and self.proc.poll() is None)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh database per run, dropped afterwards, so runs never collide."""
    yield from fresh_pg_database("lethe_replicas")


@pytest.fixture(scope="module")
def deployment(database: str, model_cache_dir: Path, tmp_path_factory) -> Iterator[tuple[list[ServeProcess], Keys, dict]]:
    root = tmp_path_factory.mktemp("replicas")
    secrets = root / "secrets"  # what the compose file mounts as Docker secrets
    env = {**os.environ, "LETHE_DATABASE_URL": database, "LETHE_POLICY_BACKEND": "embedded",
           "LETHE_AUDIT_KEY_PATH": str(secrets / "audit-key.pem"), "LETHE_SALT_SECRET_PATH": str(secrets / "salt.key"),
           "LETHE_ADMIN_KEY": "lethe-admin-" + uuid.uuid4().hex, "LETHE_MODEL_CACHE_DIR": str(model_cache_dir),
           "LETHE_LOG_JSON": "true", "LETHE_DEBUG": "true"}
    env.pop("LETHE_CONFIG", None)
    keys = Keys(tenant="", admin=env["LETHE_ADMIN_KEY"])
    for step in (["tenant", "create", "travel"], ["key", "create", "--tenant", "travel", "--user", "alice", "--admin"]):
        done = lethe_cli(*step, env={**env, "LETHE_DATA_DIR": str(root / "cli")})
        assert done.returncode == 0, done.stdout + done.stderr
    keys.tenant = done.stdout.strip().splitlines()[-1]
    replicas = [ServeProcess(f"replica-{n}", port, {**env, "LETHE_DATA_DIR": str(root / f"r{n}")}, root / f"r{n}.log")
                for n, port in enumerate(free_ports(2), 1)]
    try:
        for replica in replicas:
            replica.start()
        yield replicas, keys, env
    finally:
        for replica in replicas:
            replica.kill()


@pytest.fixture(scope="module")
def checks(deployment):
    (r1, r2), keys, env = deployment

    def export(path: Path) -> None:
        done = lethe_cli("audit", "export", "--out", str(path), env={**env, "LETHE_DATA_DIR": str(path.parent)})
        assert done.returncode == 0, done.stdout + done.stderr

    result = Scenario(r1, r2, keys, export).run()
    print("\n" + table(result))
    return {c.step: c for c in result}


def _passes(checks: dict, step: str) -> None:
    check = checks[step]
    assert check.ok, f"{step}: {check.detail}"


def test_tool_results_follow_policy_on_replica_1(checks):
    _passes(checks, "r1: clean, injected, secret tool results")


def test_replica_2_rebuilds_the_session_with_replica_1s_cache_digest(checks):
    _passes(checks, "r2: session rebuilt from the ledger")


def test_session_continued_on_replica_2_matches_on_replica_1(checks):
    _passes(checks, "r2: session continues, r1 agrees")


def test_forget_through_replica_2_equals_never_saw_on_both(checks):
    _passes(checks, "r2: forget = never saw, on both")


def test_audit_log_verifies_through_each_replica(checks):
    _passes(checks, "audit verify --url r1")
    _passes(checks, "audit verify --url r2 (r1's checkpoint)")


def test_audit_export_verifies(checks):
    _passes(checks, "audit verify --export")


def test_replica_killed_mid_turn_loses_nothing_acknowledged(checks):
    _passes(checks, "r1 killed mid-turn, restarted: nothing lost")
