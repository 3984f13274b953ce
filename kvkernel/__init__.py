"""kvkernel: an owned, exact KV cache with forget, amortize, stage/rollback and never-saw witnesses.

The kernel runs the model in process with a canonical, chunking-invariant forward pass
(:mod:`kvkernel.forward`), so a span removed from a kept sequence leaves the cache bit for bit
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
    "SpanError",
    "StateError",
    "env_fingerprint",
    "forget_witness",
    "load_model",
    "prepare_model",
    "tiny_random_model",
    "tokens_sha256",
]
