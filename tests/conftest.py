"""Shared fixtures: the real SmolLM2 (loaded once per session) and a tiny random Llama.

The real model is converted on first use into ``var/models`` under the repository root, or into
``$LETHE_MODEL_CACHE_DIR`` when set (the conversion takes ~30 s once; later loads ~1 s).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


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
