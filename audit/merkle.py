"""RFC 9162 Merkle tree hashing, proofs and proof verification. Pure: stdlib only.

Storage model. Every node of an RFC 9162 tree that we ever need is either a *perfect* subtree
(2**level leaves starting at index * 2**level) or a right-edge range that is the right fold of
perfect subtrees. So a store keeps only perfect-subtree hashes keyed by ``(level, index)``,
written once, when the subtree completes, and never changed; any proof then needs O(log n) of
them, fetched in one look-up. Proof *generation* is split in two so a database can answer the
look-up in one query: ``inclusion_ranges`` / ``consistency_ranges`` say which leaf ranges a proof
covers, ``cover`` says which stored nodes make up a range, ``range_hash`` folds them.

Verification follows RFC 9162 sections 2.1.3.2 and 2.1.4.2 literally, so it can be read against
the RFC line by line (the style of sigstore-python's ``merkle.py``).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "EMPTY_ROOT",
    "CompactRange",
    "ConsistencyProof",
    "InclusionProof",
    "ProofError",
    "consistency_ranges",
    "cover",
    "hash_leaf",
    "hash_children",
    "inclusion_ranges",
    "nodes_for",
    "range_hash",
    "verify_consistency",
    "verify_inclusion",
]

NodeKey = tuple[int, int]  # (level, index): the perfect subtree of leaves [index << level, (index + 1) << level)
Range = tuple[int, int]  # [start, end) in leaves

EMPTY_ROOT = hashlib.sha256(b"").digest()


class ProofError(ValueError):
    """A proof does not verify, or was asked for with impossible sizes."""


def hash_leaf(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def hash_children(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """k: the largest power of two smaller than n (n > 1), RFC 9162's split point."""
    return 1 << ((n - 1).bit_length() - 1)


# --- which ranges a proof covers -------------------------------------------------------------

def inclusion_ranges(index: int, size: int) -> list[Range]:
    """The sibling ranges of RFC 9162 PATH(index, D[0:size]), leaf to root."""
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of size {size}")
    path: list[Range] = []
    start, end = 0, size
    while end - start > 1:
        k = _split(end - start)
        if index < start + k:
            path.append((start + k, end))
            end = start + k
        else:
            path.append((start, start + k))
            start += k
    return path[::-1]


def consistency_ranges(old: int, new: int) -> list[Range]:
    """The ranges of RFC 9162 PROOF(old, D[0:new]), in proof order."""
    if not 0 <= old <= new:
        raise ProofError(f"no consistency proof from size {old} to size {new}")
    if old == 0 or old == new:
        return []
    path: list[Range] = []
    start, end, m, complete = 0, new, old, True  # SUBPROOF(m, D[start:end], complete)
    while m != end - start:
        k = _split(end - start)
        if m <= k:
            path.append((start + k, end))
            end = start + k
        else:
            path.append((start, start + k))
            start, m, complete = start + k, m - k, False
    if not complete:
        path.append((start, end))
    return path[::-1]


def cover(start: int, end: int) -> list[NodeKey]:
    """The stored perfect subtrees that make up a range, largest (leftmost) first.

    Every range a proof asks for starts at a multiple of a power of two at least its size, so
    walking the bits of its size from the top gives aligned, perfect subtrees.
    """
    keys: list[NodeKey] = []
    size = end - start
    for level in range(size.bit_length() - 1, -1, -1):
        if size >> level & 1:
            keys.append((level, start >> level))
            start += 1 << level
    return keys


def range_hash(start: int, end: int, nodes: Mapping[NodeKey, bytes]) -> bytes:
    """MTH(D[start:end]): the right fold of the range's perfect subtrees."""
    if start == end:
        return EMPTY_ROOT
    hashes = [nodes[key] for key in cover(start, end)]
    acc = hashes[-1]
    for h in reversed(hashes[:-1]):
        acc = hash_children(h, acc)
    return acc


def nodes_for(ranges: Iterable[Range]) -> set[NodeKey]:
    """Every stored node the given ranges need: what a store fetches for one proof."""
    return {key for start, end in ranges for key in cover(start, end)}


# --- building a tree -------------------------------------------------------------------------

class CompactRange:
    """The right edge of a growing tree: one perfect subtree per set bit of its size.

    ``append`` returns the perfect subtrees the new leaf completes (the leaf itself included), which
    is exactly what a store must write; ``root`` folds the edge into the tree head.
    """

    def __init__(self, size: int = 0, edge: Iterable[bytes] = ()) -> None:
        self.size = size
        self._edge = list(edge)  # hashes of cover(0, size), largest first
        if len(self._edge) != bin(size).count("1"):
            raise ProofError(f"a tree of size {size} has {bin(size).count('1')} edge nodes, got {len(self._edge)}")

    def copy(self) -> CompactRange:
        return CompactRange(self.size, self._edge)

    def append(self, leaf: bytes) -> list[tuple[int, int, bytes]]:
        index = self.size
        created = [(0, index, leaf)]
        h, level = leaf, 0
        while index >> level & 1:  # each trailing 1 bit of the old size merges one subtree
            h = hash_children(self._edge.pop(), h)
            level += 1
            created.append((level, index >> level, h))
        self._edge.append(h)
        self.size += 1
        return created

    def extend(self, leaves: bytes) -> None:
        """``append`` each 32-byte leaf hash in ``leaves``, without listing the subtrees they
        complete: how a verifier rebuilds a tree of 10^5 leaves in a few hundredths of a second."""
        edge, size = self._edge, self.size
        for at in range(0, len(leaves), 32):
            h, merges = leaves[at : at + 32], size
            while merges & 1:  # as in append: each trailing 1 bit of the old size merges one subtree
                h = hashlib.sha256(b"\x01" + edge.pop() + h).digest()
                merges >>= 1
            edge.append(h)
            size += 1
        self.size = size

    def root(self) -> bytes:
        if not self._edge:
            return EMPTY_ROOT
        acc = self._edge[-1]
        for h in reversed(self._edge[:-1]):
            acc = hash_children(h, acc)
        return acc


# --- proofs and their verification -----------------------------------------------------------

@dataclass(frozen=True)
class InclusionProof:
    leaf_index: int
    tree_size: int
    hashes: tuple[bytes, ...]

    def to_dict(self) -> dict:
        return {"leaf_index": self.leaf_index, "tree_size": self.tree_size, "hashes": [h.hex() for h in self.hashes]}

    @classmethod
    def from_dict(cls, d: Mapping) -> InclusionProof:
        return cls(int(d["leaf_index"]), int(d["tree_size"]), tuple(bytes.fromhex(h) for h in d["hashes"]))

    def verify(self, leaf_hash: bytes, root: bytes) -> None:
        verify_inclusion(self.leaf_index, self.tree_size, leaf_hash, self.hashes, root)


@dataclass(frozen=True)
class ConsistencyProof:
    old_size: int
    new_size: int
    hashes: tuple[bytes, ...]

    def to_dict(self) -> dict:
        return {"old_size": self.old_size, "new_size": self.new_size, "hashes": [h.hex() for h in self.hashes]}

    @classmethod
    def from_dict(cls, d: Mapping) -> ConsistencyProof:
        return cls(int(d["old_size"]), int(d["new_size"]), tuple(bytes.fromhex(h) for h in d["hashes"]))

    def verify(self, old_root: bytes, new_root: bytes) -> None:
        verify_consistency(self.old_size, self.new_size, old_root, new_root, self.hashes)


def verify_inclusion(index: int, size: int, leaf_hash: bytes, proof: Iterable[bytes], root: bytes) -> None:
    """RFC 9162 2.1.3.2. Raises ProofError unless ``leaf_hash`` is leaf ``index`` of the tree ``root``."""
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of size {size}")
    fn, sn, r = index, size - 1, leaf_hash
    for p in proof:
        if sn == 0:
            raise ProofError("inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = hash_children(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = hash_children(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("inclusion proof is shorter than the tree is deep")
    if r != root:
        raise ProofError(f"inclusion proof for leaf {index} leads to {r.hex()}, not the root {root.hex()}")


def verify_consistency(old: int, new: int, old_root: bytes, new_root: bytes, proof: Iterable[bytes]) -> None:
    """RFC 9162 2.1.4.2. Raises ProofError unless the tree ``old_root`` is a prefix of ``new_root``."""
    path = list(proof)
    if not 0 <= old <= new:
        raise ProofError(f"no consistency proof from size {old} to size {new}")
    if old == new or old == 0:
        if path:
            raise ProofError(f"consistency proof from {old} to {new} must be empty")
        if old == new and old_root != new_root:
            raise ProofError(f"two different roots for tree size {old}")
        return
    if not path:
        raise ProofError("empty consistency proof")
    if old & (old - 1) == 0:  # old is a power of two: its root is the first node
        path.insert(0, old_root)
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ProofError("consistency proof is too long")
        if fn & 1 or fn == sn:
            fr = hash_children(c, fr)
            sr = hash_children(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = hash_children(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("consistency proof is too short")
    if fr != old_root:
        raise ProofError(f"consistency proof does not lead to the old root of size {old}")
    if sr != new_root:
        raise ProofError(f"consistency proof does not lead to the new root of size {new}")
