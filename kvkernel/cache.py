"""The kernel and its KV cache: exact forget, Leyline amortize, stage/rollback, never-saw witnesses.

A :class:`KVCache` is a plain data structure: per layer, rotated keys, values and pre-RoPE keys
in one growable buffer, plus the token ids and the next-token logits. Rows at and beyond the
length are always zero, so freed rows are zeroed by construction and masked rows are finite.

Every operation is atomic: arguments are validated before anything changes, and the rows an
operation may overwrite are saved first and restored if it fails half-way.

Exactness is structural (see :mod:`kvkernel.forward`): the K, V and logits at position p are a
pure function of ``tokens[0..p]`` on this environment, which :class:`Kernel` self-tests at
start-up. Forget truncates at the first span and re-prefills the survivors, so its result *is* a
prefill of the survivors and equals a fresh one bit for bit; the witness checks it.

Which call shapes are canonical is chosen per machine (:mod:`kvkernel.calibrate`): the
:class:`Kernel` picks the cheapest plan that passes every check here, caches it under the data
dir keyed by an environment fingerprint, re-verifies a cached plan at every start, and records the
plan's hash in every witness. CUDA selects its plan the same way, calibrating on the device with
TF32 off in float32; that path has not been run on a GPU yet (none was available). Not covered on
CUDA even then: bit equality across GPU models, drivers or library versions (the fingerprint
names the GPU and CUDA version, so a new one recalibrates).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from kvkernel.calibrate import Calibration, select_plan
from kvkernel.errors import KernelError, SpanError, StateError
from kvkernel.forward import Transformer, rope_table
from kvkernel.model import Model
from kvkernel.plan import TORCH, Plan, Primitives
from kvkernel.witness import AmortizeWitness, ForgetWitness, divergence, tokens_sha256

log = structlog.get_logger(__name__)

# Part of every witness: bump it whenever the canonical computation (and so the bits) changes.
# 1.1: decode at M = 2 in the (W x^T)^T form, few-row attention, logits one row at a time.
# 1.2: call shapes from a plan calibrated per machine (the plan's hash is in the provenance).
KERNEL_VERSION = "kvkernel/1.2 calibrated-plan"
_INITIAL_CAPACITY = 256
_WITNESS_MODES = ("full", "deferred", "none")


@dataclass
class GenerationConfig:
    """Decoding settings: greedy when ``temperature == 0``, else seeded temperature/top-p."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()


@dataclass
class ForgetResult:
    """``witness`` in full mode; ``pending`` resolves to the witness in deferred mode."""

    witness: ForgetWitness | None
    pending: concurrent.futures.Future[ForgetWitness] | None = None
    removed: int = 0
    recomputed: int = 0


@dataclass
class AmortizeResult:
    """A Leyline splice's witness (None only if skipped). NOT erasure; see :class:`AmortizeWitness`."""

    witness: AmortizeWitness | None


@dataclass
class MemoryReport:
    """Cache memory: per token = 2 x layers x kv_heads x head_dim x bytes (K, V) + raw keys."""

    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    kv_bytes_per_token: int
    raw_key_bytes_per_token: int
    bytes_per_token: int
    total_bytes: int
    capacity_tokens: int
    allocated_bytes: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Kernel:
    """One model's canonical forward plus a worker for deferred witnesses. Create caches here."""

    version = KERNEL_VERSION

    def __init__(self, model: Model, *, tile: int = 16, plan: Plan | None = None, primitives: Primitives = TORCH,
                 plan_dir: Path | None = None) -> None:
        """Load ``model`` and choose its canonical plan: calibrated here (or cached under
        ``plan_dir``, default ``$LETHE_DATA_DIR/kernel-plans``), or ``plan`` if forced.

        Either way the plan is verified on this machine before the kernel accepts any token;
        :class:`~kvkernel.errors.ExactnessError` if it (or, calibrating, every candidate) is not exact.
        ``primitives`` replaces the GEMM and attention calls (tests inject quirky ones).
        """
        self.model = model
        self.tile = tile
        probe = Transformer(model, tile, plan or Plan("uncalibrated"), primitives)
        self.calibration: Calibration = select_plan(probe, forced=plan, plan_dir=plan_dir)
        self.transformer = Transformer(model, tile, self.calibration.plan, primitives)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvkernel-witness")

    @property
    def plan(self) -> Plan:
        return self.calibration.plan

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty cache with room for ``capacity`` rows; 0 allocates nothing until the first use
        (a gateway that reserves exact room per turn holds no idle buffer)."""
        return KVCache(self, capacity)

    def provenance(self) -> dict[str, Any]:
        """The model, device, dtype, kernel version, tile and plan hash every witness records."""
        return {"model_identity": self.model.identity, "device": str(self.model.device),
                "dtype": str(self.model.dtype).removeprefix("torch."), "kernel_version": self.version, "tile": self.tile,
                "plan_sha256": self.plan.sha256}

    def close(self) -> None:
        """Wait for pending deferred witnesses and stop the worker."""
        self._executor.shutdown(wait=True)

    def cache_bytes(self, tokens: int) -> int:
        """Bytes of a cache sized exactly for ``tokens`` (rows rounded up to the key bucket), with
        its logits: what a witness's reference, a copy or a rollback copy of that many rows holds."""
        return self.new_cache(0).bytes_for(tokens)

    def prefill(self, tokens: Sequence[int], *, room: int = 0) -> KVCache:
        """A fresh cache holding ``tokens``: the never-saw reference of a witness. Its buffer is
        sized exactly first (no doubling growth, no old-and-new pair while it grows), so a witness
        holds one buffer of the survivors' rows beside the cache it checks: what a memory budget
        counts for it. ``room``: tokens the caller will append after (a probe), reserved too."""
        cache = self.new_cache(0)
        if tokens:
            cache.reserve(len(tokens) + room)
            cache.extend(tokens)
        return cache


class KVCache:
    """An exact, editable KV cache. NOT thread-safe: callers serialise access per cache."""

    def __init__(self, kernel: Kernel, capacity: int = _INITIAL_CAPACITY) -> None:
        s = kernel.transformer.shape
        self._kernel = kernel
        self._tf = kernel.transformer
        self._kv = torch.zeros(3, s.layers, s.kv_heads, capacity, s.head_dim, device=kernel.model.device, dtype=kernel.model.dtype)
        self._tokens: list[int] = []
        self._logits: torch.Tensor | None = None
        self._staged: tuple[int, torch.Tensor | None] | None = None
        self._capture: dict[int, list[torch.Tensor]] | None = None  # set only inside stage_with_states

    # -- views ---------------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def logits(self) -> torch.Tensor | None:
        """Next-token logits (float32 ``[vocab]``) after the last token; None when empty."""
        return None if self._logits is None else self._logits.clone()

    @property
    def staged(self) -> bool:
        return self._staged is not None

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of one layer's rotated K, V and raw K, each ``[kv_heads, len, head_dim]``."""
        n = len(self)
        return tuple(self._kv[i, layer, :, :n].clone() for i in range(3))  # type: ignore[return-value]

    def digest(self) -> str:
        """sha256 over every layer's K (rotated) and V for all positions, then the logits."""
        h = hashlib.sha256()
        n = len(self)
        for layer in range(self._kv.shape[1]):
            for i in (0, 1):
                h.update(_bytes(self._kv[i, layer, :, :n]))
        if self._logits is not None:
            h.update(_bytes(self._logits))
        return h.hexdigest()

    def memory(self) -> MemoryReport:
        s = self._tf.shape
        elem = self._kv.element_size()
        kv = 2 * s.layers * s.kv_heads * s.head_dim * elem
        raw = s.layers * s.kv_heads * s.head_dim * elem
        return MemoryReport(
            tokens=len(self),
            layers=s.layers,
            kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            dtype_bytes=elem,
            kv_bytes_per_token=kv,
            raw_key_bytes_per_token=raw,
            bytes_per_token=kv + raw,
            total_bytes=(kv + raw) * len(self),
            capacity_tokens=self._kv.shape[3],
            allocated_bytes=self._kv.numel() * elem,
        )

    @property
    def capacity(self) -> int:
        """Rows the buffer has room for (at least the length)."""
        return int(self._kv.shape[3])

    @property
    def nbytes(self) -> int:
        """Bytes of tensor memory this cache holds now: the K/V/raw-K buffer at its capacity, the
        logits and a pending stage's saved logits. What a memory budget must count."""
        held = self._kv.numel() * self._kv.element_size()
        held += 0 if self._logits is None else self._logits.numel() * self._logits.element_size()
        saved = self._staged[1] if self._staged is not None else None
        return held + (0 if saved is None else saved.numel() * saved.element_size())

    def bytes_for(self, tokens: int) -> int:
        """The most :attr:`nbytes` can reach while holding ``tokens`` after :meth:`reserve`: the
        buffer at the capacity ``tokens`` needs, plus logits and a stage's saved logits."""
        s = self._tf.shape
        rows = max(self._tf.key_length(tokens), self._kv.shape[3]) if tokens else self._kv.shape[3]
        return 3 * s.layers * s.kv_heads * rows * s.head_dim * self._kv.element_size() + 2 * s.vocab * 4

    def reserve(self, tokens: int) -> None:
        """Grow the buffer now to exactly the rows ``tokens`` tokens need, so that appends up to
        that length never reallocate (the doubling growth of :meth:`_ensure` over-allocates by up
        to 2x, which a budget would have to count as held)."""
        if tokens > 0:
            self._resize(max(self._tf.key_length(tokens), self._kv.shape[3]))

    def fit(self) -> None:
        """Shrink the buffer to the rows the current tokens need; the old buffer is zeroed first."""
        self._no_stage("fit")
        self._resize(self._tf.key_length(len(self)) if len(self) else 0)

    def wipe(self) -> None:
        """Zero every row and the logits and hold nothing: what an evicted or ended session's
        memory becomes before it is released, so freed pages never carry K/V bytes."""
        with torch.inference_mode():  # logits are inference tensors: zeroed in that mode
            self._kv.zero_()
            for held in (self._logits, self._staged[1] if self._staged is not None else None):
                if held is not None:
                    held.zero_()
        self._kv = self._kv.new_zeros(*self._kv.shape[:3], 0, self._kv.shape[4])
        self._tokens, self._logits, self._staged = [], None, None

    def export_planes(self) -> Iterator[torch.Tensor]:
        """Rows ``[:len]`` of every plane (rotated K, V, raw K) of every layer, one at a time
        (``[kv_heads, len, head_dim]``, a fresh copy each, plane-major): with the tokens and the
        logits, everything :meth:`from_planes` needs. What an offload streams, so that no second
        copy of the whole cache exists at once; the caller zeroes each copy when done."""
        self._no_stage("export_planes")
        n = len(self)
        for plane in range(3):
            for layer in range(self._kv.shape[1]):
                yield self._kv[plane, layer, :, :n].clone(memory_format=torch.contiguous_format)

    @classmethod
    def from_planes(cls, kernel: Kernel, tokens: Sequence[int], planes: Iterable[torch.Tensor],
                    logits: torch.Tensor | None) -> KVCache:
        """The cache :meth:`export_planes` described, fed one plane at a time in its order (a
        restore reads each from its copy into the new buffer, never holding a second whole copy).
        Shapes are checked, bits are the caller's to verify (compare :meth:`digest` with the one
        recorded at export); on a mismatch the partly filled buffer is wiped before KernelError."""
        s = kernel.transformer.shape
        n = len(tokens)
        if (logits is None) != (n == 0) or (logits is not None and tuple(logits.shape) != (s.vocab,)):
            raise KernelError("logits must be given exactly when there are tokens, shaped [vocab]")
        cache = cls(kernel, kernel.transformer.key_length(n) if n else 0)
        try:
            cache._tokens = cache._check_tokens(tokens, extra=n)
            given = iter(planes)
            for plane in range(3):
                for layer in range(s.layers):
                    rows = next(given, None)
                    if rows is None or tuple(rows.shape) != (s.kv_heads, n, s.head_dim) or rows.dtype != kernel.model.dtype:
                        raise KernelError(f"plane {plane} of layer {layer} does not fit this kernel: expected "
                                          f"{(s.kv_heads, n, s.head_dim)} {kernel.model.dtype}")
                    cache._kv[plane, layer, :, :n] = rows.to(cache._kv.device)
            if next(given, None) is not None:
                raise KernelError(f"more planes than 3 x {s.layers} layers")
        except BaseException:
            cache.wipe()
            raise
        cache._logits = None if logits is None else logits.to(torch.float32).to(cache._kv.device).clone()
        return cache

    def clone(self) -> KVCache:
        """An independent deep copy (same kernel), its buffer sized exactly for its tokens: a
        copy (a deferred witness's, a probe's) holds no spare capacity a budget would have to count."""
        other = KVCache.__new__(KVCache)
        other._kernel, other._tf = self._kernel, self._tf
        other._kv = self._kv[:, :, :, : self._tf.key_length(len(self)) if len(self) else 0].clone()
        other._tokens = list(self._tokens)
        other._capture = None
        other._logits = None if self._logits is None else self._logits.clone()
        other._staged = None if self._staged is None else (self._staged[0], None if self._staged[1] is None else self._staged[1].clone())
        return other

    # -- append --------------------------------------------------------------------------------

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Prefill ``tokens`` after the current ones; returns the next-token logits."""
        tokens = self._check_tokens(tokens, extra=len(tokens))
        if not tokens:
            raise KernelError("extend() needs at least one token")
        with self._atomic(len(self)):
            self._append(tokens)
        assert self._logits is not None
        return self._logits.clone()

    def generate(self, cfg: GenerationConfig) -> Generator[int, None, None]:
        """Stream up to ``cfg.max_new_tokens`` token ids, appending each to the cache first.

        Stops after an EOS token or once the generated text contains a stop string. The EOS or
        stop-string tokens are yielded and stay in the cache (truncate them if unwanted).
        """
        _check_generation(cfg)
        if self._logits is None:
            raise StateError("the cache is empty; extend() it with a prompt before generate()")
        gen = torch.Generator(device="cpu")
        if cfg.seed is None:
            gen.seed()
        else:
            gen.manual_seed(cfg.seed)
        eos = set(self._kernel.model.eos_token_ids)
        tokenizer = self._kernel.model.tokenizer
        produced: list[int] = []
        for _ in range(cfg.max_new_tokens):
            if len(self) >= self._kernel.model.max_context:
                return
            token = _sample(self._logits, cfg, gen)
            with self._atomic(len(self)):
                self._append([token])
            produced.append(token)
            yield token
            if token in eos:
                return
            if cfg.stop and any(s in tokenizer.decode(produced) for s in cfg.stop):
                return

    # -- edits ---------------------------------------------------------------------------------

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens; freed rows are zeroed and the logits recomputed."""
        self._no_stage("truncate")
        if not 0 <= n <= len(self):
            raise SpanError(f"truncate({n}) is out of range for a cache of {len(self)} tokens")
        if n == len(self):
            return
        with self._atomic(max(n - 1, 0)):
            self._replace_tail(n, [])

    def forget(self, spans: Sequence[tuple[int, int]], *, witness: str = "full", rollback: bool = True) -> ForgetResult:
        """Exactly erase ``spans`` (half-open, pre-edit coordinates), all or nothing.

        Truncates at the first span and re-prefills the survivors at their new positions, so the
        result equals a cache that never saw the spans. ``witness``: ``"full"`` builds the
        never-saw reference now, ``"deferred"`` on the background worker, ``"none"`` skips it.
        ``rollback=False`` keeps no copy of the rows it recomputes: if the recompute fails, the
        cache is wiped (every row zeroed, nothing held) instead of restored, which is what an
        erasure wants anyway (a failed forget must not leave the span in memory) and holds one
        cache-sized buffer less (a memory budget counts it).
        """
        self._no_stage("forget")
        if witness not in _WITNESS_MODES:
            raise KernelError(f"witness must be one of {_WITNESS_MODES}, got {witness!r}")
        spans = _check_spans(spans, len(self))
        doomed = {i for a, b in spans for i in range(a, b)}
        survivors = [t for i, t in enumerate(self._tokens) if i not in doomed]
        first = spans[0][0]
        with self._atomic(max(first - 1, 0)) if rollback else self._wiped_on_failure():
            self._replace_tail(first, survivors[first:])
        result = ForgetResult(witness=None, removed=len(doomed), recomputed=len(survivors) - first)
        if witness == "full":
            result.witness = forget_witness(self._kernel, self, spans)
        elif witness == "deferred":
            result.pending = self._kernel._executor.submit(forget_witness, self._kernel, self.clone(), spans)
        log.info("kvkernel.forget", spans=spans, removed=result.removed, recomputed=result.recomputed, witness=witness)
        return result

    def amortize(self, span: tuple[int, int], replacement: Sequence[int], *, witness: str = "full", probe_tokens: int = 8) -> AmortizeResult:
        """Leyline splice: replace ``span`` by ``replacement`` without recomputing later tokens.

        The span's rows are dropped, the replacement is prefilled at the span's position, and the
        downstream keys are re-rotated to their new positions from their pre-RoPE keys (one
        rotation, never chained); values are untouched. This is NOT erasure: downstream K/V and
        the next-token logits were computed while the span was present and keep its influence.
        The witness measures that drift against a fresh prefill of the edited tokens; pass
        ``witness="none"`` to skip it (then ``AmortizeResult.witness`` is None).
        """
        self._no_stage("amortize")
        if witness not in ("full", "none"):
            raise KernelError(f"amortize witness must be 'full' or 'none', got {witness!r}")
        ((a, b),) = _check_spans([span], len(self))
        replacement = self._check_tokens(replacement, extra=len(replacement) - (b - a))
        downstream = self._tokens[b:]
        start = a + len(replacement)
        with self._atomic(max(a - 1, 0)):
            if not downstream:
                self._replace_tail(a, replacement)
            else:
                raw = self._kv[2, :, :, b : len(self)].clone()
                values = self._kv[1, :, :, b : len(self)].clone()
                stale_logits = self._logits
                self._rewind(a)
                if replacement:
                    self._append(replacement)
                self._place(start, raw, values)
                self._tokens.extend(downstream)
                self._logits = stale_logits
        log.info("kvkernel.amortize", span=[a, b], replacement=len(replacement), downstream=len(downstream))
        if witness == "none":
            return AmortizeResult(witness=None)
        return AmortizeResult(witness=self._amortize_witness((a, b), len(replacement), start, len(downstream), probe_tokens))

    # -- staging -------------------------------------------------------------------------------

    def stage(self, tokens: Sequence[int]) -> torch.Tensor:
        """Tentatively append ``tokens`` (e.g. a tool result) until commit() or rollback()."""
        self._no_stage("stage")
        before = (len(self), self.logits)
        logits = self.extend(tokens)
        self._staged = before
        return logits

    def stage_with_states(self, tokens: Sequence[int], layers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """stage(), also returning the staged rows' residual states after each of ``layers``.

        The gateway's injection probe reads what the model makes of a tool result while it is
        still only staged; the K/V written are the same bytes as a plain stage()."""
        bad = [layer for layer in layers if not 0 <= layer < self._kv.shape[1]]
        if bad:
            raise KernelError(f"layers {bad} out of range for a {self._kv.shape[1]}-layer model")
        capture: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self._capture = capture
        try:
            logits = self.stage(tokens)
        finally:
            self._capture = None
        return logits, {layer: torch.cat(parts) for layer, parts in capture.items()}

    def commit(self) -> None:
        """Keep the staged tokens."""
        if self._staged is None:
            raise StateError("commit() without a pending stage(); call stage(tokens) first")
        self._staged = None

    def rollback(self) -> None:
        """Drop the staged tokens: the cache returns to the exact bytes it had before stage()."""
        if self._staged is None:
            raise StateError("rollback() without a pending stage(); call stage(tokens) first")
        n, logits = self._staged
        self._rewind(n)
        self._logits = logits
        self._staged = None

    # -- internals -----------------------------------------------------------------------------

    def _append(self, tokens: Sequence[int]) -> None:
        start = len(self)
        self._ensure(start + len(tokens))
        hidden = self._tf.forward(self._kv, tokens, start, self._capture)
        self._tokens.extend(tokens)
        self._logits = self._tf.logits(hidden[-1:])[0]

    def _rewind(self, n: int) -> None:
        """Drop rows from ``n`` on, zeroing them; the logits become undefined until an append."""
        self._kv[:, :, :, n : len(self)] = 0
        del self._tokens[n:]
        self._logits = None

    def _replace_tail(self, n: int, tail: Sequence[int]) -> None:
        """Keep ``tokens[:n]``, then prefill ``tail``; with no tail, recompute token n-1's logits.

        Recomputing the last kept token rewrites its K/V with identical bits (a row depends only
        on its prefix), which is how the next-token logits are recovered without storing them.
        """
        tail = list(tail)
        if not tail and n > 0:
            n, tail = n - 1, [self._tokens[n - 1]]
        self._rewind(n)
        if tail:
            self._append(tail)

    def _place(self, start: int, raw: torch.Tensor, values: torch.Tensor) -> None:
        """Write downstream rows at ``start``: raw keys and values as they were, keys rotated once."""
        count = raw.shape[2]
        self._ensure(start + count)
        positions = torch.arange(start, start + count, device=raw.device)
        self._kv[2, :, :, start : start + count] = raw
        self._kv[1, :, :, start : start + count] = values
        self._kv[0, :, :, start : start + count] = self._tf.rope(raw, positions)

    def _ensure(self, n: int) -> None:
        """Grow the buffer so that the attention keys of a tile ending past ``n`` exist (masked)."""
        need = self._tf.key_length(n)
        cap = self._kv.shape[3]
        if need <= cap:
            return
        self._resize(max(need, 2 * cap))

    def _resize(self, rows: int) -> None:
        """Move the buffer to one of ``rows`` rows (at least the current length); the old buffer is
        zeroed before it is released, so no freed page keeps K/V bytes."""
        if rows == self._kv.shape[3]:
            return
        resized = self._kv.new_zeros(*self._kv.shape[:3], rows, self._kv.shape[4])
        resized[:, :, :, : len(self)] = self._kv[:, :, :, : len(self)]
        self._kv.zero_()
        self._kv = resized

    @contextmanager
    def _atomic(self, start: int) -> Iterator[None]:
        """Restore rows ``[start, len)``, tokens and logits if the body raises."""
        saved_rows = self._kv[:, :, :, start : len(self)].clone()
        saved_tokens = list(self._tokens)
        saved_logits = self._logits
        try:
            yield
        except BaseException:
            self._kv[:, :, :, start:] = 0
            self._kv[:, :, :, start : start + saved_rows.shape[3]] = saved_rows
            self._tokens = saved_tokens
            self._logits = saved_logits
            raise
        finally:
            saved_rows.zero_()  # a released copy never keeps K/V bytes (erased rows included)

    @contextmanager
    def _wiped_on_failure(self) -> Iterator[None]:
        """Wipe the cache if the body raises: what it holds is then neither the old nor the new state."""
        try:
            yield
        except BaseException:
            self.wipe()
            raise

    def _no_stage(self, op: str) -> None:
        if self._staged is not None:
            raise StateError(f"{op}() while a stage() is pending; commit() or rollback() first")

    def _check_tokens(self, tokens: Sequence[int], *, extra: int) -> list[int]:
        vocab = self._tf.shape.vocab
        out = [int(t) for t in tokens]
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise KernelError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self._kernel.model.max_context
        if len(self) + extra > limit:
            raise KernelError(f"{len(self) + extra} tokens exceed the model context of {limit}; forget or truncate first")
        return out

    def _amortize_witness(self, span: tuple[int, int], replaced: int, start: int, count: int, probe: int) -> AmortizeWitness:
        k = self._kernel
        raw = self._kv[2, :, :, start : start + count]
        rotated = self._kv[0, :, :, start : start + count]
        positions = torch.arange(start, start + count, device=raw.device)
        err32 = float((rotated - self._tf.rope(raw, positions)).abs().max()) if count else 0.0
        cos, sin = rope_table(k.model.config, start + count, raw.shape[-1], dtype=torch.float64)
        raw64 = raw.double().cpu()
        half = raw64.shape[-1] // 2
        fresh64 = raw64 * cos[start:] + torch.cat((-raw64[..., half:], raw64[..., :half]), -1) * sin[start:]
        err64 = float((rotated.double().cpu() - fresh64).abs().max()) if count else 0.0
        # fp32 RoPE rounds the angle p * inv_freq to ~p * 2^-24 rad; the key error scales with |k|.
        tol64 = 8 * torch.finfo(torch.float32).eps * (start + count + 1) * (float(raw.abs().max()) if count else 0.0)
        edited, reference = self._probe(probe)
        return AmortizeWitness(
            span=span,
            replacement_tokens=replaced,
            shift=replaced - (span[1] - span[0]),
            positional_max_abs_err=err32,
            positional_max_abs_err_f64=err64,
            positional_ok=err32 == 0.0 and err64 <= tol64,
            probe_positions=edited.shape[0],
            **k.provenance(),
            **dict[str, Any](divergence(edited, reference)),
        )

    def _probe(self, probe: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of this cache and of a never-saw prefill, on the next token and a probe.

        The probe is teacher-forced with the reference's greedy continuation, so both caches
        are scored on the same tokens. Works on copies; this cache is not changed.
        """
        if self._logits is None:
            return torch.zeros(0, self._tf.shape.vocab), torch.zeros(0, self._tf.shape.vocab)
        steps = max(0, min(probe, self._kernel.model.max_context - len(self)))
        reference = self._kernel.prefill(self._tokens, room=steps)  # sized for the probe: no growth
        edited = self.clone()
        edited.reserve(len(self) + steps)
        assert reference._logits is not None
        ref_rows, edit_rows = [reference._logits], [self._logits]
        for _ in range(steps):
            token = int(ref_rows[-1].argmax())
            ref_rows.append(reference.extend([token]))
            edit_rows.append(edited.extend([token]))
        return torch.stack(edit_rows), torch.stack(ref_rows)


def forget_witness(kernel: Kernel, edited: KVCache, spans: list[tuple[int, int]]) -> ForgetWitness:
    """Compare ``edited`` with a fresh prefill of its tokens (the never-saw reference)."""
    reference = kernel.prefill(edited._tokens)
    n = len(edited)
    dk = _max_abs_delta(edited, reference, (0, 2), n)
    dv = _max_abs_delta(edited, reference, (1,), n)
    if edited._logits is None or reference._logits is None:
        dl, argmax_equal = 0.0, edited._logits is None and reference._logits is None
    else:
        dl = float((edited._logits - reference._logits).abs().max())
        argmax_equal = int(edited._logits.argmax()) == int(reference._logits.argmax())
    d_edit, d_ref = edited.digest(), reference.digest()
    return ForgetWitness(
        equal=dk == 0.0 and dv == 0.0 and dl == 0.0 and argmax_equal and d_edit == d_ref,
        digest_edited=d_edit,
        digest_reference=d_ref,
        max_abs_dk=dk,
        max_abs_dv=dv,
        max_abs_dlogits=dl,
        argmax_equal=argmax_equal,
        survivors_sha256=tokens_sha256(edited._tokens),
        tokens=n,
        spans=spans,
        **kernel.provenance(),
    )


def _check_spans(spans: Sequence[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """Validate half-open spans: non-empty, in range, sorted and non-overlapping."""
    out = [(int(a), int(b)) for a, b in spans]
    if not out:
        raise SpanError("no spans given; pass at least one (start, end) pair")
    prev_end = 0
    for a, b in out:
        if not 0 <= a < b <= length:
            raise SpanError(f"span [{a}, {b}) is empty or outside the cache [0, {length})")
        if a < prev_end:
            raise SpanError(f"span [{a}, {b}) overlaps or precedes the previous span ending at {prev_end}; pass sorted, disjoint spans")
        prev_end = b
    return out


def _check_generation(cfg: GenerationConfig) -> None:
    if cfg.max_new_tokens < 0 or cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise KernelError(f"invalid generation config {cfg}: need max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1")


def _sample(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator) -> int:
    if cfg.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double().cpu() / cfg.temperature, dim=-1)
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < cfg.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _max_abs_delta(a: KVCache, b: KVCache, planes: tuple[int, ...], n: int) -> float:
    """max|a - b| over rows ``[:n]`` of ``planes``, one layer's plane at a time: the difference of
    two whole caches would be a third cache-sized temporary (twice, with its ``abs``)."""
    return max((float((a._kv[p, layer, :, :n] - b._kv[p, layer, :, :n]).abs().max())
                for p in planes for layer in range(a._kv.shape[1])), default=0.0) if n else 0.0
