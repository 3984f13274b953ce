"""API keys: the MCP proxy's cache of found keys (gateway/tenants.py) on a real SQLite store."""
from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import delete

from gateway.tenants import TenantStore, hash_key, keys_table


def _store(tmp_path: Path, cache_s: float) -> tuple[TenantStore, str]:
    store = TenantStore.from_url(f"sqlite:///{tmp_path / 'lethe.db'}", cache_s=cache_s)
    store.create_tenant("acme")
    return store, store.create_key("acme", user="agent")


def test_a_found_key_is_remembered_and_an_unknown_one_never(tmp_path: Path) -> None:
    store, key = _store(tmp_path, cache_s=3600)
    assert store.cached(key) is None  # nothing is remembered before a look-up
    found = store.authenticate(key)
    assert found is not None and found.tenant == "acme" and store.cached(key) == found
    assert store.authenticate("lth_not-a-key") is None and store.cached("lth_not-a-key") is None


def test_a_key_deleted_from_the_database_is_forgotten_at_the_next_look_up(tmp_path: Path) -> None:
    store, key = _store(tmp_path, cache_s=3600)
    store.authenticate(key)
    with store._engine.begin() as c:
        c.execute(delete(keys_table).where(keys_table.c.key_sha256 == hash_key(key)))
    assert store.authenticate(key) is None and store.cached(key) is None


def test_a_remembered_key_expires_after_cache_s(tmp_path: Path) -> None:
    store, key = _store(tmp_path, cache_s=0.01)
    store.authenticate(key)
    time.sleep(0.05)
    assert store.cached(key) is None


def test_a_store_without_cache_s_remembers_nothing(tmp_path: Path) -> None:
    store, key = _store(tmp_path, cache_s=0.0)
    assert store.authenticate(key) is not None and store.cached(key) is None
