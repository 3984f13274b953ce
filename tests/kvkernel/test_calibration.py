"""Calibration finds an exact plan whatever the GEMM/attention quirks, and forget is exact under it.

The quirky primitives (:mod:`kvkernel.quirks`) are host-independent, so every path of the search
(a small-M transposed form, padding to multiples of 4, pieces, one fixed M, whole tiles, refusal)
runs on whatever CPU runs the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvkernel import ExactnessError, Kernel, calibrate, plan_cache, quirks
from kvkernel.forward import Transformer
from kvkernel.plan import AMD, TORCH, XEON, Plan, Primitives

REPO_ROOT = Path(__file__).resolve().parents[2]

# (primitives, tile, the plan the calibration must find)
QUIRK_CASES = {
    "xeon-like": (quirks.xeon_like, 16, XEON),
    "amd-like": (quirks.amd_like, 16, AMD),
    "only-one-m": (quirks.only_one_m, 16, Plan("fallback-m64-linear", fixed_m=64, attention_min_rows=None)),
    "rows-alone-never": (lambda: quirks.rows_alone_never(64), 32, Plan("linear-min1-step1", attention_min_rows=None)),
}


def _fields(plan: Plan) -> dict:
    return {k: v for k, v in plan.to_dict().items() if k != "name"}


@pytest.fixture(scope="module", params=sorted(QUIRK_CASES))
def quirky(request, tiny_model, tmp_path_factory):
    make, tile, expected = QUIRK_CASES[request.param]
    kernel = Kernel(tiny_model, tile=tile, primitives=make(), plan_dir=tmp_path_factory.mktemp("plans"))
    yield kernel, expected
    kernel.close()


def test_calibration_finds_the_cheapest_exact_plan_for_each_quirk(quirky):
    kernel, expected = quirky
    assert kernel.calibration.source == "calibrated"
    assert _fields(kernel.plan) == _fields(expected)


@pytest.mark.parametrize("span", [(0, 20), (40, 90), (100, 145), (140, 150)])
def test_forget_equals_never_saw_under_each_quirk(quirky, tiny_tokens, never_saw, span):
    kernel, _ = quirky
    cache = kernel.prefill(tiny_tokens[:150])
    witness = cache.forget([span]).witness
    assert witness.equal and witness.max_abs_dk == witness.max_abs_dv == witness.max_abs_dlogits == 0.0
    assert witness.plan_sha256 == kernel.plan.sha256
    never_saw(kernel, cache)


def test_pieces_and_token_by_token_equal_one_shot_under_each_quirk(quirky, tiny_tokens):
    kernel, _ = quirky
    whole = kernel.prefill(tiny_tokens[:60])
    pieces = kernel.prefill(tiny_tokens[:7])
    pieces.extend(tiny_tokens[7:41])
    for t in tiny_tokens[41:60]:
        pieces.extend([t])
    assert pieces.digest() == whole.digest()


def test_a_plan_measured_on_another_machine_is_refused_under_the_quirk(tiny_model, tmp_path):
    with pytest.raises(ExactnessError, match=r"forced plan 'xeon'.*M=2 \(wxt\)"):
        Kernel(tiny_model, plan=XEON, primitives=quirks.amd_like(), plan_dir=tmp_path)


def test_the_quirk_has_teeth_a_wrong_plan_breaks_forget(tiny_model, tiny_tokens, tmp_path):
    """Without calibration the same forget is not exact: the tests above could fail."""
    kernel = Kernel(tiny_model, primitives=quirks.amd_like(), plan_dir=tmp_path)
    kernel.transformer = kernel.transformer.with_plan(XEON)
    cache = kernel.prefill(tiny_tokens[:150])
    witness = cache.forget([(100, 145)]).witness  # 5 surviving rows re-prefilled at M = 5 (wxt)
    assert not witness.equal and witness.max_abs_dk > 0
    kernel.close()


def test_when_no_plan_is_exact_the_kernel_refuses_naming_what_failed(tiny_model, tmp_path):
    with pytest.raises(ExactnessError) as err:
        Kernel(tiny_model, primitives=quirks.hopeless(), plan_dir=tmp_path)
    message = str(err.value)
    assert "not even the fixed-M, whole-tile fallback" in message
    assert "fallback-m512-wxt: " in message and "rows differ" in message and "MKL_CBWR" in message


def test_a_forced_fallback_plan_is_verified_and_exact(tiny_model, tiny_tokens, never_saw, tmp_path):
    fallback = Plan("fallback-m32-linear", fixed_m=32, attention_min_rows=None)
    kernel = Kernel(tiny_model, plan=fallback, plan_dir=tmp_path)
    assert kernel.calibration.source == "forced" and kernel.plan == fallback
    cache = kernel.prefill(tiny_tokens[:120])
    assert cache.forget([(30, 70)]).witness.equal
    never_saw(kernel, cache)
    kernel.close()


# -- the plan cache ------------------------------------------------------------------------------


@pytest.fixture
def tiny_tf(tiny_model) -> Transformer:
    return Transformer(tiny_model, 16, Plan("uncalibrated"), TORCH)


def test_a_calibrated_plan_is_cached_and_reused_without_recalibrating(tiny_tf, tmp_path, monkeypatch):
    first = calibrate.choose_plan(tiny_tf, plan_dir=tmp_path)
    assert first.source == "calibrated" and Path(first.path).is_file()
    monkeypatch.setattr(calibrate, "calibrate", _must_not_calibrate)
    again = calibrate.choose_plan(tiny_tf, plan_dir=tmp_path)
    assert again.source == "cache" and again.plan == first.plan


@pytest.mark.parametrize("damage", ["garbage", "truncated", "plan edited", "hash edited", "not an object"])
def test_a_corrupt_cached_plan_is_recalibrated_and_rewritten(tiny_tf, tmp_path, damage):
    path = Path(calibrate.choose_plan(tiny_tf, plan_dir=tmp_path).path)
    good = json.loads(path.read_text())
    record = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "plan edited":
        record["plan"]["small_min"] = 1
        path.write_text(json.dumps(record))
    elif damage == "hash edited":
        record["plan_sha256"] = "0" * 64
        path.write_text(json.dumps(record))
    else:
        path.write_text("[1, 2, 3]")
    again = calibrate.choose_plan(tiny_tf, plan_dir=tmp_path)
    assert again.source == "calibrated"
    assert json.loads(path.read_text())["plan"] == good["plan"]


def test_a_cached_plan_for_another_environment_is_stale(tiny_tf, tmp_path):
    path = Path(calibrate.choose_plan(tiny_tf, plan_dir=tmp_path).path)
    record = json.loads(path.read_text())
    record["fingerprint"]["cpu_id"] = "GenuineIntel/6/143/8"
    path.write_text(json.dumps(record))
    assert calibrate.choose_plan(tiny_tf, plan_dir=tmp_path).source == "calibrated"


def test_a_cached_plan_that_is_not_exact_here_is_never_trusted(tiny_model, tmp_path):
    """A well-formed cache entry with the right fingerprint but a plan that fails re-verification."""
    tf = Transformer(tiny_model, 16, Plan("uncalibrated"), quirks.amd_like())
    fp = plan_cache.fingerprint(tf)
    plan_cache.store(plan_cache.cache_path(tmp_path, fp), fp, XEON, 0.0)
    chosen = calibrate.choose_plan(tf, plan_dir=tmp_path)
    assert chosen.source == "calibrated" and _fields(chosen.plan) == _fields(AMD)


def test_the_fingerprint_names_what_the_bits_depend_on(tiny_tf):
    fp = plan_cache.fingerprint(tiny_tf)
    for key in ("device", "dtype", "threads", "torch", "torch_build_sha256", "blas", "cpu_id", "cpu_flags_sha256",
                "linear_shapes", "attention", "primitives", "calibration_version"):
        assert key in fp, key
    assert fp["linear_shapes"]["down"] == [64, 128]
    other = Transformer(_tiny(), 16, Plan("x"), Primitives("quirk:other"))
    assert plan_cache.fingerprint_sha256(plan_cache.fingerprint(other)) != plan_cache.fingerprint_sha256(fp)


def _tiny():
    from kvkernel import tiny_random_model

    return tiny_random_model(0)


def _must_not_calibrate(*args, **kwargs):
    raise AssertionError("a valid cached plan must not be recalibrated")


# -- the real calibration at 1 and 2 threads -----------------------------------------------------

_PROBE = """
import json, sys
from pathlib import Path
import torch
from kvkernel import Kernel, load_model, tiny_random_model
model = tiny_random_model(0) if sys.argv[1] == "tiny" else load_model(cache_dir=Path(sys.argv[3]), progress=False)
kernel = Kernel(model, plan_dir=Path(sys.argv[2]))
tokens = [(7 * i + 3) % 250 + 3 for i in range(160)]
cache = kernel.prefill(tokens)
w = cache.forget([(40, 100)]).witness
print(json.dumps({"threads": kernel.transformer.threads, "torch_threads": torch.get_num_threads(),
                  "source": kernel.calibration.source, "plan": kernel.plan.to_dict(), "equal": w.equal,
                  "max": [w.max_abs_dk, w.max_abs_dv, w.max_abs_dlogits], "fp_threads": kernel.calibration.fingerprint["threads"]}))
"""


def _probe(which: str, threads: int, tmp_path: Path, model_cache_dir: Path) -> dict:
    env = {**os.environ, "LETHE_KERNEL_THREADS": str(threads), "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", _PROBE, which, str(tmp_path), str(model_cache_dir)],
                         env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("threads", [1, 2])
def test_real_calibration_at_each_thread_count_gives_exact_forget_tiny(threads, tmp_path, model_cache_dir):
    got = _probe("tiny", threads, tmp_path, model_cache_dir)
    assert got["threads"] == got["torch_threads"] == got["fp_threads"] == threads
    assert got["source"] == "calibrated" and got["equal"] and got["max"] == [0.0, 0.0, 0.0]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_real_calibration_at_each_thread_count_gives_exact_forget_smollm2(threads, tmp_path, model_cache_dir):
    got = _probe("real", threads, tmp_path, model_cache_dir)
    assert got["threads"] == got["torch_threads"] == got["fp_threads"] == threads
    assert got["source"] == "calibrated" and got["equal"] and got["max"] == [0.0, 0.0, 0.0]
    again = _probe("real", threads, tmp_path, model_cache_dir)
    assert again["source"] == "cache" and again["plan"] == got["plan"]
