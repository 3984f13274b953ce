"""The held-out-by-kind evaluation keeps whole kinds out: attack categories and host packages the
training never sees, thresholds and combiners fitted on other kinds only."""

from __future__ import annotations

import numpy as np
import pytest

from gate.train import kind_eval
from gate.train.train_injection import BIPIA_DIR, TEST_ONLY_FAMILIES


def test_ece_is_zero_when_scores_match_outcome_rates_and_large_when_not() -> None:
    p = np.array([0.25] * 4 + [0.75] * 4)
    y = np.array([1, 0, 0, 0, 1, 1, 1, 0], dtype=float)
    assert kind_eval.ece(p, y) == pytest.approx(0.0)
    assert kind_eval.ece(np.full(8, 0.95), np.zeros(8)) == pytest.approx(0.95)


def _rows(kinds: list[str]) -> list[dict]:
    return [{"kind": k, "label": "benign"} for k in kinds]


def test_cross_fitted_scores_of_a_fold_do_not_depend_on_that_folds_labels() -> None:
    fold_a, fold_b = (sorted(f) for f in kind_eval.KIND_FOLDS)
    rows = _rows([fold_a[0]] * 40 + [fold_b[0]] * 40)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((80, 1))
    y = (x[:, 0] + 0.3 * rng.standard_normal(80) > 0).astype(float)
    base = kind_eval.cross_fit(rows, x, y)
    flipped = y.copy()
    flipped[:40] = 1 - flipped[:40]  # change fold A's labels only
    again = kind_eval.cross_fit(rows, x, flipped)
    assert np.allclose(base[:40], again[:40]) and not np.allclose(base[40:], again[40:])


def test_transferred_threshold_comes_from_the_other_folds_negatives() -> None:
    fold_a, fold_b = (sorted(f) for f in kind_eval.KIND_FOLDS)
    rows = _rows([fold_a[0]] * 100 + [fold_b[0]] * 100)
    score = np.r_[np.linspace(0, 0.5, 100), np.linspace(0.5, 1.0, 100)]
    y = np.zeros(200)
    out = kind_eval.transferred_threshold(rows, score, y, 0.01)
    assert out["thresholds"][0] > 0.98 and out["thresholds"][1] < 0.5
    assert out["fpr"] == pytest.approx(0.5, abs=0.02)  # fold B's scores sit above fold A's threshold: it shows


@pytest.mark.skipif(not (BIPIA_DIR / "email" / "train.jsonl").is_file(), reason=f"BIPIA train files not present at {BIPIA_DIR} (the shared/ folder beside the checkout; CI has it)")
def test_every_attack_kind_is_one_training_never_sees() -> None:
    from gate.train.kinds import held_out_attacks

    attacks = held_out_attacks()
    synth = {k.split(":", 1)[1] for k in attacks if k.startswith("synth:")}
    assert synth == TEST_ONLY_FAMILIES
    bipia = [k for k in attacks if k.startswith("bipia-")]
    assert len([k for k in bipia if k.startswith("bipia-text:")]) == 4 and len([k for k in bipia if k.startswith("bipia-code:")]) == 3
