"""kvkernel: an owned, exact KV cache with forget, amortize, stage/rollback and never-saw witnesses.

The kernel runs the model in process with a canonical, chunking-invariant forward pass
(:mod:`kvkernel.forward`) whose call shapes follow a plan calibrated per machine
(:mod:`kvkernel.calibrate`), so a span removed from a kept sequence leaves the cache bit for bit
identical to a run that never saw it, and a witness proves it (:mod:`kvkernel.witness`).
"""

from kvkernel.cache import (
    KERNEL_VERSION,
    AmortizeResult,
    ForgetResult,
    GenerationConfig,
    Kernel,
    KVCache,
    MemoryReport,
    forget_witness,
)
from kvkernel.errors import ExactnessError, KernelError, ModelError, SpanError, StateError
from kvkernel.model import Model, load_model, prepare_model, tiny_random_model
from kvkernel.plan import Plan, Primitives, named_plan
from kvkernel.witness import AmortizeWitness, ForgetWitness, env_fingerprint, tokens_sha256

__all__ = [
    "KERNEL_VERSION",
    "AmortizeResult",
    "AmortizeWitness",
    "ExactnessError",
    "ForgetResult",
    "ForgetWitness",
    "GenerationConfig",
    "KVCache",
    "Kernel",
    "KernelError",
    "MemoryReport",
    "Model",
    "ModelError",
    "Plan",
    "Primitives",
    "SpanError",
    "StateError",
    "env_fingerprint",
    "forget_witness",
    "load_model",
    "named_plan",
    "prepare_model",
    "tiny_random_model",
    "tokens_sha256",
]
