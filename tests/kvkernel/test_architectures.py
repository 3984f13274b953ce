"""Every architecture the README names runs exactly: Llama, Qwen2 (q/k/v biases) and Mistral.

Tiny random models of each: the kernel's logits agree with plain transformers on the same weights
(so biases and configs are read right), and forget equals never-saw at max|Δ| = 0.
"""

from __future__ import annotations

import pytest
import torch

from kvkernel import Kernel, tiny_random_model

ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_kernel(request):
    model = tiny_random_model(3, arch=request.param)
    kernel = Kernel(model)
    yield model, kernel
    kernel.close()


def test_tiny_models_of_each_architecture_have_their_own_shapes():
    qwen, llama = tiny_random_model(0, "qwen2"), tiny_random_model(0, "llama")
    assert qwen.config.model_type == "qwen2" and "model.layers.0.self_attn.q_proj.bias" in qwen.weights
    assert "model.layers.0.self_attn.q_proj.bias" not in llama.weights
    assert tiny_random_model(0, "mistral").config.model_type == "mistral"


def test_kernel_logits_match_plain_transformers_for_each_architecture(arch_kernel, tiny_tokens):
    from transformers import AutoModelForCausalLM

    model, kernel = arch_kernel
    hf = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    hf.load_state_dict(model.weights)
    tokens = tiny_tokens[:80]
    with torch.inference_mode():
        reference = hf.eval()(torch.tensor([tokens])).logits[0, -1]
    got = kernel.prefill(tokens).logits
    assert int(got.argmax()) == int(reference.argmax())
    assert float((got - reference).abs().max()) < 1e-3


@pytest.mark.parametrize("spans", [[(0, 25)], [(40, 70)], [(120, 150)], [(5, 9), (60, 100)]])
def test_forget_equals_never_saw_for_each_architecture(arch_kernel, tiny_tokens, never_saw, spans):
    _, kernel = arch_kernel
    cache = kernel.prefill(tiny_tokens[:150])
    witness = cache.forget(spans).witness
    assert witness.equal and witness.max_abs_dk == witness.max_abs_dv == witness.max_abs_dlogits == 0.0
    never_saw(kernel, cache)


def test_decode_then_forget_equals_never_saw_for_each_architecture(arch_kernel, tiny_tokens, never_saw):
    _, kernel = arch_kernel
    cache = kernel.prefill(tiny_tokens[:60])
    for t in tiny_tokens[60:70]:
        cache.extend([t])
    assert cache.forget([(20, 35)]).witness.equal
    never_saw(kernel, cache)
