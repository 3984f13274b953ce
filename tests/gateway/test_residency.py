"""The KV budget, eviction order, offload and exact restore, on the tiny random model with a real
SQLite ledger, the shipped Rego policies and a real offload directory."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from gateway.errors import GatewayError
from gateway.metrics import Metrics
from gateway.offload import DiskTier, HostTier, Offload
from gateway.residency import Residency
from gateway.sessions import LiveSession, Sessions
from ledger import Ledger, NewSegment, SegmentState
from policies import PolicyEngine


class World:
    """Sessions of the tiny model whose caches hold exactly what their ledger says."""

    def __init__(self, kernel, tmp: Path, budget: int, *, offload_bytes: int = 1 << 30, host: bool = False,
                 offload_min: int | None = None) -> None:
        self.kernel = kernel
        self.ledger = Ledger(f"sqlite:///{tmp / 'l.db'}", check_invariants=False)
        self.policy = PolicyEngine()
        self.metrics = Metrics()
        self.sessions = Sessions(kernel, self.ledger, self.policy, b"s" * 32)
        self.dir = tmp / "kv-offload"
        tier = HostTier() if host else DiskTier(self.dir)
        self.residency = Residency(kernel=kernel, ledger=self.ledger, policy=self.policy, metrics=self.metrics,
                                   sessions=self.sessions, budget_bytes=budget,
                                   offload=Offload(tier, offload_bytes) if offload_bytes else None,
                                   offload_min_priority=offload_min)
        self.count = 0

    def session(self, segments: list[tuple[str, str | None, SegmentState, int]]) -> LiveSession:
        """A settled session with one segment per (role, tool, state, tokens), its cache prefilled."""
        self.count += 1
        record = self.ledger.create_session(f"ses_{self.count}", "acme", "alice")
        self.ledger.write_turn(record.id, keep=0, new=[
            NewSegment(role=r, tool=t, content=f"{self.count}-{i}".encode(), n_tokens=n, state=st)
            for i, (r, t, st, n) in enumerate(segments)])
        live = self.sessions.resident(record)
        tokens = [(self.count * 7 + i) % 200 + 3 for i in range(sum(n for *_, n in segments))]
        with live.lock:
            self.residency.admit(live)
            self.residency.reserve(live, len(tokens))
            live.cache.extend(tokens)
            self.residency.settle(live)
        return live

    def turn(self, live: LiveSession, extra: int = 0) -> None:
        """A turn that only touches the session (and may reserve `extra` tokens more)."""
        with live.lock:
            self.residency.admit(live)
            self.residency.reserve(live, len(live.cache) + extra)
            self.residency.settle(live)


LIVE, QUARANTINED = SegmentState.LIVE, SegmentState.QUARANTINED


def per_session(kernel, tokens: int) -> int:
    return kernel.new_cache(0).bytes_for(tokens)


def test_eviction_order_is_priority_then_least_recently_used(tiny_kernel, tmp_path):
    one = per_session(tiny_kernel, 100)
    w = World(tiny_kernel, tmp_path, budget=4 * one + one // 2, offload_bytes=0)
    system = w.session([("system", None, LIVE, 100)])  # 90
    old_turn = w.session([("user", None, LIVE, 100)])  # 50, used before `new_turn`
    stub = w.session([("tool", "web.fetch", QUARANTINED, 100)])  # 10
    new_turn = w.session([("user", None, LIVE, 100)])  # 50
    w.turn(new_turn)
    assert [len(s.cache) for s in (system, old_turn, stub, new_turn)] == [100] * 4
    order = []
    for _ in range(4):  # each newcomer (a system prompt: 90, but used last) evicts one session
        w.session([("system", None, LIVE, 100)])
        order += [s for s in (system, old_turn, stub, new_turn) if not len(s.cache) and s not in order]
    assert order == [stub, old_turn, new_turn, system]
    assert w.metrics.kv_evictions.labels("dropped")._value.get() == 4


def test_a_session_mid_turn_is_never_evicted_and_the_turn_that_cannot_fit_gets_503(tiny_kernel, tmp_path):
    one = per_session(tiny_kernel, 100)
    w = World(tiny_kernel, tmp_path, budget=2 * one + one // 2)
    busy = w.session([("user", None, LIVE, 100)])
    other = w.session([("user", None, LIVE, 100)])
    assert busy.lock.acquire(blocking=False)
    try:
        busy.reserved = busy.cache.nbytes  # mid-turn: its lock is held and its room reserved
        other.lock.acquire()
        other.reserved = other.cache.nbytes
        newcomer = w.sessions.resident(w.ledger.create_session("ses_new", "acme", "alice"))
        with pytest.raises(GatewayError) as err, newcomer.lock:
            w.residency.reserve(newcomer, 100)
        assert (err.value.status, err.value.code, err.value.retry_after) == (503, "kv_budget_exhausted", 2)
        assert "mid-turn" in err.value.message and "LETHE_KV_BUDGET_BYTES" in err.value.message
        assert len(busy.cache) == 100 and len(other.cache) == 100 and newcomer.reserved == 0
    finally:
        busy.lock.release()
        other.lock.release()


def test_a_session_bigger_than_the_whole_budget_gets_503_and_evicts_nobody(tiny_kernel, tmp_path):
    w = World(tiny_kernel, tmp_path, budget=per_session(tiny_kernel, 200))
    small = w.session([("user", None, LIVE, 50)])
    big = w.sessions.resident(w.ledger.create_session("ses_big", "acme", "alice"))
    with pytest.raises(GatewayError) as err, big.lock:
        w.residency.reserve(big, 400)
    assert err.value.code == "kv_budget_exhausted" and "alone needs" in err.value.message
    # evicting the small one could not have helped, so it stays (red team: one impossible request
    # flushed every other tenant's sessions)
    assert len(small.cache) == 50 and w.metrics.kv_evictions.labels("dropped")._value.get() == 0
    assert w.metrics.kv_evictions.labels("offloaded")._value.get() == 0
    assert w.residency.used() <= w.residency.budget


@pytest.mark.parametrize("host", [False, True], ids=["disk", "host"])
def test_restore_is_bit_exact_against_a_never_evicted_cache(tiny_kernel, tmp_path, host):
    one = per_session(tiny_kernel, 300)
    w = World(tiny_kernel, tmp_path, budget=one + one // 2, host=host)
    victim = w.session([("system", None, LIVE, 20), ("user", None, LIVE, 280)])
    reference = victim.cache.clone()
    w.session([("user", None, LIVE, 300)])  # evicts the victim to the offload tier
    assert not len(victim.cache) and victim.cache.nbytes == 0
    copy = w.residency.offload.copy_of(victim.record.id)
    assert copy is not None and copy.key in w.residency.offload.tier.keys()
    assert w.metrics.kv_offloads._value.get() == 1
    with victim.lock:
        touched = w.residency.admit(victim)
        w.residency.settle(victim)
    assert touched["offload"]["action"] == "restored-erased"
    assert victim.cache.digest() == reference.digest()
    for layer in range(tiny_kernel.transformer.shape.layers):
        for got, want in zip(victim.cache.layer_kv(layer), reference.layer_kv(layer)):
            assert float((got - want).abs().max()) == 0.0
    assert torch.equal(victim.cache.logits, reference.logits)
    assert victim.cache.tokens == reference.tokens
    # and it goes on exactly: one more token on each gives the same bits
    assert torch.equal(victim.cache.extend([5]), reference.extend([5]))
    assert w.metrics.kv_restores.labels("hit")._value.get() == 1
    assert w.residency.offload.copy_of(victim.record.id) is None  # the copy is erased once restored
    assert copy.key not in w.residency.offload.tier.keys()  # (the other session is offloaded now)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "tokens"])
def test_a_corrupted_or_truncated_copy_is_discarded_and_rebuilt(tiny_kernel, tmp_path, damage):
    one = per_session(tiny_kernel, 300)
    w = World(tiny_kernel, tmp_path, budget=one + one // 2)
    victim = w.session([("user", None, LIVE, 300)])
    w.session([("user", None, LIVE, 300)])
    path = w.dir / w.residency.offload.copy_of(victim.record.id).key
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-100] ^= 0x01  # one bit of the logits
    elif damage == "tokens":  # the header's token ids, which the payload hash does not cover (red team)
        at = data.index(b'"tokens":[') + len(b'"tokens":[')
        data[at] = ord("1") if data[at] != ord("1") else ord("2")
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with victim.lock:
        touched = w.residency.admit(victim)
        w.residency.settle(victim)
    assert touched["offload"]["action"] == "erased-invalid"
    assert len(victim.cache) == 0  # nothing of the copy was used: the pipeline rebuilds from the ledger
    assert w.metrics.kv_restores.labels("rebuilt")._value.get() == 1
    assert not path.exists() and w.residency.offload.copy_of(victim.record.id) is None


def test_a_copy_the_ledger_has_moved_past_is_never_used(tiny_kernel, tmp_path):
    """A forget (or a turn) through another replica changes the ledger: the copy is stale."""
    one = per_session(tiny_kernel, 300)
    w = World(tiny_kernel, tmp_path, budget=one + one // 2)
    victim = w.session([("user", None, LIVE, 100), ("tool", "t", LIVE, 200)])
    w.session([("user", None, LIVE, 300)])
    tool = [s for s in w.ledger.segments(victim.record.id) if s.role == "tool"][0]
    w.ledger.forget(victim.record.id, [tool.id])  # as replica 2 would, on the shared database
    with victim.lock:
        touched = w.residency.admit(victim)
    assert touched["offload"]["action"] == "erased-stale" and len(victim.cache) == 0
    assert w.residency.offload.tier.keys() == []


def test_a_resident_cache_the_ledger_has_moved_past_is_wiped_at_turn_start(tiny_kernel, tmp_path):
    w = World(tiny_kernel, tmp_path, budget=1 << 30)
    live = w.session([("user", None, LIVE, 100), ("tool", "t", LIVE, 50)])
    tool = [s for s in w.ledger.segments(live.record.id) if s.role == "tool"][0]
    w.ledger.forget(live.record.id, [tool.id])  # through another replica
    with live.lock:
        touched = w.residency.admit(live)
    assert touched == {"resident": "wiped-stale"} and len(live.cache) == 0 and live.cache.nbytes == 0


def test_below_the_offload_minimum_a_session_is_dropped_not_offloaded(tiny_kernel, tmp_path):
    one = per_session(tiny_kernel, 300)
    w = World(tiny_kernel, tmp_path, budget=one + one // 2)
    stubby = w.session([("tool", "web.fetch", QUARANTINED, 300)])  # priority 10 < Rego's minimum 30
    w.session([("user", None, LIVE, 300)])
    assert len(stubby.cache) == 0 and w.residency.offload.copy_of(stubby.record.id) is None
    assert w.metrics.kv_evictions.labels("dropped")._value.get() == 1
    assert w.residency.offload.tier.keys() == []


def test_the_offload_tier_stays_within_its_bound(tiny_kernel, tmp_path):
    one = per_session(tiny_kernel, 200)
    w = World(tiny_kernel, tmp_path, budget=one + one // 2, offload_bytes=int(one * 1.5))
    first = w.session([("user", None, LIVE, 200)])
    second = w.session([("user", None, LIVE, 200)])  # first -> offload
    w.session([("user", None, LIVE, 200)])  # second -> offload, first's copy erased for room
    assert w.residency.offload.copy_of(first.record.id) is None
    assert w.residency.offload.copy_of(second.record.id) is not None
    assert w.residency.offload.nbytes <= w.residency.offload.max_bytes
    assert sum(p.stat().st_size for p in w.dir.iterdir()) == w.residency.offload.nbytes


def test_accounted_bytes_never_exceed_the_budget_under_concurrent_turns(tiny_kernel, tmp_path):
    one = per_session(tiny_kernel, 150)
    w = World(tiny_kernel, tmp_path, budget=3 * one)
    lives = [w.session([("user", None, LIVE, 150)]) for _ in range(8)]
    peaks: list[int] = []
    refused: list[int] = []

    def agent(live: LiveSession) -> None:
        for _ in range(6):
            try:
                w.turn(live, extra=50)
            except GatewayError as err:
                assert err.code == "kv_budget_exhausted" and err.retry_after
                refused.append(1)
            peaks.append(w.residency.used())

    threads = [threading.Thread(target=agent, args=(live,)) for live in lives]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(peaks) <= w.residency.budget and w.residency.peak <= w.residency.budget
    assert w.metrics.kv_evictions.labels("offloaded")._value.get() > 0
    assert w.metrics.kv_resident_bytes._value.get() <= w.residency.budget


class GatedDisk(DiskTier):
    """The real disk tier, whose writes wait at a gate: an eviction's write held in flight."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put(self, session_id, size, chunks):
        self.entered.set()
        assert self.gate.wait(60)
        return super().put(session_id, size, chunks)


def test_an_eviction_writes_outside_the_budget_lock_and_its_bytes_are_never_claimed_twice(tiny_kernel, tmp_path):
    one = per_session(tiny_kernel, 100)
    w = World(tiny_kernel, tmp_path, budget=2 * one + one // 2)
    tier = GatedDisk(tmp_path / "gated")
    w.residency.offload = Offload(tier, 1 << 30)
    first = w.session([("user", None, LIVE, 100)])  # least recently used: the first victim
    second = w.session([("user", None, LIVE, 100)])
    reference = first.cache.digest()
    newcomers = [w.sessions.resident(w.ledger.create_session(f"ses_new{i}", "acme", "alice")) for i in range(2)]
    claimed: list[int] = []

    def claim(live: LiveSession) -> None:
        with live.lock:
            w.residency.reserve(live, 100)
            claimed.append(w.residency.used())

    writer = threading.Thread(target=claim, args=(newcomers[0],))
    writer.start()
    assert tier.entered.wait(60)  # the first session's copy is being written, the gate shut
    try:
        # the budget lock is free: accounting answers, and a turn that fits runs to its end
        assert w.residency.used() == first.cache.nbytes + second.cache.nbytes <= w.residency.budget
        w.turn(second)
        # a second newcomer may not claim the bytes still being written: it waits for that write
        waiter = threading.Thread(target=claim, args=(newcomers[1],))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and newcomers[1].reserved == 0 and len(first.cache) == 100
    finally:
        tier.gate.set()
    writer.join(60)
    waiter.join(60)
    assert [live.reserved > 0 for live in newcomers] == [True, True]
    assert max(claimed) <= w.residency.budget and w.residency.peak <= w.residency.budget
    assert w.residency.offload.copy_of(first.record.id) is not None  # both idle sessions went to disk
    assert w.residency.offload.copy_of(second.record.id) is not None
    for live in newcomers:  # their turns end (holding nothing)
        with live.lock:
            w.residency.settle(live)
    with first.lock:
        assert w.residency.admit(first)["offload"]["action"] == "restored-erased"
    assert first.cache.digest() == reference


def test_memory_an_edit_holds_beside_its_cache_is_claimed_in_the_budget_and_given_back(tiny_kernel, tmp_path):
    """A forget's rollback copy and witness reference (a deferred witness's copy, until it ends)
    are counted: room is made for them by eviction, or the 503, and the release gives them back once."""
    one = per_session(tiny_kernel, 100)
    w = World(tiny_kernel, tmp_path, budget=3 * one)
    a = w.session([("user", None, LIVE, 100)])
    b = w.session([("user", None, LIVE, 100)])
    held = a.cache.nbytes
    c = w.sessions.resident(w.ledger.create_session("ses_c", "acme", "alice"))
    refused: list[GatewayError] = []

    def newcomer() -> None:  # another request's thread: it cannot take a's lock
        try:
            with c.lock:
                w.residency.reserve(c, 100)
                w.residency.settle(c)
        except GatewayError as exc:
            refused.append(exc)

    with a.lock:
        release = w.residency.claim_beside(a, 2 * held)  # a's cache + 2 copies: b must go
        assert a.reserved == 0 and b.cache.nbytes == 0 and w.residency.offloaded(b) is not None
        assert w.residency.used() == 3 * held == w.residency.peak
        worker = threading.Thread(target=newcomer)
        worker.start()
        worker.join()
        assert [e.code for e in refused] == ["kv_budget_exhausted"] and c.reserved == 0
        release()
        release()  # given back once, however often called
        assert w.residency.used() == held
    worker = threading.Thread(target=newcomer)
    worker.start()
    worker.join()
    assert len(refused) == 1 and w.residency.used() == held  # the room was there once given back


def test_an_edit_whose_copies_cannot_fit_gets_503_and_claims_nothing(tiny_kernel, tmp_path):
    one = per_session(tiny_kernel, 100)
    w = World(tiny_kernel, tmp_path, budget=2 * one)
    a = w.session([("user", None, LIVE, 100)])
    with a.lock, pytest.raises(GatewayError) as err:
        w.residency.claim_beside(a, 2 * a.cache.nbytes)
    assert err.value.code == "kv_budget_exhausted" and a.reserved == 0 and w.residency.used() == a.cache.nbytes


def planted(w: World, victim: LiveSession, tmp: Path, how: str) -> tuple[Path, bytes]:
    """Replace the victim's offload copy by a symlink or a hard link to a file outside the
    directory (as whoever else can write there could). Returns the outside file and its bytes."""
    target = tmp / "outside.bin"
    target.write_bytes(b"not yours " * 1000)
    path = w.dir / w.residency.offload.copy_of(victim.record.id).key
    path.unlink()
    (path.symlink_to if how == "symlink" else path.hardlink_to)(target)
    return target, target.read_bytes()


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
@pytest.mark.parametrize("via", ["end", "restore"])
def test_erasure_never_reads_or_writes_through_a_link_planted_under_a_copy_name(tiny_kernel, tmp_path, how, via):
    """Red team: a DELETE, a forget's restore, a start-up or shutdown sweep zeroed the file a
    planted link pointed at, and audited it as the erased copy. Only the name is unlinked, the
    outside file is untouched, and the record says the copy was not found."""
    one = per_session(tiny_kernel, 300)
    w = World(tiny_kernel, tmp_path, budget=one + one // 2)
    victim = w.session([("user", None, LIVE, 300)])
    w.session([("user", None, LIVE, 300)])  # offloads the victim
    path = w.dir / w.residency.offload.copy_of(victim.record.id).key
    target, before = planted(w, victim, tmp_path, how)
    with victim.lock:
        touched = w.residency.release(victim) if via == "end" else w.residency.admit(victim)
    assert touched["offload"]["action"] == "not-found"
    assert target.read_bytes() == before and not os.path.lexists(path)
    assert via == "end" or len(victim.cache) == 0  # nothing read through the link was used


@pytest.mark.parametrize("how", ["symlink", "hardlink", "dangling"])
def test_a_sweep_unlinks_planted_links_and_never_writes_through_them(tiny_kernel, tmp_path, how):
    directory = tmp_path / "kv-offload"
    directory.mkdir()
    target = tmp_path / "audit-key.pem"
    target.write_bytes(b"secret key material")
    left = directory / "0123.kv"
    left.write_bytes(b"rows an earlier process left")
    link = directory / "planted.kv"
    if how == "dangling":
        link.symlink_to(tmp_path / "nowhere")
    else:
        (link.symlink_to if how == "symlink" else link.hardlink_to)(target)
    tier = DiskTier(directory)
    Offload(tier, 1 << 30).close()  # the start-up sweep, then the shutdown one
    assert target.read_bytes() == b"secret key material" and list(directory.iterdir()) == []


def test_a_second_name_for_a_copy_cannot_keep_its_rows(tiny_kernel, tmp_path):
    """The copy is overwritten through its own inode, so a hard link made to it elsewhere reads zeros."""
    one = per_session(tiny_kernel, 300)
    w = World(tiny_kernel, tmp_path, budget=one + one // 2)
    victim = w.session([("user", None, LIVE, 300)])
    w.session([("user", None, LIVE, 300)])
    kept = tmp_path / "kept.kv"
    kept.hardlink_to(w.dir / w.residency.offload.copy_of(victim.record.id).key)
    with victim.lock:
        assert w.residency.release(victim)["offload"]["action"] == "erased"
    assert set(kept.read_bytes()) == {0}
