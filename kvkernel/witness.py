"""Witnesses: what the kernel can prove about an edit, as JSON-able records.

A :class:`ForgetWitness` compares an edited cache with a *never-saw* reference, a fresh prefill of
the surviving tokens in a separate cache, and records both digests and the largest differences.
An :class:`AmortizeWitness` records the positional check of a Leyline splice and how far the
spliced cache drifts from never-saw. It never claims never-saw: amortize is not erasure.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch

# Environment variables that were measured to change (or could change) the bits of MKL/ATen.
_ENV_KNOBS = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG")


def tokens_sha256(tokens: Sequence[int]) -> str:
    """sha256 of token ids as little-endian int64, the encoding every witness uses."""
    return hashlib.sha256(np.asarray(list(tokens), dtype="<i8").tobytes()).hexdigest()


@cache
def env_fingerprint() -> dict[str, Any]:
    """The parts of the environment the kernel's bits depend on (measured), for witnesses."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "env": {k: os.environ[k] for k in _ENV_KNOBS if k in os.environ},
    }
    info["sha256"] = hashlib.sha256(repr(sorted(info.items())).encode()).hexdigest()
    return info


@dataclass(kw_only=True)
class Provenance:
    """What produced a witness: a verifier compares only witnesses with the same provenance."""

    model_identity: str
    device: str
    dtype: str
    kernel_version: str
    tile: int
    plan_sha256: str
    env: dict[str, Any] = field(default_factory=env_fingerprint)


@dataclass
class ForgetWitness(Provenance):
    """Edited cache vs a fresh prefill of the surviving tokens ("never saw the spans")."""

    equal: bool
    digest_edited: str
    digest_reference: str
    max_abs_dk: float
    max_abs_dv: float
    max_abs_dlogits: float
    argmax_equal: bool
    survivors_sha256: str
    tokens: int
    spans: list[tuple[int, int]]
    kind: str = "never-saw"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["spans"] = [list(s) for s in self.spans]
        return d


@dataclass
class AmortizeWitness(Provenance):
    """What a Leyline splice does and does not preserve. ``never_saw`` is always False.

    The positional check compares the re-rotated downstream keys with a fresh rotation of their
    pre-RoPE keys at the new positions. The divergence figures compare the spliced cache with a
    fresh prefill of the edited tokens, over the next-token logits and a teacher-forced probe.
    """

    span: tuple[int, int]
    replacement_tokens: int
    shift: int
    positional_max_abs_err: float
    positional_max_abs_err_f64: float
    positional_ok: bool
    kl_mean: float
    kl_max: float
    argmax_agreement: float
    max_abs_dlogits: float
    probe_positions: int
    kind: str = "amortize"
    never_saw: bool = False
    note: str = "amortize is NOT erasure: downstream tokens keep K/V computed while the span was present"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["span"] = list(self.span)
        return d


def divergence(edited: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """KL(reference || edited) per row, and argmax agreement, over ``[rows, vocab]`` logits."""
    ref_logp = torch.log_softmax(reference.double(), dim=-1)
    edit_logp = torch.log_softmax(edited.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - edit_logp)).sum(-1).clamp_min(0.0)
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "argmax_agreement": float((edited.argmax(-1) == reference.argmax(-1)).double().mean()),
        "max_abs_dlogits": float((edited - reference).abs().max()),
    }
