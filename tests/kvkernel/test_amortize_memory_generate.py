"""amortize is a measured approximation (never erasure); memory accounting; generation behaviour."""

from __future__ import annotations

import pytest

from kvkernel import GenerationConfig


def _check_amortize(kernel, tokens, span, replacement):
    cache = kernel.prefill(tokens)
    result = cache.amortize(span, replacement)
    w = result.witness
    expected = tokens[: span[0]] + list(replacement) + tokens[span[1] :]
    assert cache.tokens == expected
    assert w.never_saw is False and w.kind == "amortize"
    assert w.positional_ok and w.positional_max_abs_err == 0.0
    assert w.positional_max_abs_err_f64 < 1e-3
    assert w.kl_mean > 0 and w.max_abs_dlogits > 0, "a span attended later must leave a measurable trace"
    d = w.to_dict()
    assert d["never_saw"] is False and "NOT erasure" in d["note"]
    # The replacement rows and everything before the span are exact; the downstream is not.
    fresh = kernel.prefill(expected)
    end = span[0] + len(replacement)
    for layer in range(kernel.transformer.shape.layers):
        got, want = cache.layer_kv(layer), fresh.layer_kv(layer)
        assert all((g[:, :end] == f[:, :end]).all() for g, f in zip(got, want, strict=True))
    return cache, w


def test_amortize_tiny_middle_span(tiny_kernel, tiny_tokens):
    _check_amortize(tiny_kernel, tiny_tokens, (40, 70), tiny_kernel.model.tokenizer.encode("[redacted]"))


@pytest.mark.model
def test_amortize_real_middle_span(real_kernel, real_model, real_tokens):
    tool = real_model.tokenizer.encode("TOOL RESULT", add_special_tokens=False)
    start = next(i for i in range(len(real_tokens)) if real_tokens[i : i + len(tool)] == tool)
    cache, w = _check_amortize(real_kernel, real_tokens, (start, start + 40), real_model.tokenizer.encode("[tool result removed]"))
    assert 0 <= w.argmax_agreement <= 1 and w.kl_max >= w.kl_mean


@pytest.mark.model
def test_memory_accounting_real(real_base, real_model):
    cfg = real_model.config
    report = real_base.memory()
    per_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert report.kv_bytes_per_token == per_kv == 46080
    assert report.raw_key_bytes_per_token == per_kv // 2
    assert report.bytes_per_token == per_kv + per_kv // 2
    assert report.total_bytes == report.bytes_per_token * len(real_base)
    assert report.allocated_bytes >= report.total_bytes
    assert report.to_dict()["tokens"] == len(real_base)


def test_generate_seeded_sampling_and_stop(tiny_kernel, tiny_tokens):
    base = tiny_kernel.prefill(tiny_tokens[:30])
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.8, seed=42)
    a, b = base.clone(), base.clone()
    assert list(a.generate(cfg)) == list(b.generate(cfg))
    assert a.digest() == b.digest()
    greedy = base.clone()
    out = list(greedy.generate(GenerationConfig(max_new_tokens=15)))
    assert len(out) == 15 and greedy.tokens == tiny_tokens[:30] + out
    stop = tiny_kernel.model.tokenizer.decode(out[3:5])
    stopped = base.clone()
    got = list(stopped.generate(GenerationConfig(max_new_tokens=15, stop=[stop])))
    assert stop in tiny_kernel.model.tokenizer.decode(got) and len(got) <= 5


@pytest.mark.model
def test_generate_stops_on_eos_real(real_base, real_model):
    cache = real_base.clone()
    out = list(cache.generate(GenerationConfig(max_new_tokens=24)))
    assert out[-1] in real_model.eos_token_ids or len(out) == 24
    assert all(t not in real_model.eos_token_ids for t in out[:-1])
    assert cache.tokens[-len(out) :] == out
