"""Deliberately quirky GEMM and attention primitives, so every calibration path runs on any CPU.

Why: which call shapes give a row the same bits is a property of the host (CPU, BLAS, threads),
so tests run on one machine would only ever exercise that machine's plan. These primitives have
known, host-independent quirks instead:

* an *exact* base: every row is computed by the same fixed-shape call (one GEMV per row, one
  SDPA call per query row, each on a freshly allocated copy), so its bits cannot depend on M,
  on its place in the block or on the other rows;
* a deterministic, row-wise perturbation (a few parts in 10^5, far above float32 rounding) on
  the calls a quirk declares inexact, which depends on M (and, for some quirks, on the row's
  index in the call), as real BLAS kernels do.

They are slow (a Python loop per row) and meant for the tiny random model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvkernel.plan import Form, Primitives

EPS = 2.0**-16

LinearExact = Callable[[int, Form, torch.Tensor], bool]  # (M, form, weight) -> exact?


def exact_linear(x: torch.Tensor, w: torch.Tensor, form: Form) -> torch.Tensor:
    """``x @ w.T`` one row at a time, each row a fresh M = 1 call: bits independent of M."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[0])
    return torch.cat([F.linear(row.clone(), w) for row in x.split(1)])


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA one query row at a time (per batch entry and head): bits independent of the call's rows."""
    b, h, rows, d = q.shape
    k, v = k.expand(b, h, -1, -1), v.expand(b, h, -1, -1)
    mask = mask.expand(b, h, rows, -1)
    out = q.new_empty(b, h, rows, d)
    for i in range(b):
        for j in range(h):
            for r in range(rows):
                out[i, j, r] = F.scaled_dot_product_attention(
                    q[i, j, r].clone()[None, None, None], k[i, j][None, None], v[i, j][None, None],
                    attn_mask=mask[i, j, r].clone()[None, None, None])[0, 0, 0]
    return out


def _nudge(y: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Scale each element away from its value by ``EPS * factor`` (factor per row, >= 1)."""
    return y + y.abs() * (EPS * factor.to(y.dtype))


def quirky_linear(exact: LinearExact, *, by_row_index: bool = False) -> Callable[[torch.Tensor, torch.Tensor, Form], torch.Tensor]:
    """A GEMM that is exact where ``exact(M, form, w)`` says so, and perturbed by M elsewhere.

    With ``by_row_index`` the perturbation also depends on the row's index in the call, so the
    bits of an inexact M are not even consistent for one M.
    """

    def linear(x: torch.Tensor, w: torch.Tensor, form: Form) -> torch.Tensor:
        y = exact_linear(x, w, form)
        m = x.shape[0]
        if exact(m, form, w):
            return y
        factor = torch.full((m, 1), 1.0 + m % 5 + (form == "wxt"))
        if by_row_index:
            factor = factor + (torch.arange(m)[:, None] % 3)
        return _nudge(y, factor.to(y.device))

    return linear


def quirky_attention(exact_rows: Callable[[int], bool]) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """SDPA that is exact for calls whose query-row count passes ``exact_rows``, else perturbed by it."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = exact_attention(q, k, v, mask)
        rows = q.shape[-2]
        return out if exact_rows(rows) else _nudge(out, torch.tensor(1.0 + rows % 5, device=out.device))

    return attention


def _is_down(w: torch.Tensor) -> bool:
    """The MLP's down projection is the one linear shape that narrows (in > out)."""
    return w.shape[1] > w.shape[0]


def xeon_like(attention_rows: int = 3) -> Primitives:
    """As measured on an Intel Xeon: ``(W xᵀ)ᵀ`` exact from M = 2; ``F.linear`` only from M = 16
    (not at 4 or 8), and not for the down projection at M = 57..192; rows alone need >= 3 rows."""
    def exact(m: int, form: Form, w: torch.Tensor) -> bool:
        if form == "wxt":
            return m >= 2
        return m >= 16 and not (_is_down(w) and 57 <= m <= 192)

    return Primitives(f"quirk:xeon-like-attn{attention_rows}", quirky_linear(exact), quirky_attention(lambda r: r >= attention_rows))


def amd_like(attention_rows: int = 4) -> Primitives:
    """As measured on an AMD EPYC: ``F.linear`` exact at multiples of 4 and at M >= 15, ``(W xᵀ)ᵀ``
    only at M >= 15; rows alone need >= 4 rows."""
    def exact(m: int, form: Form, w: torch.Tensor) -> bool:
        return m >= 15 or (form == "linear" and m % 4 == 0)

    return Primitives(f"quirk:amd-like-attn{attention_rows}", quirky_linear(exact), quirky_attention(lambda r: r >= attention_rows))


def only_one_m(m_ok: int = 64) -> Primitives:
    """Only calls of exactly ``m_ok`` rows are consistent; every other M also depends on the row's index."""
    return Primitives(f"quirk:only-m{m_ok}", quirky_linear(lambda m, form, w: m == m_ok, by_row_index=True),
                      quirky_attention(lambda r: True))


def rows_alone_never(tile_rows: int) -> Primitives:
    """Exact GEMMs, but attention is exact only for calls of at least ``tile_rows`` query rows,
    which no rows-alone call reaches: every attention call must be a whole tile."""
    return Primitives(f"quirk:rows-alone-never-{tile_rows}", exact_linear, quirky_attention(lambda r: r >= tile_rows))


def hopeless() -> Primitives:
    """A GEMM whose rows depend on the other rows' content at every M: no plan can be exact."""
    def linear(x: torch.Tensor, w: torch.Tensor, form: Form) -> torch.Tensor:
        y = exact_linear(x, w, form)
        return _nudge(y, 1.0 + (x.abs().sum() * 997.0).remainder(1.0))

    return Primitives("quirk:hopeless", linear, exact_attention)


QUIRKS: dict[str, Callable[[], Primitives]] = {"xeon-like": xeon_like, "amd-like": amd_like, "only-m64": only_one_m}
