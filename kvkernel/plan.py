"""The canonical plan: which call shapes the forward uses, chosen per machine, never hard-coded.

Why: a row's bits from a CPU GEMM or SDPA call depend on the call's shape in ways that differ per
CPU, BLAS build and thread count (an Intel Xeon's MKL gives the big-block bits with ``(W xᵀ)ᵀ`` at
every M >= 2; an AMD EPYC's gives them with ``F.linear`` only at M = 4, 8, 12, 16 and M >= 15).
So the shapes are data: a :class:`Plan` says how rows are cut into GEMM blocks and when a few rows
may attend alone, :mod:`kvkernel.calibrate` finds the cheapest plan that is exact on this machine,
and :mod:`kvkernel.forward` only ever reads the plan.

The GEMM and attention primitives are injectable (:class:`Primitives`) so that calibration and the
forward can be driven by deliberately quirky implementations in tests, whatever the host BLAS.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

Form = Literal["linear", "wxt"]
LinearFn = Callable[[torch.Tensor, torch.Tensor, Form], torch.Tensor]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Plan:
    """Every call shape of the canonical forward.

    Linear layers run on blocks of rows whose M is: for up to ``small_max`` rows, the rows rounded
    up to a multiple of ``small_step`` and at least ``small_min``, in the ``small_form`` operand
    form; up to ``mid_max`` rows, rounded up to a multiple of ``mid_step``; beyond, blocks of up to
    ``big_max`` rows with M >= ``big_min``. A projection named in ``pieces`` runs blocks of
    ``piece < M <= mid_max`` in pieces of ``piece`` rows. With ``fixed_m`` set, every linear call
    runs at exactly that M (the fallback: one shape, no M-invariance needed at all).

    Attention runs in whole tiles, except that a few rows sharing a key length attend alone in one
    call of ``max(attention_min_rows, rows)`` query rows (up to ``attention_max_rows``); with
    ``attention_min_rows`` None, every attention call is a whole tile.
    """

    name: str
    small_form: Form = "linear"
    small_max: int = 16
    small_min: int = 1
    small_step: int = 1
    mid_max: int = 192
    mid_step: int = 16
    big_min: int = 208
    big_max: int = 512
    pieces: tuple[tuple[str, int], ...] = ()
    fixed_m: int | None = None
    attention_min_rows: int | None = 1
    attention_max_rows: int = 32

    def blocks(self, n: int) -> list[tuple[int, int]]:
        """Split ``n`` rows into (real rows, M) blocks; every M is in :meth:`sizes`."""
        out = []
        while n > 0:
            if self.fixed_m is not None:
                rows, m = min(n, self.fixed_m), self.fixed_m
            elif n > self.mid_max:
                rows = min(n, self.big_max)
                m = max(_ceil(rows, self.mid_step), self.big_min)
            elif n > self.small_max:
                rows, m = n, _ceil(n, self.mid_step)
            else:
                rows, m = n, max(_ceil(n, self.small_step), self.small_min)
            out.append((rows, m))
            n -= rows
        return out

    def sizes(self) -> list[int]:
        """Every M that :meth:`blocks` can produce, ascending."""
        if self.fixed_m is not None:
            return [self.fixed_m]
        small = {max(_ceil(r, self.small_step), self.small_min) for r in range(1, self.small_max + 1)}
        mid = {_ceil(r, self.mid_step) for r in range(self.small_max + 1, self.mid_max + 1)}
        big = {max(_ceil(r, self.mid_step), self.big_min) for r in range(self.mid_max + 1, self.big_max + 1)}
        return sorted(small | mid | big)

    def form(self, m: int) -> Form:
        """The GEMM operand form of a block of M rows."""
        if self.fixed_m is not None or m <= self.small_max:
            return self.small_form
        return "linear"

    def piece(self, projection: str, m: int) -> int | None:
        """Rows per piece for ``projection`` at M, or None when it runs as one call."""
        size = dict(self.pieces).get(projection)
        return size if size is not None and self.fixed_m is None and size < m <= self.mid_max else None

    def calls(self, projection: str) -> list[tuple[int, Form]]:
        """Every (M, form) a GEMM of ``projection`` can be called with under this plan."""
        out = set()
        for m in self.sizes():
            size = self.piece(projection, m)
            for rows in ([size] * (m // size) + ([m % size] if m % size else [])) if size else [m]:
                out.add((rows, self.form(rows)))
        return sorted(out)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pieces"] = {k: v for k, v in self.pieces}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        d["pieces"] = tuple(sorted((str(k), int(v)) for k, v in d.get("pieces", {}).items()))
        return cls(**d)

    @property
    def sha256(self) -> str:
        """Hash of the plan's fields: part of every witness's provenance."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def _ceil(n: int, q: int) -> int:
    return -(-n // q) * q


def torch_linear(x: torch.Tensor, w: torch.Tensor, form: Form) -> torch.Tensor:
    """``x @ w.T`` in the requested operand form.

    The ``wxt`` result is made contiguous again: elementwise kernels (silu) take a vectorised or a
    scalar path depending on the innermost extent, so a transposed ``[M, out]`` would give
    M-dependent bits.
    """
    if form == "wxt":
        return (w @ x.T).T.contiguous()
    return F.linear(x, w)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass(frozen=True)
class Primitives:
    """The GEMM and attention calls the forward and the calibration use (injectable for tests).

    ``name`` is part of the environment fingerprint, so plans found for an injected quirk are
    never confused with the host's.
    """

    name: str = "torch"
    linear: LinearFn = field(default=torch_linear)
    attention: AttentionFn = field(default=torch_attention)


TORCH = Primitives()

# Known plans, tried first by calibration because they were measured fast somewhere.
XEON = Plan("xeon", small_form="wxt", small_min=2, pieces=(("down", 48),), attention_min_rows=3)
AMD = Plan("amd", small_form="linear", small_min=4, small_step=4, attention_min_rows=4)
