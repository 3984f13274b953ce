"""A compact Llama-family forward pass whose results do not depend on how the tokens were chunked.

Why this exists: in plain transformers, "prefill A then C" differs from "prefill A+C" by ~1e-5,
and decoding token by token differs again, because CPU matmul and SDPA results depend on the
shapes of the call. Exact forget needs the K, V and logits at position p to be a pure function of
``tokens[0..p]``. This module makes every shape that can influence a row's bits canonical:

* **Linear layers** run on row blocks whose row count M is drawn from the fixed set of the
  :class:`~kvkernel.plan.Plan` calibrated for this machine (:mod:`kvkernel.calibrate`): a row's
  result never depends on the other rows' content, and it is the same for every M the plan uses,
  in the GEMM operand form the plan names for that M. So a decode step runs at the plan's
  smallest M, not a whole tile.
* **Attention** runs per tile of ``T`` query positions aligned to position 0, always with exactly
  ``T`` query rows (pad rows after the real ones) against keys ``[0, L)`` with an explicit causal
  mask, where ``L`` is the tile's end rounded up to ``KEY_BUCKET``. Tiles sharing ``L`` run as one
  batched call (same bits, fewer calls). A query row's result depends on the call's key length,
  and, above a machine-dependent number of query rows, not on how many query rows share the call
  (CPU flash attention splits queries in blocks of 32). So where the plan allows it, a few new
  rows (decode, small appends) attend alone, at the same key length, in one call of at least the
  plan's minimum rows; otherwise they run as a whole tile.
* **Logits** of a row are always computed from that row alone (M = 1).
* **RoPE** reads a per-position cos/sin table (elementwise, so per-position exact) and rotates the
  pre-RoPE key once at its absolute position; a key is never rotated twice.

Rows already in the cache are never recomputed, so appending, staging and decoding only touch
the new rows. Nothing here is a debug mode: this is the only forward the kernel has.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kvkernel.errors import ModelError
from kvkernel.model import Model
from kvkernel.plan import TORCH, Plan, Primitives

KEY_BUCKET = 128  # attention key lengths are rounded up to a multiple of this (and of the tile)


@dataclass(frozen=True)
class Shape:
    """The few numbers the forward pass and the cache need from an HF config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    eps: float

    @classmethod
    def of(cls, config: Any) -> Shape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            eps=float(config.rms_norm_eps),
        )


@dataclass
class Layer:
    """One decoder layer's weights (``[out, in]``), with q/k/v and gate/up fused so each is one GEMM."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class Transformer:
    """Weights plus the canonical forward; stateless apart from the RoPE table.

    The cache tensor it writes into has shape ``[3, layers, kv_heads, capacity, head_dim]``:
    index 0 holds rotated keys, 1 values, 2 pre-RoPE ("raw") keys.
    """

    def __init__(self, model: Model, tile: int, plan: Plan, primitives: Primitives = TORCH) -> None:
        if tile < 1:
            raise ModelError(f"tile must be a positive number of rows, got {tile}")
        if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
            if model.config.sliding_window < model.max_context:
                raise ModelError("sliding-window attention is not supported; use a checkpoint with sliding_window=null")
        exact_device_settings(model.device, model.dtype)
        self.tile = tile
        self.plan = plan
        self.primitives = primitives
        self.threads = pinned_threads()
        self.key_bucket = -(-KEY_BUCKET // tile) * tile
        self.shape = Shape.of(model.config)
        self.model_identity = model.identity
        self.device, self.dtype = model.device, model.dtype
        w = model.weights
        self.embed = w["model.embed_tokens.weight"]
        self.final_norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        self.layers = [self._layer(w, i) for i in range(self.shape.layers)]
        cos, sin = rope_table(model.config, model.max_context, self.shape.head_dim)
        self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    def with_plan(self, plan: Plan) -> Transformer:
        """The same weights under another plan (shares every tensor; used by calibration)."""
        other = copy.copy(self)
        other.plan = plan
        return other

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        biases = [b for n in "qkv" if (b := w.get(f"{p}self_attn.{n}_proj.bias")) is not None]
        return Layer(
            attn_norm=w[p + "input_layernorm.weight"],
            qkv=torch.cat([w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]),
            qkv_bias=torch.cat(biases) if len(biases) == 3 else None,
            o=w[p + "self_attn.o_proj.weight"],
            mlp_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            down=w[p + "mlp.down_proj.weight"],
        )

    # -- public -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, kv: torch.Tensor, tokens: Sequence[int], start: int,
                capture: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Compute rows ``[start, start + len(tokens))``, writing their K/V into ``kv``.

        Rows ``[0, start)`` must already be in ``kv``; rows beyond the new ones must be finite
        (they are masked). Returns the final-norm hidden states of the new rows, ``[n, hidden]``.
        ``capture`` maps layer indices to lists that receive the new rows' residual stream after
        that layer (as HF's ``hidden_states[layer + 1]``); reading them changes no arithmetic.
        """
        pin_threads(self.threads)
        out, off = [], 0
        for rows, m in self.plan.blocks(len(tokens)):
            out.append(self._block(kv, tokens[off : off + rows], start + off, m, capture))
            off += rows
        return torch.cat(out) if out else self.embed.new_zeros(0, self.shape.hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for each row of ``hidden``, each row computed alone (M = 1).

        One row at a time is the one shape that needs no invariance argument, and the kernel only
        ever needs the last row's logits.
        """
        pin_threads(self.threads)
        rows = [self.primitives.linear(hidden[i : i + 1], self.lm_head, "linear") for i in range(hidden.shape[0])]
        return torch.cat(rows).float() if rows else hidden.new_zeros(0, self.shape.vocab)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., n, head_dim] to ``positions`` [n] (HF's rotate-half convention)."""
        return _rotate(x, self.cos[positions], self.sin[positions])

    # -- internals ----------------------------------------------------------------------------

    def _block(self, kv: torch.Tensor, tokens: Sequence[int], start: int, m: int,
               capture: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        s = self.shape
        n = len(tokens)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        x = _pad_rows(self.embed[ids], m)
        pos = torch.arange(start, start + n, device=self.device)
        cos, sin = self.cos[pos], self.sin[pos]
        attend = self._attention_for(start, n)
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for li, layer in enumerate(self.layers):
            qkv = self.linear(_rms_norm(x, layer.attn_norm, s.eps), layer.qkv, "qkv")
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q = qkv[:n, :q_dim].view(n, s.heads, s.head_dim).transpose(0, 1)
            k = qkv[:n, q_dim : q_dim + kv_dim].view(n, s.kv_heads, s.head_dim).transpose(0, 1)
            v = qkv[:n, q_dim + kv_dim :].view(n, s.kv_heads, s.head_dim).transpose(0, 1)
            rows = slice(start, start + n)
            kv[0, li, :, rows] = _rotate(k, cos, sin)
            kv[1, li, :, rows] = v
            kv[2, li, :, rows] = k
            attn = attend(kv[0, li], kv[1, li], _rotate(q, cos, sin).transpose(0, 1))
            x = x + self.linear(_pad_rows(attn, m), layer.o, "o")
            gate, up = self.linear(_rms_norm(x, layer.mlp_norm, s.eps), layer.gate_up, "gate_up").chunk(2, dim=-1)
            x = x + self.linear(F.silu(gate) * up, layer.down, "down")
            if capture is not None and li in capture:
                capture[li].append(x[:n].clone())
        return _rms_norm(x[:n], self.final_norm, s.eps)

    def linear(self, x: torch.Tensor, w: torch.Tensor, projection: str) -> torch.Tensor:
        """``x @ w.T`` at the block's M, in the plan's form, in the plan's pieces if it names any."""
        size = self.plan.piece(projection, x.shape[0])
        if size is not None:
            return torch.cat([self.linear(piece, w, "") for piece in x.split(size)])
        return self.primitives.linear(x, w, self.plan.form(x.shape[0]))

    def key_length(self, tile_end: int) -> int:
        """The canonical key length of a tile's attention call: its end rounded up to a bucket.

        Tiles that share a bucket share the call shape, so a prefill runs them as one batched
        SDPA call (bit-identical to running them one by one, and ~6x faster on CPU).
        """
        return -(-tile_end // self.key_bucket) * self.key_bucket

    def _attention_for(self, start: int, n: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Choose the attention layout for rows ``[start, start+n)``; built once, used by every layer.

        A few rows that share a key length attend alone (decode, small appends); anything else
        runs in whole tiles. Both give a row the same bits (see the module docstring).
        """
        t = self.tile
        groups = self.shape.heads // self.shape.kv_heads
        length = self.key_length(start // t * t + t)
        alone = self.plan.attention_min_rows is not None and groups * n <= self.plan.attention_max_rows
        if alone and self.key_length((start + n - 1) // t * t + t) == length:
            return partial(self._attend_rows, mask=self._row_mask(start, n, length))
        return partial(self._attend_tiles, start=start, plan=self._attention_plan(start, n))

    def _row_mask(self, start: int, n: int, length: int) -> torch.Tensor:
        """Causal mask ``[1, 1, rows, length]`` for query rows ordered (group, position).

        Pad rows (up to the plan's minimum rows) sit at position 0, so they stay finite.
        """
        groups = self.shape.heads // self.shape.kv_heads
        pos = torch.zeros(max(self.plan.attention_min_rows or 1, groups * n), dtype=torch.long, device=self.device)
        pos[: groups * n] = torch.arange(start, start + n, device=self.device).repeat(groups)
        blocked = torch.arange(length, device=self.device)[None, :] > pos[:, None]
        return torch.zeros(blocked.shape, device=self.device, dtype=self.dtype).masked_fill_(blocked, float("-inf"))[None, None]

    def _attend_rows(self, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        """Attention of a few query rows ``q`` [n, heads, head_dim] in one call of the tiles' key length."""
        s = self.shape
        n = q.shape[0]
        groups = s.heads // s.kv_heads
        rows, length = mask.shape[-2:]
        qr = q.view(n, s.kv_heads, groups, s.head_dim).permute(1, 2, 0, 3).reshape(s.kv_heads, groups * n, s.head_dim)
        if rows > groups * n:
            qr = torch.cat([qr, qr.new_zeros(s.kv_heads, rows - groups * n, s.head_dim)], dim=1)
        o = self.primitives.attention(qr[None], keys[None, :, :length], values[None, :, :length], mask)
        return o[0, :, : groups * n].reshape(s.kv_heads, groups, n, s.head_dim).permute(2, 0, 1, 3).reshape(n, s.heads * s.head_dim)

    def _attention_plan(self, start: int, n: int) -> list[tuple[int, int, int, torch.Tensor]]:
        """(first tile, last tile + 1, key length, additive mask) per batched attention call.

        Built once per block and shared by all layers; a tile's mask depends only on its base.
        """
        t = self.tile
        groups = self.shape.heads // self.shape.kv_heads
        first = start - start % t
        bases = list(range(first, start + n, t))
        plan = []
        lo = 0
        while lo < len(bases):
            length = self.key_length(bases[lo] + t)
            hi = lo
            while hi < len(bases) and self.key_length(bases[hi] + t) == length:
                hi += 1
            query_pos = torch.tensor(bases[lo:hi], device=self.device)[:, None] + torch.arange(t, device=self.device)[None, :]
            allowed = torch.arange(length, device=self.device)[None, None, :] <= query_pos[:, :, None]
            mask = torch.zeros(allowed.shape, device=self.device, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))
            plan.append((lo, hi, length, mask.repeat(1, groups, 1)[:, None]))
            lo = hi
        return plan

    def _attend_tiles(self, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, *, start: int, plan: list[tuple[int, int, int, torch.Tensor]]) -> torch.Tensor:
        """Attention of query rows at ``[start, start+n)``, in canonical tiles.

        ``keys``/``values`` are one layer's ``[kv_heads, capacity, head_dim]`` cache slices, with
        the new rows already written. GQA is folded into the query rows: each KV head sees
        ``groups * T`` query rows per tile, so no key is ever copied per head.
        """
        s, t = self.shape, self.tile
        n = q.shape[0]
        groups = s.heads // s.kv_heads
        tiles = plan[-1][1]
        offset = start % t
        qa = q.new_zeros(tiles * t, s.heads, s.head_dim)
        qa[offset : offset + n] = q
        qt = qa.view(tiles, t, s.kv_heads, groups, s.head_dim).permute(0, 2, 3, 1, 4).reshape(tiles, s.kv_heads, groups * t, s.head_dim)
        outs = []
        for lo, hi, length, mask in plan:
            k = keys[None, :, :length].expand(hi - lo, -1, -1, -1)
            v = values[None, :, :length].expand(hi - lo, -1, -1, -1)
            outs.append(self.primitives.attention(qt[lo:hi], k, v, mask))
        o = torch.cat(outs).view(tiles, s.kv_heads, groups, t, s.head_dim).permute(0, 3, 1, 2, 4)
        return o.reshape(tiles * t, s.heads * s.head_dim)[offset : offset + n]


def pinned_threads() -> int:
    """The intra-op thread count the canonical forward runs with: this process's CPU allowance.

    The thread count is part of the environment exactness depends on: on an Intel Xeon here, MKL
    gives 4-row GEMMs other bits with 1 thread than with 2. So the count is fixed per process,
    not read from whatever torch.set_num_threads() last set, and the self-test runs under it."""
    override = os.environ.get("LETHE_KERNEL_THREADS")
    return int(override) if override else max(1, len(os.sched_getaffinity(0)))


def exact_device_settings(device: torch.device, dtype: torch.dtype) -> None:
    """On CUDA in float32, switch TF32 off (process-wide): TF32 rounds GEMM inputs to 10 mantissa
    bits, so a float32 kernel would not compute float32 bits, and calibration would measure another
    arithmetic than the one it promises. Calibration then runs on the device like on a CPU."""
    if device.type == "cuda" and dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pin_threads(threads: int) -> None:
    """Restore the pinned count if other code in the process changed it (e.g. a training script)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def rope_table(config: Any, positions: int, head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[positions, head_dim]`` for the config's RoPE variant (HF's definitions)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64 if dtype == torch.float64 else torch.float) / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    freqs = torch.arange(positions, dtype=dtype)[:, None] * inv_freq.to(dtype)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Purely elementwise, so a row's bits depend only on its own raw values and position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm; per row, and bit-equal to HF's pow/mean/rsqrt/scale (checked on CPU)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    if x.shape[0] == m:
        return x
    return torch.cat([x, x.new_zeros(m - x.shape[0], *x.shape[1:])])
