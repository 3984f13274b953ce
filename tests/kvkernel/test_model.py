"""Model preparation, identity and self-test."""

from __future__ import annotations

import pytest

from kvkernel import Kernel, ModelError, prepare_model, tiny_random_model
from kvkernel.model import _load_tensors, _tensor_sha256


@pytest.mark.model
def test_prepare_is_idempotent_and_identity_is_tensor_hash(real_model, model_cache_dir):
    weights = real_model.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    path = prepare_model(cache_dir=model_cache_dir, progress=False)
    assert path == real_model.path and weights.stat().st_mtime_ns == stamp, "an existing conversion must be reused"
    assert real_model.identity == _tensor_sha256(_load_tensors(path))
    assert real_model.eos_token_ids == [2] and real_model.max_context == 8192
    text = real_model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_local_checkpoint_must_exist(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        prepare_model(str(tmp_path), cache_dir=tmp_path)


def test_tiny_model_is_deterministic_and_calibrated():
    a, b, c = tiny_random_model(0), tiny_random_model(0), tiny_random_model(1)
    assert a.identity == b.identity != c.identity
    kernel = Kernel(a, tile=8)
    assert kernel.calibration.plan is kernel.transformer.plan
    assert kernel.provenance()["plan_sha256"] == kernel.plan.sha256
    kernel.close()


def test_kernel_pins_its_thread_count(tiny_model):
    """Exactness depends on the GEMM thread count; other code changing it must not break a cache."""
    import torch

    from kvkernel import Kernel

    tokens = list(range(3, 40))
    kernel = Kernel(tiny_model)
    reference = kernel.prefill(tokens).digest()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if kernel.transformer.threads != 1 else 2)
        assert kernel.prefill(tokens).digest() == reference
        assert torch.get_num_threads() == kernel.transformer.threads
    finally:
        torch.set_num_threads(saved)
        kernel.close()
