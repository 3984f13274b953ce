"""A compact Llama-family forward pass whose results do not depend on how the tokens were chunked.

Why this exists: in plain transformers, "prefill A then C" differs from "prefill A+C" by ~1e-5,
and decoding token by token differs again, because CPU matmul and SDPA results depend on the
shapes of the call. Exact forget needs the K, V and logits at position p to be a pure function of
``tokens[0..p]``. This module makes every shape that can influence a row's bits canonical:

* **Attention** runs per tile of ``T`` query positions aligned to position 0, always with exactly
  ``T`` query rows (pad rows after the real ones) against keys ``[0, L)`` with an explicit causal
  mask, where ``L`` is the tile's end rounded up to ``KEY_BUCKET``. A row's attention therefore
  sees the same call shape whether it arrived in a 2,000-token prefill, in a 7-token piece or
  alone in a decode step. Tiles sharing ``L`` run as one batched call (same bits, fewer calls).
* **Linear layers** run on row blocks whose padded row count M is drawn from a fixed set
  (:func:`block_plan`). Measured here (MKL SGEMM, 2 threads): a row's result does not depend on
  the other rows' content, and is identical for M = 16, 32, 48 and every multiple of 16 in
  208..512, but not for M < 16 or M = 60..192 (the MLP's down projection changes code path).
  :func:`linear_row_invariance` re-checks the shapes used at start-up.
* **Logits** always come from a 4-row block, whatever the caller needs. For up to 4 new rows
  (decode) the q/k/v and output projections also run at M = 4, which gives the same row bits as
  M >= 16 for those shapes (but not for the MLP, which stays at M >= 16).
* **RoPE** reads a per-position cos/sin table (elementwise, so per-position exact) and rotates the
  pre-RoPE key once at its absolute position; a key is never rotated twice.

Rows already in the cache are never recomputed, so appending, staging and decoding only touch
the new rows. Nothing here is a debug mode: this is the only forward the kernel has.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvkernel.errors import ModelError
from kvkernel.model import Model

LOGIT_ROWS = 4  # logits are always computed from a block of exactly this many rows
DECODE_PROJ_ROWS = 4  # q/k/v and o projections of <= 4 new rows run at M = 4 (row-invariant there)
SMALL_BLOCK = 48  # small work runs in blocks of 16, 32 or 48 rows
MIN_BIG_BLOCK = 208  # bulk work runs in blocks of 208..256 rows
MAX_ROWS = 512
KEY_BUCKET = 128  # attention key lengths are rounded up to a multiple of this (and of the tile)
BLOCK_SIZES = (16, 32, 48, 208, 224, 256, 384, 512)  # checked at start-up; 208..512 step 16 all scanned


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
    """One decoder layer's weights, with q/k/v and gate/up fused so each is a single GEMM."""

    attn_norm: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


class Transformer:
    """Weights plus the canonical forward; stateless apart from the RoPE table.

    The cache tensor it writes into has shape ``[3, layers, kv_heads, capacity, head_dim]``:
    index 0 holds rotated keys, 1 values, 2 pre-RoPE ("raw") keys.
    """

    def __init__(self, model: Model, tile: int) -> None:
        if tile < 1:
            raise ModelError(f"tile must be a positive number of rows, got {tile}")
        if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
            if model.config.sliding_window < model.max_context:
                raise ModelError("sliding-window attention is not supported; use a checkpoint with sliding_window=null")
        self.tile = tile
        self.threads = pinned_threads()
        self.key_bucket = -(-KEY_BUCKET // tile) * tile
        self.shape = Shape.of(model.config)
        self.device, self.dtype = model.device, model.dtype
        w = model.weights
        self.embed = w["model.embed_tokens.weight"]
        self.final_norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        self.layers = [self._layer(w, i) for i in range(self.shape.layers)]
        cos, sin = rope_table(model.config, model.max_context, self.shape.head_dim)
        self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"model.layers.{i}."
        biases = [w.get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
        return Layer(
            attn_norm=w[p + "input_layernorm.weight"],
            w_qkv=torch.cat([w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]),
            b_qkv=torch.cat(biases) if all(b is not None for b in biases) else None,  # type: ignore[misc]
            w_o=w[p + "self_attn.o_proj.weight"],
            mlp_norm=w[p + "post_attention_layernorm.weight"],
            w_gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            w_down=w[p + "mlp.down_proj.weight"],
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
        for rows, m in block_plan(len(tokens)):
            out.append(self._block(kv, tokens[off : off + rows], start + off, m, capture))
            off += rows
        return torch.cat(out) if out else self.embed.new_zeros(0, self.shape.hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for each row of ``hidden``, always computed in blocks of LOGIT_ROWS."""
        pin_threads(self.threads)
        rows = []
        for off in range(0, hidden.shape[0], LOGIT_ROWS):
            chunk = hidden[off : off + LOGIT_ROWS]
            block = _pad_rows(chunk, LOGIT_ROWS)
            rows.append(F.linear(block, self.lm_head)[: chunk.shape[0]])
        return torch.cat(rows).float()

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
        plan = self._attention_plan(start, n)
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        mp = DECODE_PROJ_ROWS if n <= DECODE_PROJ_ROWS else m
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x[:mp], layer.attn_norm, s.eps)
            qkv = F.linear(h, layer.w_qkv, layer.b_qkv)
            q = qkv[:n, :q_dim].view(n, s.heads, s.head_dim).transpose(0, 1)
            k = qkv[:n, q_dim : q_dim + kv_dim].view(n, s.kv_heads, s.head_dim).transpose(0, 1)
            v = qkv[:n, q_dim + kv_dim :].view(n, s.kv_heads, s.head_dim).transpose(0, 1)
            rows = slice(start, start + n)
            kv[0, li, :, rows] = _rotate(k, cos, sin)
            kv[1, li, :, rows] = v
            kv[2, li, :, rows] = k
            attn = self._attention(kv[0, li], kv[1, li], _rotate(q, cos, sin).transpose(0, 1), start, plan)
            x = x + _pad_rows(F.linear(_pad_rows(attn, mp), layer.w_o), m)
            h = _rms_norm(x, layer.mlp_norm, s.eps)
            gate, up = F.linear(h, layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
            if capture is not None and li in capture:
                capture[li].append(x[:n].clone())
        return _rms_norm(x[:n], self.final_norm, s.eps)

    def key_length(self, tile_end: int) -> int:
        """The canonical key length of a tile's attention call: its end rounded up to a bucket.

        Tiles that share a bucket share the call shape, so a prefill runs them as one batched
        SDPA call (bit-identical to running them one by one, and ~6x faster on CPU).
        """
        return -(-tile_end // self.key_bucket) * self.key_bucket

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

    def _attention(self, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, start: int, plan: list[tuple[int, int, int, torch.Tensor]]) -> torch.Tensor:
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
            outs.append(F.scaled_dot_product_attention(qt[lo:hi], k, v, attn_mask=mask))
        o = torch.cat(outs).view(tiles, s.kv_heads, groups, t, s.head_dim).permute(0, 3, 1, 2, 4)
        return o.reshape(tiles * t, s.heads * s.head_dim)[offset : offset + n]


def pinned_threads() -> int:
    """The intra-op thread count the canonical forward runs with: this process's CPU allowance.

    The thread count is part of the environment exactness depends on: on an Intel Xeon here, MKL
    gives 4-row GEMMs other bits with 1 thread than with 2. So the count is fixed per process,
    not read from whatever torch.set_num_threads() last set, and the self-test runs under it."""
    override = os.environ.get("LETHE_KERNEL_THREADS")
    return int(override) if override else max(1, len(os.sched_getaffinity(0)))


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


def block_plan(n: int) -> list[tuple[int, int]]:
    """Split ``n`` rows into (real rows, padded M) blocks; M is 16, 32, 48 or a multiple of 16 in 208..512.

    Why these sizes: on MKL SGEMM with 2 threads, a row's bits are the same for M = 16, 32, 48 and
    every multiple of 16 in 208..512, but M < 16 and M = 60..192 take other code paths for the
    MLP's down projection (measured, and re-checked at start-up by :func:`linear_row_invariance`).
    """
    plan = []
    while n > 0:
        if n > SMALL_BLOCK * 4:  # above 192 rows one big block; below, 48-row blocks avoid M = 60..192
            rows = min(n, MAX_ROWS)
            m = max(_ceil(rows, 16), MIN_BIG_BLOCK)
        else:
            rows = min(n, SMALL_BLOCK)
            m = _ceil(rows, 16)
        plan.append((rows, m))
        n -= rows
    return plan


def _ceil(n: int, q: int) -> int:
    return -(-n // q) * q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Purely elementwise, so a row's bits depend only on its own raw values and position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def _pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    if x.shape[0] == m:
        return x
    return torch.cat([x, x.new_zeros(m - x.shape[0], *x.shape[1:])])


def linear_row_invariance(transformer: Transformer, sizes: Sequence[int] = BLOCK_SIZES) -> list[str]:
    """Check that every linear shape the forward uses gives each row identical bits for each M.

    Returns the failures as readable strings (empty when the environment is exact). Uses layer 0
    (all layers share shapes); the LM head only ever runs at M = LOGIT_ROWS, so for it the check
    is that a row's logits do not depend on the other rows of the block.
    """
    pin_threads(transformer.threads)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    layer = transformer.layers[0]
    s = transformer.shape
    proj_sizes = (DECODE_PROJ_ROWS, *sizes)
    mats = {
        "qkv": (layer.w_qkv, layer.b_qkv, s.hidden, proj_sizes),
        "o": (layer.w_o, None, s.heads * s.head_dim, proj_sizes),
        "gate_up": (layer.w_gate_up, None, s.hidden, sizes),
        "down": (layer.w_down, None, layer.w_down.shape[1], sizes),
    }
    failures = []
    top = max(sizes)
    for name, (w, b, k, ms) in mats.items():
        x = torch.randn(top, k, generator=gen).to(transformer.device, transformer.dtype)
        ref = F.linear(x, w, b)
        for m in ms:
            got = F.linear(x[:m], w, b)
            if not torch.equal(got, ref[:m]):
                failures.append(f"{name}: M={m} rows differ from M={top}")
    h = torch.randn(LOGIT_ROWS, s.hidden, generator=gen).to(transformer.device, transformer.dtype)
    alone = _pad_rows(h[:1], LOGIT_ROWS)
    if not torch.equal(F.linear(alone, transformer.lm_head)[0], F.linear(h, transformer.lm_head)[0]):
        failures.append(f"lm_head: a row's logits depend on the other rows of its {LOGIT_ROWS}-row block")
    return failures
