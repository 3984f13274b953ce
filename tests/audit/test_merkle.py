"""Proofs against a naive, recursive RFC 9162 reference (MTH, PATH, PROOF), every size up to 300."""
from __future__ import annotations

from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audit.merkle import (
    EMPTY_ROOT,
    CompactRange,
    ProofError,
    consistency_ranges,
    hash_children,
    hash_leaf,
    inclusion_ranges,
    range_hash,
    verify_consistency,
    verify_inclusion,
)

MAX = 300
LEAVES = [hash_leaf(f"entry {i}".encode()) for i in range(MAX)]


# --- the reference: RFC 9162 section 2.1, transcribed recursively ------------------------------

def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


@lru_cache(maxsize=None)
def mth(a: int, b: int) -> bytes:
    n = b - a
    if n == 0:
        return EMPTY_ROOT
    if n == 1:
        return LEAVES[a]
    k = _k(n)
    return hash_children(mth(a, a + k), mth(a + k, b))


def ref_path(m: int, a: int, b: int) -> list[bytes]:
    n = b - a
    if n == 1:
        return []
    k = _k(n)
    if m < k:
        return ref_path(m, a, a + k) + [mth(a + k, b)]
    return ref_path(m - k, a + k, b) + [mth(a, a + k)]


def ref_subproof(m: int, a: int, b: int, complete: bool) -> list[bytes]:
    n = b - a
    if m == n:
        return [] if complete else [mth(a, b)]
    k = _k(n)
    if m <= k:
        return ref_subproof(m, a, a + k, complete) + [mth(a + k, b)]
    return ref_subproof(m - k, a + k, b, False) + [mth(a, a + k)]


def ref_proof(m: int, n: int) -> list[bytes]:
    return ref_subproof(m, 0, n, True) if 0 < m < n else []


# --- the implementation under test, over perfect-subtree storage --------------------------------

NODES: dict[tuple[int, int], bytes] = {}
ROOTS: list[bytes] = [EMPTY_ROOT]
_tree = CompactRange()
for _leaf in LEAVES:
    NODES.update({(lv, i): h for lv, i, h in _tree.append(_leaf)})
    ROOTS.append(_tree.root())


def inclusion(m: int, n: int) -> list[bytes]:
    return [range_hash(a, b, NODES) for a, b in inclusion_ranges(m, n)]


def consistency(m: int, n: int) -> list[bytes]:
    return [range_hash(a, b, NODES) for a, b in consistency_ranges(m, n)]


def test_compact_range_roots_match_reference_for_every_size():
    assert [mth(0, n) for n in range(MAX + 1)] == ROOTS


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, MAX), max_size=6))
def test_extending_by_runs_of_leaves_gives_the_reference_roots(cuts):
    tree, done = CompactRange(), 0
    for cut in sorted(cuts):
        tree.extend(b"".join(LEAVES[done:cut]))
        done = max(done, cut)
        assert tree.size == done and tree.root() == mth(0, done)


def test_every_size_every_leaf_inclusion_matches_reference_and_verifies():
    for n in range(1, MAX + 1):
        for m in range(n):
            proof = inclusion(m, n)
            assert proof == ref_path(m, 0, n), (m, n)
            verify_inclusion(m, n, LEAVES[m], proof, ROOTS[n])


@pytest.mark.slow
def test_every_pair_of_sizes_consistency_matches_reference_and_verifies():
    for n in range(1, MAX + 1):
        for m in range(n + 1):
            proof = consistency(m, n)
            assert proof == ref_proof(m, n), (m, n)
            verify_consistency(m, n, ROOTS[m], ROOTS[n], proof)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_inclusion_rejects_a_wrong_leaf_index_root_or_proof(data):
    n = data.draw(st.integers(1, MAX))
    m = data.draw(st.integers(0, n - 1))
    proof = inclusion(m, n)
    verify_inclusion(m, n, LEAVES[m], proof, ROOTS[n])
    other = data.draw(st.integers(0, n - 1).filter(lambda x: x != m)) if n > 1 else None
    with pytest.raises(ProofError):
        verify_inclusion(m, n, hash_leaf(b"not in the tree"), proof, ROOTS[n])
    with pytest.raises(ProofError):
        verify_inclusion(m, n, LEAVES[m], proof, ROOTS[n - 1])
    if other is not None:
        with pytest.raises(ProofError):
            verify_inclusion(other, n, LEAVES[m], proof, ROOTS[n])
    if proof:
        j = data.draw(st.integers(0, len(proof) - 1))
        bad = proof[:j] + [hash_leaf(proof[j])] + proof[j + 1 :]
        with pytest.raises(ProofError):
            verify_inclusion(m, n, LEAVES[m], bad, ROOTS[n])
        with pytest.raises(ProofError):
            verify_inclusion(m, n, LEAVES[m], proof[:-1], ROOTS[n])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_consistency_rejects_a_wrong_root_or_proof(data):
    n = data.draw(st.integers(2, MAX))
    m = data.draw(st.integers(1, n - 1))
    proof = consistency(m, n)
    assert proof == ref_proof(m, n)
    verify_consistency(m, n, ROOTS[m], ROOTS[n], proof)
    with pytest.raises(ProofError):
        verify_consistency(m, n, ROOTS[m - 1], ROOTS[n], proof)
    with pytest.raises(ProofError):
        verify_consistency(m, n, ROOTS[m], ROOTS[n - 1], proof)
    j = data.draw(st.integers(0, len(proof) - 1))
    bad = proof[:j] + [hash_leaf(proof[j])] + proof[j + 1 :]
    with pytest.raises(ProofError):
        verify_consistency(m, n, ROOTS[m], ROOTS[n], bad)
    with pytest.raises(ProofError):
        verify_consistency(m, n, ROOTS[m], ROOTS[n], proof + [ROOTS[1]])


def test_edge_cases():
    verify_consistency(0, 5, EMPTY_ROOT, ROOTS[5], [])
    verify_consistency(7, 7, ROOTS[7], ROOTS[7], [])
    with pytest.raises(ProofError):
        verify_consistency(7, 7, ROOTS[7], ROOTS[8], [])
    with pytest.raises(ProofError):
        inclusion_ranges(5, 5)
    with pytest.raises(ProofError):
        consistency_ranges(6, 5)
    assert range_hash(0, 0, NODES) == EMPTY_ROOT
