"""The calibrated plan on disk, keyed by the environment it was measured in.

Why: calibration costs seconds per start; the answer only changes when something the bits depend
on changes. So the plan is stored under the data dir in a file named by the hash of a
*fingerprint* of all of those things, and a cached plan is still re-verified (cheaply) at every
start: a fingerprint can miss a cause, a file can be corrupted or edited. A file that does not
parse, does not match the fingerprint field for field, or whose plan hash does not match its
plan is ignored and replaced by a fresh calibration.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from kvkernel.forward import Transformer
from kvkernel.plan import Plan
from kvkernel.witness import env_fingerprint

log = structlog.get_logger(__name__)

# Bump when the calibration's checks or the candidates change: older cached plans are then stale.
CALIBRATION_VERSION = 1


def default_plan_dir() -> Path:
    """``$LETHE_DATA_DIR/kernel-plans`` (the gateway's data dir; ``var`` when unset)."""
    return Path(os.environ.get("LETHE_DATA_DIR") or "var") / "kernel-plans"


def fingerprint(tf: Transformer) -> dict[str, Any]:
    """Everything a plan's exactness was measured to (or could) depend on.

    Device and dtype, the torch build (version, git hash, BLAS/MKL build info), CPU model and
    flags, the pinned thread count, environment knobs, the injected primitives, and the model's
    linear and attention shapes.
    """
    env = {k: v for k, v in env_fingerprint().items() if k not in ("sha256", "threads")}
    s, layer = tf.shape, tf.layers[0]
    return {
        "calibration_version": CALIBRATION_VERSION,
        "device": str(tf.device),
        "dtype": str(tf.dtype).removeprefix("torch."),
        "threads": tf.threads,
        "primitives": tf.primitives.name,
        "tf32": _tf32() if tf.device.type == "cuda" else None,
        "linear_shapes": {n: list(getattr(layer, n).shape) for n in ("qkv", "o", "gate_up", "down")},
        "attention": {"heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "tile": tf.tile,
                      "key_bucket": tf.key_bucket, "max_context": int(tf.cos.shape[0])},
        **env,
    }


def fingerprint_sha256(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()


def cache_path(plan_dir: Path, fp: dict[str, Any]) -> Path:
    return plan_dir / f"{fingerprint_sha256(fp)[:32]}.json"


def load(path: Path, fp: dict[str, Any]) -> Plan | None:
    """The plan cached at ``path`` for exactly this fingerprint, or None (logged) if unusable."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        plan = Plan.from_dict(data["plan"])
        if data["fingerprint"] != json.loads(json.dumps(fp, default=str)):
            log.warning("kvkernel.plan_cache.stale", path=str(path), reason="fingerprint differs")
            return None
        if data["plan_sha256"] != plan.sha256:
            raise ValueError("plan_sha256 does not match the plan")
        return plan
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("kvkernel.plan_cache.corrupt", path=str(path), error=f"{type(exc).__name__}: {exc}")
        return None


def store(path: Path, fp: dict[str, Any], plan: Plan, seconds: float) -> None:
    """Write the plan atomically (temp file + rename); a read-only data dir only costs a warning."""
    record = {"fingerprint": fp, "plan": plan.to_dict(), "plan_sha256": plan.sha256,
              "calibration_seconds": round(seconds, 2), "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
        tmp.replace(path)
    except OSError as exc:
        log.warning("kvkernel.plan_cache.unwritable", path=str(path), error=str(exc))


def _tf32() -> dict[str, bool]:
    return {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
