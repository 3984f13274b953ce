"""The canonical forward is chunking-invariant: the same tokens give the same bytes, however fed."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkernel.plan import AMD, XEON, Plan


@st.composite
def chunkings(draw, n: int = 90) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(draw(st.one_of(st.just(1), st.integers(1, 40))))
    sizes[-1] -= sum(sizes) - n
    return [s for s in sizes if s > 0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=chunkings())
def test_random_chunkings_give_identical_bytes(tiny_kernel, tiny_tokens, sizes):
    tokens = tiny_tokens[:90]
    whole = tiny_kernel.prefill(tokens)
    pieces = tiny_kernel.new_cache()
    at = 0
    for size in sizes:
        pieces.extend(tokens[at : at + size])
        at += size
    assert pieces.tokens == tokens
    assert pieces.digest() == whole.digest()


@pytest.mark.model
def test_real_pieces_and_decode_match_one_shot(real_kernel, real_base, real_tokens):
    """Pieces straddling tiles, then token-by-token decode, give the one-shot bytes."""
    pieces = real_kernel.prefill(real_tokens[:5])
    pieces.extend(real_tokens[5:40])
    for t in real_tokens[40:46]:
        pieces.extend([t])
    pieces.extend(real_tokens[46:])
    assert pieces.digest() == real_base.digest()


@pytest.mark.parametrize("plan", [XEON, AMD, Plan("fallback", fixed_m=64, attention_min_rows=None)], ids=lambda p: p.name)
def test_every_block_uses_a_size_the_calibration_checks(plan):
    sizes = plan.sizes()
    for n in range(1, 700):
        blocks = plan.blocks(n)
        assert sum(rows for rows, _ in blocks) == n
        assert all(rows <= m and m in sizes for rows, m in blocks)
        assert all(m % plan.small_step == 0 and m >= plan.small_min for rows, m in blocks if rows <= plan.small_max)
