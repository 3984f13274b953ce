"""forget() must equal a run that never saw the spans: max|delta| = 0 on every K, V and logit."""

from __future__ import annotations

import pytest

from kvkernel import GenerationConfig, tokens_sha256


def _assert_witness_exact(result, survivors: list[int], spans) -> None:
    w = result.witness
    assert w.equal is True
    assert (w.max_abs_dk, w.max_abs_dv, w.max_abs_dlogits) == (0.0, 0.0, 0.0)
    assert w.argmax_equal and w.digest_edited == w.digest_reference
    assert w.survivors_sha256 == tokens_sha256(survivors)
    assert w.spans == [tuple(s) for s in spans]
    d = w.to_dict()
    assert d["kind"] == "never-saw" and d["equal"] is True and d["tokens"] == len(survivors)


def _survivors(tokens: list[int], spans) -> list[int]:
    drop = {i for a, b in spans for i in range(a, b)}
    return [t for i, t in enumerate(tokens) if i not in drop]


def _span_cases(n: int) -> dict[str, list[tuple[int, int]]]:
    return {
        "head": [(0, 23)],
        "middle": [(n // 3, n // 3 + 41)],
        "tail": [(n - 17, n)],
        "several": [(3, 9), (n // 2, n // 2 + 20), (n - 30, n - 5)],
    }


@pytest.mark.parametrize("case", ["head", "middle", "tail", "several"])
def test_forget_tiny_equals_never_saw(tiny_kernel, tiny_tokens, never_saw, case):
    spans = _span_cases(len(tiny_tokens))[case]
    cache = tiny_kernel.prefill(tiny_tokens)
    result = cache.forget(spans)
    assert cache.tokens == _survivors(tiny_tokens, spans)
    _assert_witness_exact(result, cache.tokens, spans)
    never_saw(tiny_kernel, cache)


@pytest.mark.model
@pytest.mark.parametrize("case", ["head", "tail", "several"])
def test_forget_real_equals_never_saw(real_kernel, real_base, real_tokens, never_saw, case):
    spans = _span_cases(len(real_tokens))[case]
    cache = real_base.clone()
    result = cache.forget(spans)
    _assert_witness_exact(result, _survivors(real_tokens, spans), spans)
    never_saw(real_kernel, cache)


@pytest.mark.model
def test_forget_real_middle_then_greedy_32_identical(real_kernel, real_model, real_base, real_tokens, never_saw):
    """Erase the poisoned tool result; 32 greedy tokens must match a run that never saw it.

    The greedy loop is written out (argmax, extend) so that an early EOS cannot shorten it.
    """
    tool = real_model.tokenizer.encode("TOOL RESULT", add_special_tokens=False)
    start = next(i for i in range(len(real_tokens)) if real_tokens[i : i + len(tool)] == tool)
    span = (start, start + 40)
    cache = real_base.clone()
    result = cache.forget([span])
    _assert_witness_exact(result, _survivors(real_tokens, [span]), [span])
    never_saw(real_kernel, cache)
    reference = real_kernel.prefill(cache.tokens)
    edited_out, reference_out = [], []
    for out, c in ((edited_out, cache), (reference_out, reference)):
        logits = c.logits
        for _ in range(32):
            out.append(int(logits.argmax()))
            logits = c.extend([out[-1]])
    assert edited_out == reference_out
    assert cache.digest() == reference.digest()
    answer = real_model.tokenizer.decode(edited_out)
    assert "7731" not in answer and "hunter2" not in answer


@pytest.mark.model
def test_forget_after_decode_real(real_kernel, real_tokens, never_saw):
    """A cache built from a prefill plus token-by-token decode forgets exactly too."""
    cache = real_kernel.prefill(real_tokens[:100])
    list(cache.generate(GenerationConfig(max_new_tokens=6)))
    cache.extend(real_tokens[100:])
    spans = [(30, 60)]
    expected = _survivors(cache.tokens, spans)
    result = cache.forget(spans)
    _assert_witness_exact(result, expected, spans)
    never_saw(real_kernel, cache)


def test_forget_after_decode_tiny_and_continuation(tiny_kernel, tiny_tokens, never_saw):
    cache = tiny_kernel.prefill(tiny_tokens[:50])
    list(cache.generate(GenerationConfig(max_new_tokens=21)))
    cache.extend(tiny_tokens[50:])
    spans = [(10, 30), (60, 66)]
    result = cache.forget(spans)
    assert result.witness.equal
    never_saw(tiny_kernel, cache)
    reference = tiny_kernel.prefill(cache.tokens)
    cfg = GenerationConfig(max_new_tokens=40)
    assert list(cache.generate(cfg)) == list(reference.generate(cfg))
    assert cache.digest() == reference.digest()


def test_forget_everything_and_deferred_witness(tiny_kernel, tiny_tokens):
    cache = tiny_kernel.prefill(tiny_tokens)
    result = cache.forget([(20, 70)], witness="deferred")
    assert result.witness is None and result.pending is not None
    cache.extend(tiny_tokens[:5])  # the cache may move on while the witness is computed
    witness = result.pending.result(timeout=120)
    assert witness.equal and witness.tokens == len(tiny_tokens) - 50
    empty = tiny_kernel.prefill(tiny_tokens)
    assert empty.forget([(0, len(tiny_tokens))]).witness.equal
    assert len(empty) == 0 and empty.logits is None


def test_forget_zeroes_freed_rows(tiny_kernel, tiny_tokens):
    cache = tiny_kernel.prefill(tiny_tokens)
    cache.forget([(5, 40)], witness="none")
    n = len(cache)
    assert not cache._kv[:, :, :, n:].any(), "rows past the end must be zeroed"


def test_truncate_equals_fresh_prefix(tiny_kernel, tiny_tokens, never_saw):
    cache = tiny_kernel.prefill(tiny_tokens)
    cache.truncate(37)
    assert cache.tokens == tiny_tokens[:37]
    never_saw(tiny_kernel, cache)
    assert not cache._kv[:, :, :, 37:].any()


@pytest.mark.parametrize("case", ["head", "several"])
def test_forget_without_a_rollback_copy_is_as_exact(tiny_kernel, tiny_tokens, never_saw, case):
    spans = _span_cases(len(tiny_tokens))[case]
    cache = tiny_kernel.prefill(tiny_tokens)
    result = cache.forget(spans, rollback=False)
    _assert_witness_exact(result, _survivors(tiny_tokens, spans), spans)
    never_saw(tiny_kernel, cache)


def test_a_failed_forget_without_a_rollback_copy_leaves_nothing(tiny_kernel, tiny_tokens, monkeypatch):
    """With no copy to restore, a recompute that fails wipes the cache: every row zeroed, no
    token, no logits; the span is never left in memory, nor half a recompute."""
    cache = tiny_kernel.prefill(tiny_tokens)
    buffer = cache._kv

    def broken(tokens):
        raise RuntimeError("injected: the recompute failed")
    monkeypatch.setattr(cache, "_append", broken)
    with pytest.raises(RuntimeError, match="injected"):
        cache.forget([(5, 15)], rollback=False)
    assert len(cache) == 0 and cache.nbytes == 0 and cache.logits is None
    assert not buffer.any()  # the old buffer was zeroed before it was let go
