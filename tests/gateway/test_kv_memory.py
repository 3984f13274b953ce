"""KV memory on a live gateway with the real SmolLM2: a budget that evicts, exact restores, a 503
with Retry-After when nothing fits, metrics, and erasure that reaches the offloaded copies (the
span's K/V bytes are searched for in every byte of the offload directory)."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.config import Settings
from gateway.demo import CONFIG_FILE, local_gateway
from gateway.service import Gateway

pytestmark = pytest.mark.model

PORT = int(os.environ.get("LETHE_TEST_PORT", "18121")) + 1  # beside the shared live gateway's port
MB = 1 << 20


BUDGET = 40 * MB  # about two idle sessions and one running turn of these (128-row buckets, 69 KB a row)


@pytest.fixture(scope="module")
def kv(real_model) -> Iterator[tuple[httpx.Client, Gateway, Path]]:
    """One gateway for the module (a start calibrates the kernel); every test uses its own sessions."""
    s = Settings(max_new_tokens=4, lock_timeout_s=5.0, log_json=True, debug=True, retention_sweep_s=3600,
                 kv_budget_bytes=BUDGET, metrics_public=True)
    with local_gateway(s, model=real_model, port=PORT) as gw:
        state = gw.app.state.lethe
        with httpx.Client(base_url=gw.base, headers={"Authorization": f"Bearer {gw.key}"}, timeout=300) as http:
            yield http, state.gateway, Path(state.settings.data_dir) / "kv-offload"


def chat(http: httpx.Client, messages: list[dict], session: str | None = None) -> httpx.Response:
    headers = {"X-Lethe-Session": session} if session else {}
    return http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2},
                     headers=headers)


def tool_messages(tag: str, content: str | None = None) -> list[dict]:
    return [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"read the file for task {tag}"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1",
             "content": content or f"inventory {tag}: " + ", ".join(f"{tag}-item-{i} qty {i * 7 % 13}" for i in range(12))}]


def start(http: httpx.Client, tag: str, content: str | None = None) -> str:
    response = chat(http, tool_messages(tag, content))
    assert response.status_code == 200, response.text
    return response.headers["x-lethe-session"]


def tool_segment(gw: Gateway, sid: str) -> tuple[int, int]:
    seg = [s for s in gw.p.ledger.segments(sid) if s.role == "tool"][-1]
    return seg.start, seg.end


def needles(gw: Gateway, sid: str, span: tuple[int, int]) -> dict[bytes, str]:
    """The span's rotated-K and V rows, one needle per (layer >= 1, head, position): a layer-0 row
    depends on its token alone and may legitimately recur wherever that token does."""
    cache = gw.cache(sid)
    a, b = span
    out = {}
    for layer in range(1, cache.memory().layers):
        k, v, _raw = cache.layer_kv(layer)
        for name, plane in (("K", k), ("V", v)):
            for h in range(plane.shape[0]):
                for p in range(a + 2, b):
                    out[plane[h, p].numpy().tobytes()] = f"{name} layer {layer} head {h} position {p}"
    return out


def found(directory: Path, wanted: dict[bytes, str]) -> list[str]:
    """Which needles occur at any byte offset of any file (copies and tmp files) in the directory:
    every offset's first 8 bytes are matched against the needles' (numpy), candidates compared in full."""
    first: dict[bytes, list[bytes]] = {}
    for n in wanted:
        first.setdefault(n[:8], []).append(n)
    keys = np.frombuffer(b"".join(first), dtype="<u8")
    hits = []
    for path in (p for p in directory.rglob("*") if p.is_file()):
        blob = path.read_bytes()
        for shift in range(8):
            words = np.frombuffer(blob[shift:len(blob) - (len(blob) - shift) % 8], dtype="<u8")
            for at in np.nonzero(np.isin(words, keys))[0]:
                offset = shift + 8 * int(at)
                hits += [wanted[n] for n in first[blob[offset:offset + 8]] if blob[offset:offset + len(n)] == n]
    return hits


def evict(http: httpx.Client, gw: Gateway, sid: str, tag: str) -> None:
    """New sessions until `sid` leaves memory for the offload tier."""
    for i in range(6):
        start(http, f"{tag}{i}")
        if gw.residency.offload.copy_of(sid) is not None:
            return
    raise AssertionError(f"session {sid} was never offloaded")


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0



def test_offloaded_session_restores_bit_exact_and_metrics_move(kv):
    http, gw, directory = kv
    sid = start(http, "alpha")
    reference = gw.cache(sid).clone()
    evict(http, gw, sid, "evict")
    assert gw.cache(sid) is None  # nothing of it in memory, not even the session's object
    assert metric(http, "lethe_kv_offloads_total") >= 1 and metric(http, "lethe_kv_offloaded_bytes") > 0
    assert any(directory.iterdir())
    response = chat(http, tool_messages("alpha") + [{"role": "user", "content": "and now?"}], session=sid)
    assert response.status_code == 200, response.text
    assert metric(http, 'lethe_kv_restores_total{result="hit"}') >= 1
    assert metric(http, "lethe_kv_restore_seconds_count") >= 1
    restored = gw.cache(sid)
    n = len(reference)
    assert restored.tokens[:n] == reference.tokens
    for layer in range(reference.memory().layers):
        for got, want in zip(restored.layer_kv(layer), reference.layer_kv(layer)):
            assert float((got[:, :n] - want).abs().max()) == 0.0
    gw.p.ledger.check_invariants(sid, cache_len=len(restored))
    assert 0 < metric(http, "lethe_kv_resident_bytes") <= BUDGET


def test_a_turn_that_cannot_fit_gets_503_with_retry_after_and_nothing_is_admitted(kv):
    http, gw, _ = kv
    start(http, "bystander")  # another session, idle and resident
    held = {s.record.id: len(s.cache) for s in gw.sessions.all() if len(s.cache)}
    gw.residency.budget = 4 * MB  # less than one turn of this model needs
    try:
        response = chat(http, tool_messages("toolarge"))
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        error = response.json()["error"]
        assert error["code"] == "kv_budget_exhausted" and "LETHE_KV_BUDGET_BYTES" in error["message"]
        # nothing of the turn was admitted, and the refused session left nothing in memory, not
        # even its object (one was kept for every refused first turn, for the process's life)
        assert [s for s in gw.sessions.all() if not gw.p.ledger.segments(s.record.id)] == []
        # evicting could not have made room, so no one was evicted (red team: one impossible
        # request flushed every tenant's sessions)
        assert {s.record.id: len(s.cache) for s in gw.sessions.all() if len(s.cache)} == held
    finally:
        gw.residency.budget = BUDGET


def test_forget_of_an_offloaded_session_leaves_no_span_bytes_in_any_copy(kv):
    http, gw, directory = kv
    sid = start(http, "beta")
    span = tool_segment(gw, sid)
    wanted = needles(gw, sid, span)
    evict(http, gw, sid, "f")
    assert set(found(directory, wanted)) == set(wanted.values())  # the scan finds them while the copy holds them
    seg_id = [s for s in gw.p.ledger.segments(sid) if s.role == "tool"][-1].id
    response = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": seg_id})
    assert response.status_code == 200, response.text
    copies = response.json()["records"][0]["body"]["copies"]
    assert copies["offload"]["action"] == "restored-erased" and copies["resident"]["action"] == "forgotten-exact"
    assert response.json()["witness"]["equal"] is True
    assert found(directory, wanted) == []
    evict(http, gw, sid, "g")  # offloaded again, as it is after the forget
    assert gw.residency.offload.copy_of(sid).tokens == span[0]
    assert found(directory, wanted) == []


def test_retention_expiry_of_an_offloaded_session_leaves_no_span_bytes(kv):
    http, gw, directory = kv
    sid = start(http, "gamma", CONFIG_FILE + "# kv memory\n")  # a secret: kept 600 s by the demo tenant
    span = tool_segment(gw, sid)
    wanted = needles(gw, sid, span)
    evict(http, gw, sid, "r")
    assert set(found(directory, wanted)) == set(wanted.values())
    assert gw.sweep_retention(now=datetime.now(timezone.utc) + timedelta(seconds=601)) >= 1
    assert found(directory, wanted) == []
    records = http.get("/v1/audit/records", params={"session": sid, "kind": "retention-forget"}).json()["records"]
    assert records[0]["body"]["copies"]["offload"]["action"] == "restored-erased"


def test_forget_of_a_dropped_session_rebuilds_it_from_the_ledger_and_witnesses_the_forget(kv, monkeypatch):
    """A session evicted below the offload minimum has no KV copy anywhere; an API forget on it
    rebuilds the cache from the ledger (within the budget) and forgets there, so its record carries
    a real never-saw witness (max|delta| = 0 for K, V and logits), never a claim about a copy
    that does not exist (it answered 409 session_not_resident before)."""
    http, gw, directory = kv
    sid = start(http, "dropped")
    span = tool_segment(gw, sid)
    wanted = needles(gw, sid, span)
    monkeypatch.setattr(gw.residency, "_offload_min", 101)  # every eviction drops
    evict_dropped = gw.p.metrics.kv_evictions.labels("dropped")._value.get()
    for i in range(6):
        start(http, f"drop{i}")
        if gw.cache(sid) is None:
            break
    assert gw.cache(sid) is None and gw.residency.offload.copy_of(sid) is None
    assert gw.p.metrics.kv_evictions.labels("dropped")._value.get() > evict_dropped
    seg_id = [s for s in gw.p.ledger.segments(sid) if s.role == "tool"][-1].id
    response = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": seg_id})
    assert response.status_code == 200, response.text
    body = response.json()
    witness = body["witness"]
    assert witness["equal"] is True
    assert (witness["max_abs_dk"], witness["max_abs_dv"], witness["max_abs_dlogits"]) == (0.0, 0.0, 0.0)
    record = body["records"][0]["body"]
    assert record["kind"] == "forget" and record["witness"] == witness
    resident = record["copies"]["resident"]
    assert resident["action"] == "forgotten-exact" and resident["rebuilt_from_ledger"] == span[1]
    assert resident["tokens_after"] == span[0] and "offload" not in record["copies"]
    assert [s.state.value for s in gw.p.ledger.segments(sid) if s.id == seg_id] == ["forgotten"]
    assert len(gw.cache(sid)) == span[0]
    gw.p.ledger.check_invariants(sid, cache_len=len(gw.cache(sid)))
    assert found(directory, wanted) == []


def test_ending_an_offloaded_session_erases_its_copy(kv):
    http, gw, directory = kv
    sid = start(http, "delta")
    wanted = needles(gw, sid, tool_segment(gw, sid))
    evict(http, gw, sid, "d")
    copy = gw.residency.offload.copy_of(sid)
    assert set(found(directory, wanted)) == set(wanted.values())
    response = http.delete(f"/v1/sessions/{sid}")
    assert response.status_code == 200, response.text
    assert response.json()["copies"]["offload"] == {"sha256": copy.sha256, "tier": "disk", "action": "erased"}
    assert found(directory, wanted) == [] and not (directory / copy.key).exists()
    record = http.get("/v1/audit/records", params={"session": sid, "kind": "kv-release"}).json()["records"][0]
    assert record["body"]["copies"]["offload"]["sha256"] == copy.sha256
    assert gw.sessions.get(sid) is None


def test_reading_an_offloaded_session_neither_restores_it_nor_evicts_another(kv):
    """GET /v1/sessions/{id} reports the copy's digest at eviction; it is a read, so it must not
    churn the shared budget (red team: each GET restored the session and evicted another)."""
    http, gw, _directory = kv
    sid = start(http, "read")
    digest = gw.cache(sid).digest()
    evict(http, gw, sid, "readev")
    restores, evictions = metric(http, "lethe_kv_restore_seconds_count"), gw.p.metrics.kv_evictions
    before = sum(evictions.labels(to)._value.get() for to in ("offloaded", "dropped"))
    body = http.get(f"/v1/sessions/{sid}").json()
    assert (body["resident"], body["offloaded"], body["cache_digest"]) == (False, True, digest)
    assert gw.residency.offload.copy_of(sid) is not None and gw.cache(sid) is None
    assert metric(http, "lethe_kv_restore_seconds_count") == restores
    assert sum(evictions.labels(to)._value.get() for to in ("offloaded", "dropped")) == before


def forget_claims(http: httpx.Client, gw: Gateway, monkeypatch, tag: str,
                  content: str | None = None) -> tuple[list[int], int, dict, tuple[int, int]]:
    """Start a session and forget its tool result, recording what the forget claimed beside its
    cache. Returns the claims, the accounted bytes before, the answer and the session's tokens
    before and after."""
    sid = start(http, tag, content)
    claims: list[int] = []
    claim = gw.residency.claim_beside

    def spy(live, nbytes):
        claims.append(nbytes)
        return claim(live, nbytes)
    monkeypatch.setattr(gw.residency, "claim_beside", spy)
    before, tokens = gw.residency.used(), len(gw.cache(sid))
    seg = [s for s in gw.p.ledger.segments(sid) if s.role == "tool"][-1]
    response = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": seg.id})
    assert response.status_code == 200, response.text
    return claims, before, response.json(), (tokens, tokens - seg.n_tokens)


def test_a_forget_counts_its_rollback_copy_and_witness_in_the_budget(kv, monkeypatch):
    """The never-saw witness prefills a reference of the survivors beside the cache (the forget
    itself keeps no rollback copy): it is claimed in the budget before the edit and given back
    after it, and the accounted peak stays within the budget."""
    http, gw, _ = kv
    claims, before, answer, (_, survivors) = forget_claims(http, gw, monkeypatch, "witness")
    assert answer["witness"]["equal"] is True
    assert claims == [gw.p.kernel.cache_bytes(survivors)]
    assert gw.residency.peak <= gw.residency.budget
    assert gw.residency.used() <= before  # given back; the forget only shrank the session


def test_a_deferred_witness_holds_its_claim_until_it_ends_or_runs_inline_without_room(kv, monkeypatch):
    """Deferred, the worker checks a copy of the cache against its own reference after the call
    returns: both stay counted until the witness ends (red team: queued copies were unbounded).
    When the budget has no room for that copy, the witness runs inline (one copy less)."""
    http, gw, _ = kv
    monkeypatch.setattr(gw.erasure, "witness_mode", "deferred")
    size = gw.p.kernel.cache_bytes
    claims, before, answer, (_, survivors) = forget_claims(http, gw, monkeypatch, "deferred", "ok")
    assert claims == [2 * size(survivors)]
    assert answer["witness"] is None and answer["audit_indices"] == [None]
    deadline = time.monotonic() + 120
    while gw.residency.used() > before and time.monotonic() < deadline:
        time.sleep(0.05)  # the witness runs on the kernel's worker; its release comes when it ends
    assert gw.residency.used() <= before and gw.residency.peak <= gw.residency.budget
    sid = start(http, "inline", "ok")
    live = gw.sessions.get(sid)
    # room (once every other session is evicted) for the cache and one copy of it, not two
    monkeypatch.setattr(gw.residency, "budget", live.cache.nbytes + 2 * size(len(live.cache)) - 1)
    seg = [s for s in gw.p.ledger.segments(sid) if s.role == "tool"][-1]
    claims.clear()
    response = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": seg.id})
    assert response.status_code == 200, response.text
    assert len(claims) == 2 and claims[0] > claims[1] and response.json()["witness"]["equal"] is True


def test_a_forget_without_room_for_its_witness_wipes_the_cache_and_says_so(kv, monkeypatch):
    """Erasure never waits for memory: with no room for the witness's reference even after every
    idle session is evicted, the resident cache is zeroed and dropped, the content erased, and the
    record is a content-erase (no witness claimed) naming the wiped copy; the next turn rebuilds."""
    http, gw, _ = kv
    sid = start(http, "tight", "a short file")
    live = gw.sessions.get(sid)
    seg = [s for s in gw.p.ledger.segments(sid) if s.role == "tool"][-1]
    monkeypatch.setattr(gw.residency, "budget", live.cache.nbytes + 1)  # the cache fits, a copy never
    response = http.post(f"/v1/sessions/{sid}/forget", json={"segment_id": seg.id})
    assert response.status_code == 200, response.text
    body = response.json()["records"][0]["body"]
    assert body["kind"] == "content-erase" and body.get("witness") is None
    assert body["copies"]["resident"]["action"] == "wiped" and not len(gw.cache(sid) or [])
    assert gw.residency.used() <= gw.residency.budget
    monkeypatch.undo()
    messages = tool_messages("tight", "a short file") + [{"role": "user", "content": "and now?"}]
    assert chat(http, messages, sid).status_code == 200  # rebuilt from the ledger, the result withheld
    assert len(gw.cache(sid)) > 0
