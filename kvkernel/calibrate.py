"""Calibration: find the cheapest :class:`~kvkernel.plan.Plan` that is exact on this machine.

Why: which GEMM and attention call shapes give a row the same bits differs per CPU, BLAS build,
thread count and device, so constants tuned on one machine refuse to start (or worse) on another.
Calibration measures it instead. A plan is accepted only if

1. every (M, operand form) it can call each of the model's linear shapes with gives every row the
   bits that row gets in the reference call (M = ``big_max``, or the fixed M of a fallback plan),
   wherever the row sits in the block and whatever the other rows hold;
2. rows attending alone (every row count the plan can produce) equal the same rows attended in a
   whole tile, at several key lengths;
3. a sequence prefilled at once equals the same sequence in pieces and token by token, on the
   real model, K, V and final hidden state bit for bit.

Candidates are tried cheapest first, and the list always ends with fallbacks that need no luck
with M: every linear call at one fixed M (padded) and every attention call a whole tile. Only if
those fail too does :func:`calibrate` raise :class:`~kvkernel.errors.ExactnessError`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import chain, islice
from pathlib import Path
from threading import Lock
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
import torch
from tqdm import tqdm

from kvkernel.errors import ExactnessError
from kvkernel.forward import Transformer, pin_threads
from kvkernel import plan_cache
from kvkernel.plan import PROJECTIONS, Form, Plan

Call = tuple[int, Form]  # (M, operand form) of one GEMM call

log = structlog.get_logger(__name__)

# Small-block grids as (min rows, row granularity), cheapest first: decode pays the first number.
SMALL_GRIDS = ((1, 1), (2, 1), (2, 2), (4, 4), (8, 8), (16, 16))
FORMS: tuple[Form, ...] = ("linear", "wxt")
PIECE_SIZES = (96, 64, 48, 32)
FALLBACK_MS = (16, 32, 64, 128, 256, 512)
ROW_OFFSETS = (0, 5)  # a row is checked at its own index and 5 rows further up the block
ADVICE = ("unset MKL_CBWR, ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS and MKL_DEBUG_CPU_TYPE, "
          "try LETHE_KERNEL_THREADS=1, use the pinned torch build, and on CUDA use float32")


@dataclass
class Calibration:
    """The accepted plan, what was tried on the way (first failure of each), and the time it took."""

    plan: Plan
    seconds: float
    rejected: list[dict[str, str]] = field(default_factory=list)
    source: str = "calibrated"  # or "cache" (re-verified) or "forced" (verified)
    path: str | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "plan_sha256": self.plan.sha256, "source": self.source,
                "seconds": round(self.seconds, 2), "rejected": self.rejected, "path": self.path,
                "fingerprint": self.fingerprint, "fingerprint_sha256": plan_cache.fingerprint_sha256(self.fingerprint)}


class Checks:
    """Memoised row-bit checks of one transformer's shapes, shared by every candidate plan.

    Layer 0 stands for every layer: all layers share shapes, and the bits depend on the shapes
    and on each row's own values, which is exactly what is being checked.
    """

    def __init__(self, tf: Transformer) -> None:
        self.tf = tf
        gen = torch.Generator(device="cpu").manual_seed(1234)
        layer = tf.layers[0]
        self.weights = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}
        rows = max(FALLBACK_MS + (tf.plan.big_max,)) + max(ROW_OFFSETS)
        self.inputs = {n: torch.randn(rows, w.shape[1], generator=gen).to(tf.device, tf.dtype) for n, w in self.weights.items()}
        self._refs: dict[tuple[str, Call], torch.Tensor] = {}
        self._linear: dict[tuple[str, Call, Call], bool] = {}
        self._attention: dict[tuple[int, int, int], bool] = {}
        self._attention_inputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def linear(self, projection: str, call: Call, ref: Call) -> bool:
        """Do rows of a ``call`` (M, form) equal the same rows of the ``ref`` call's result?"""
        key = (projection, call, ref)
        if key not in self._linear:
            self._linear[key] = self._linear_matches(projection, call, ref)
        return self._linear[key]

    def _linear_matches(self, projection: str, call: Call, reference: Call) -> bool:
        x, w = self.inputs[projection], self.weights[projection]
        (m, form), (ref_m, ref_form) = call, reference
        linear = self.tf.primitives.linear
        if (projection, reference) not in self._refs:
            self._refs[projection, reference] = linear(x[:ref_m], w, ref_form)
        ref = self._refs[projection, reference]
        for off in ROW_OFFSETS:
            overlap = min(ref_m, off + m) - off
            if overlap > 0 and not torch.equal(linear(x[off : off + m], w, form)[:overlap], ref[off : off + overlap]):
                return False
        return True

    def attention(self, n: int, rows: int, length: int) -> bool:
        """Do ``n`` positions attending alone in a call of ``rows`` query rows (per KV head, pad
        rows included) equal the same positions attended in a whole tile at key length ``length``?"""
        key = (n, rows, length)
        if key not in self._attention:
            self._attention[key] = self._attention_matches(n, rows, length)
        return self._attention[key]

    def _attention_matches(self, n: int, rows: int, length: int) -> bool:
        tf = self.tf
        t = tf.tile
        keys, values, q, whole = self._attention_case(length)
        base = length - t
        alone = tf.with_plan(replace(tf.plan, attention_min_rows=rows, attention_max_rows=rows))
        for off in sorted({0, (t - n) // 2, t - n}):
            got = alone._attention_for(base + off, n)(keys, values, q[off : off + n])
            if not torch.equal(got, whole[off : off + n]):
                return False
        return True

    def _attention_case(self, length: int) -> tuple[torch.Tensor, ...]:
        if length not in self._attention_inputs:
            tf = self.tf
            s, t = tf.shape, tf.tile
            gen = torch.Generator(device="cpu").manual_seed(4321 + length)
            keys, values = (torch.randn(s.kv_heads, length, s.head_dim, generator=gen).to(tf.device, tf.dtype) for _ in range(2))
            q = torch.randn(t, s.heads, s.head_dim, generator=gen).to(tf.device, tf.dtype)
            base = length - t
            whole = tf._attend_tiles(keys, values, q, start=base, plan=tf._attention_plan(base, t))
            self._attention_inputs[length] = (keys, values, q, whole)
        return self._attention_inputs[length]

    def attention_lengths(self) -> list[int]:
        """A key length below flash attention's 512-key split, one above, and a long one."""
        tf = self.tf
        limit = tf.key_length(tf.cos.shape[0])
        return sorted({min(limit, tf.key_length(n)) for n in (tf.tile, 513, 2048)})


def reference(plan: Plan) -> Call:
    """The call whose row bits every call of ``plan`` must reproduce: its biggest block."""
    return (plan.fixed_m, plan.small_form) if plan.fixed_m is not None else (plan.big_max, "linear")


def linear_failures(checks: Checks, plan: Plan, *, quick: bool = False) -> Iterator[str]:
    """Each (projection, M, form) of ``plan`` whose rows differ from the reference call's, lazily."""
    ref = reference(plan)
    bulk = [m for m in plan.sizes() if m > plan.mid_max]
    skip = set(bulk[1:-2]) if quick else set()
    return (f"{p}: M={m} ({form}) rows differ from M={ref[0]} ({ref[1]})"
            for p in PROJECTIONS for m, form in plan.calls(p) if m not in skip and not checks.linear(p, (m, form), ref))


def attention_failures(checks: Checks, plan: Plan) -> Iterator[str]:
    """Each rows-alone call size of ``plan`` that differs from a whole tile (none if tiles only)."""
    if plan.attention_min_rows is None:
        return iter(())
    tf = checks.tf
    groups = tf.shape.heads // tf.shape.kv_heads
    calls = [(n, max(plan.attention_min_rows, groups * n)) for n in range(1, min(tf.tile, plan.attention_max_rows // groups) + 1)]
    return (f"attention: {n} position(s) alone in {r} query rows at key length {length} differ from a whole tile"
            for length in checks.attention_lengths() for n, r in calls if not checks.attention(n, r, length))


def sequence_failures(tf: Transformer) -> list[str]:
    """A sequence prefilled at once (a bulk block) equals it in pieces (small and mid blocks) and fed token
    by token (at the start and across a tile boundary), K, V and final hidden states bit for bit.

    Single tokens are few on purpose: each is a full pass through every layer, and on a loaded
    machine those many small calls dominate the calibration time.
    """
    gen = torch.Generator().manual_seed(7)
    t = tf.tile
    tokens = torch.randint(0, tf.shape.vocab, (tf.plan.big_min + t,), generator=gen).tolist()
    kv, hidden = _prefill(tf, [tokens])
    failures = []
    if not _same((kv[:, :, :, :120], hidden[:120]), _prefill(tf, [tokens[:3], tokens[3:20], tokens[20:120]])):
        failures.append(f"a sequence prefilled at once ({len(tokens)} rows, one bulk block) differs from its first "
                        "120 tokens in pieces of 3, 17 and 100")
    short = 2 * t + 8
    singles = [[x] for x in tokens[:4]] + [tokens[4 : t - 2]] + [[x] for x in tokens[t - 2 : t + 2]] + [tokens[t + 2 : short]]
    if not _same((kv[:, :, :, :short], hidden[:short]), _prefill(tf, singles)):
        failures.append(f"the first {short} tokens prefilled at once differ from the same tokens fed one by one "
                        f"(positions 0-3 and {t - 2}-{t + 1})")
    return failures


def _prefill(tf: Transformer, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows and final hidden states of ``chunks`` fed one after another into a fresh cache."""
    total = sum(len(c) for c in chunks)
    s = tf.shape
    kv = torch.zeros(3, s.layers, s.kv_heads, tf.key_length(total + tf.tile), s.head_dim, device=tf.device, dtype=tf.dtype)
    hidden, at = [], 0
    for chunk in chunks:
        hidden.append(tf.forward(kv, chunk, at))
        at += len(chunk)
    return kv[:, :, :, :total], torch.cat(hidden)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def verify(checks: Checks, plan: Plan, *, quick: bool = False, limit: int = 1) -> list[str]:
    """Up to ``limit`` reasons ``plan`` is not exact here (empty when it is); cheap checks first.

    ``quick`` (re-verifying a cached plan) checks every linear call of at most ``mid_max`` rows
    but only the smallest and the two largest bulk blocks, which is where most of the time goes.
    """
    failures = list(islice(chain(linear_failures(checks, plan, quick=quick), attention_failures(checks, plan)), limit))
    return failures or sequence_failures(checks.tf.with_plan(plan))


def candidates(checks: Checks) -> Iterator[Plan]:
    """Plans to try, cheapest first; every one of them is verified in full before acceptance."""
    attention = _attention_min_rows(checks)
    for (small_min, step), form in ((g, f) for g in SMALL_GRIDS for f in FORMS):
        plan = Plan(f"{form}-min{small_min}-step{step}", small_form=form, small_min=small_min, small_step=step)
        plan = _with_pieces(checks, plan) or plan
        if attention is not None:
            yield replace(plan, attention_min_rows=attention)
        if attention is None or next(linear_failures(checks, plan), None) is None:
            yield replace(plan, attention_min_rows=None)  # in case rows alone pass alone but not in a model
    for m in FALLBACK_MS:
        for form in FORMS:
            yield Plan(f"fallback-m{m}-{form}", small_form=form, fixed_m=m, attention_min_rows=None)


def _attention_min_rows(checks: Checks) -> int | None:
    """The fewest query rows from which every rows-alone call size matches a whole tile."""
    plan = checks.tf.plan
    for n in range(1, plan.attention_max_rows + 1):
        if next(attention_failures(checks, replace(plan, attention_min_rows=n)), None) is None:
            return n
    return None


def _with_pieces(checks: Checks, plan: Plan) -> Plan | None:
    """``plan`` with pieces for each projection whose blocks fail, or None if no piece size helps."""
    pieces = []
    for p in PROJECTIONS:
        ref = reference(plan)
        if all(checks.linear(p, call, ref) for call in plan.calls(p)):
            continue
        ok = next((size for size in PIECE_SIZES
                   if all(checks.linear(p, call, ref) for call in replace(plan, pieces=((p, size),)).calls(p))), None)
        if ok is None:
            return None
        pieces.append((p, ok))
    return replace(plan, pieces=tuple(pieces), name=plan.name + "".join(f"-{p}{s}" for p, s in pieces))


def calibrate(tf: Transformer, *, progress: bool | None = None) -> Calibration:
    """Search the candidates cheapest first and return the first exact plan; refuse if none is."""
    pin_threads(tf.threads)
    t0 = time.perf_counter()
    checks = Checks(tf)
    rejected: list[dict[str, str]] = []
    with tqdm(desc="kvkernel calibration", unit="plan", disable=None if progress is None else not progress, leave=False) as bar:
        for plan in candidates(checks):
            bar.set_postfix_str(plan.name)
            failures = verify(checks, plan)
            bar.update()
            if not failures:
                return Calibration(plan, time.perf_counter() - t0, rejected)
            rejected.append({"plan": plan.name, "failure": failures[0]})
    raise ExactnessError(
        "no canonical plan is exact in this environment, not even the fixed-M, whole-tile fallback ("
        + "; ".join(f"{r['plan']}: {r['failure']}" for r in rejected) + f"); {ADVICE}")


_CHOSEN: dict[tuple[str, ...], Calibration] = {}
_CHOSEN_LOCK = Lock()


def select_plan(tf: Transformer, *, forced: Plan | None = None, plan_dir: Path | None = None,
                progress: bool | None = None) -> Calibration:
    """:func:`choose_plan`, once per process and fingerprint: every kernel on the same shapes shares it."""
    pin_threads(tf.threads)
    fp = plan_cache.fingerprint(tf)
    key = (plan_cache.fingerprint_sha256(fp), forced.sha256 if forced else "", tf.model_identity)
    with _CHOSEN_LOCK:
        if key not in _CHOSEN:
            _CHOSEN[key] = choose_plan(tf, forced=forced, plan_dir=plan_dir, progress=progress)
        return _CHOSEN[key]


def choose_plan(tf: Transformer, *, forced: Plan | None = None, plan_dir: Path | None = None,
                progress: bool | None = None) -> Calibration:
    """``forced`` once verified; else the cached plan once re-verified; else a fresh calibration, cached.

    The cache lives under ``plan_dir`` (default :func:`~kvkernel.plan_cache.default_plan_dir`).
    """
    pin_threads(tf.threads)
    fp = plan_cache.fingerprint(tf)
    path = plan_cache.cache_path(plan_dir or plan_cache.default_plan_dir(), fp)
    cal = _verified(tf, forced) if forced else _cached(tf, path, fp) or _calibrated(tf, path, fp, progress)
    cal.fingerprint = fp
    log.info("kvkernel.plan", plan=cal.plan.name, plan_sha256=cal.plan.sha256[:16], source=cal.source,
             seconds=round(cal.seconds, 2), rejected=len(cal.rejected), path=cal.path, **cal.plan.to_dict())
    return cal


def _verified(tf: Transformer, plan: Plan) -> Calibration:
    t0 = time.perf_counter()
    failures = verify(Checks(tf.with_plan(plan)), plan, limit=5)
    if failures:
        raise ExactnessError(f"the forced plan {plan.name!r} is not exact in this environment ({'; '.join(failures[:5])}); "
                             f"let the kernel calibrate one (no forced plan), or {ADVICE}")
    return Calibration(plan, time.perf_counter() - t0, source="forced")


def _cached(tf: Transformer, path: Path, fp: dict[str, Any]) -> Calibration | None:
    """The cached plan if it still passes a quick re-verification here, else None (logged)."""
    plan = plan_cache.load(path, fp)
    if plan is None:
        return None
    t0 = time.perf_counter()
    failures = verify(Checks(tf.with_plan(plan)), plan, quick=True)
    if failures:
        log.warning("kvkernel.plan_cache.stale", path=str(path), reason=failures[0])
        return None
    return Calibration(plan, time.perf_counter() - t0, source="cache", path=str(path))


def _calibrated(tf: Transformer, path: Path, fp: dict[str, Any], progress: bool | None) -> Calibration:
    cal = calibrate(tf, progress=progress)
    plan_cache.store(path, fp, cal.plan, cal.seconds)
    cal.path = str(path)
    return cal
