"""The cache's buffer: exact reservation, trimming, wiping and the rows round trip the offload tier
uses; none of them changes a bit of what the cache computes."""
from __future__ import annotations

import pytest
import torch

from kvkernel import KernelError, KVCache


def test_reserved_and_trimmed_buffers_compute_the_same_bits(tiny_kernel):
    tokens = [(i * 13) % 250 + 3 for i in range(300)]
    grown = tiny_kernel.new_cache()
    grown.extend(tokens)  # the doubling buffer
    exact = tiny_kernel.new_cache(0)
    exact.reserve(len(tokens) + 20)
    before = exact.capacity
    exact.extend(tokens)
    assert exact.capacity == before  # no reallocation inside the reservation
    assert exact.digest() == grown.digest()
    exact.fit()
    assert exact.capacity == tiny_kernel.transformer.key_length(len(tokens)) < grown.capacity
    assert torch.equal(exact.extend([7, 9]), grown.extend([7, 9])) and exact.digest() == grown.digest()
    assert exact.nbytes <= exact.bytes_for(len(exact))


def test_planes_round_trip_is_bit_exact_and_shape_checked(tiny_kernel):
    cache = tiny_kernel.prefill([(i * 7) % 200 + 3 for i in range(150)])
    planes = list(cache.export_planes())
    assert len(planes) == 3 * tiny_kernel.transformer.shape.layers
    back = KVCache.from_planes(tiny_kernel, cache.tokens, planes, cache.logits)
    assert back.digest() == cache.digest() and back.tokens == cache.tokens
    for layer in range(tiny_kernel.transformer.shape.layers):
        for got, want in zip(back.layer_kv(layer), cache.layer_kv(layer)):
            assert float((got - want).abs().max()) == 0.0
    planes[0].zero_()  # each plane is a copy: zeroing it (as an offload does) leaves the cache as it was
    assert cache.digest() == back.digest()
    with pytest.raises(KernelError, match="does not fit"):
        KVCache.from_planes(tiny_kernel, cache.tokens[:-1], planes, cache.logits)
    with pytest.raises(KernelError, match="more planes"):
        KVCache.from_planes(tiny_kernel, cache.tokens, planes + planes[:1], cache.logits)
    with pytest.raises(KernelError, match="does not fit"):
        KVCache.from_planes(tiny_kernel, cache.tokens, planes[:-1], cache.logits)


def test_wipe_zeroes_what_the_cache_held_and_holds_nothing(tiny_kernel):
    cache = tiny_kernel.prefill(list(range(5, 100)))
    buffer, logits = cache._kv, cache._logits
    cache.wipe()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.logits is None
    assert not buffer.any() and not logits.any()  # the released tensors carry no K/V or logits


@pytest.mark.parametrize("n", [1, 127, 128, 129, 300])
def test_a_never_saw_reference_holds_one_exactly_sized_buffer(tiny_kernel, n):
    """A witness's reference is what the gateway's KV budget counts beside the cache it checks:
    one buffer of the survivors' rows, never a doubled one (the old default of 256 rows, doubled
    while it grew, held up to 2x, and 3x during a move)."""
    tokens = [(7 * i) % 200 + 3 for i in range(n)]
    reference = tiny_kernel.prefill(tokens)
    key_length = tiny_kernel.transformer.key_length
    assert reference.capacity == key_length(n) and reference.nbytes <= reference.bytes_for(n)
    sized = tiny_kernel.prefill(tokens, room=8)
    assert sized.capacity == key_length(n + 8)
    grown = tiny_kernel.new_cache()
    grown.extend(tokens)
    assert sized.digest() == reference.digest() == grown.digest()  # the buffer's size changes no bits
