"""Shared fixtures: the real SmolLM2 (loaded once per session) and a tiny random Llama.

The real model is converted on first use into ``var/models`` under the repository root, or into
``$LETHE_MODEL_CACHE_DIR`` when set (the conversion takes ~30 s once; later loads ~1 s).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def fresh_pg_database(prefix: str) -> Iterator[str]:
    """A fresh PostgreSQL database (dropped afterwards), so runs never collide; skips, naming the
    server, when PostgreSQL is unreachable."""
    import sqlalchemy as sa

    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    except sa.exc.OperationalError as e:
        admin.dispose()
        pytest.skip(f"PostgreSQL at {PG_ADMIN_URL} is unreachable: {e.__class__.__name__}")
    yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.dispose()


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    return Path(os.environ.get("LETHE_MODEL_CACHE_DIR") or REPO_ROOT / "var" / "models")


@pytest.fixture(scope="session")
def real_model(model_cache_dir: Path):
    from kvkernel import load_model

    return load_model(cache_dir=model_cache_dir, progress=False)


@pytest.fixture(scope="session")
def real_kernel(real_model):
    from kvkernel import Kernel

    kernel = Kernel(real_model)
    yield kernel
    kernel.close()


@pytest.fixture(scope="session")
def tiny_model():
    from kvkernel import tiny_random_model

    return tiny_random_model(0)


@pytest.fixture(scope="session")
def tiny_kernel(tiny_model):
    from kvkernel import Kernel

    kernel = Kernel(tiny_model)
    yield kernel
    kernel.close()
