"""Leave-kinds-out cross-validation: folds partition the wide set's kinds, no model sees the kind
it scores, the folded probe computes what was fitted, and the contrast kinds mark their spans."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gate import InjectionProbe
from gate.probe import window_features
from gate.train import contrast, probe_cv
from gate.train.probe_features import LAYERS, FeatureSet

WIDE = Path(probe_cv.__file__).resolve().parents[1] / "data" / "kinds_wide.jsonl"


@pytest.fixture(scope="module")
def wide_rows() -> list[dict]:
    return [json.loads(line) for line in WIDE.read_text(encoding="utf-8").splitlines()]


def test_host_and_attack_folds_partition_the_wide_sets_kinds(wide_rows) -> None:
    for folds, values in ((probe_cv.HOST_FOLDS, {r["kind"] for r in wide_rows}),
                          (probe_cv.ATTACK_FOLDS, {r["attack"] for r in wide_rows if "attack" in r})):
        assert set().union(*folds) == values
        assert sum(len(f) for f in folds) == len(values)


def _fake_set(rows: list[dict], seed: int = 0) -> FeatureSet:
    rng = np.random.default_rng(seed)
    return FeatureSet(rows, [rng.standard_normal((3, len(LAYERS) * 576)).astype(np.float16) for _ in rows])


def test_every_out_of_fold_score_comes_from_a_model_that_never_saw_its_host_or_attack_kind(wide_rows, monkeypatch) -> None:
    seen: list[tuple[set, set]] = []
    real_fit = probe_cv.fit

    def spy(sets, mats, wide_idx, s):
        rows = sets["wide"].rows
        seen.append(({rows[i]["kind"] for i in wide_idx}, {rows[i].get("attack") for i in wide_idx}))
        return real_fit(sets, mats, wide_idx, s)

    monkeypatch.setattr(probe_cv, "fit", spy)
    rows = [r for r in wide_rows if r["kind"] in ("notes", "calendar", "todo-email", "chat-json")][::4]
    cv = probe_cv.cross_validate({"wide": _fake_set(rows)}, probe_cv.Setting((12,), 1.0, 1, False, False))
    assert len(seen) == 16
    trained = iter(seen)
    for i, hosts in enumerate(probe_cv.HOST_FOLDS):
        for j, attacks in enumerate(probe_cv.ATTACK_FOLDS):
            if not any(r["kind"] in hosts for r in rows):
                continue
            kinds, atts = next(trained)
            assert not kinds & hosts and not atts & attacks
    for r, scores in zip(rows, cv["oof"]):
        assert np.isfinite(scores).sum() == (len(probe_cv.ATTACK_FOLDS) if r["label"] == "benign" else 1)


def test_every_red_team_calibration_score_comes_from_a_model_that_never_saw_its_set(wide_rows, monkeypatch) -> None:
    seen: list[set[str]] = []
    real_fit = probe_cv.fit

    def spy(sets, mats, wide_idx, s):
        seen.append({r["set"] for r in sets["redteam"].rows})
        return real_fit(sets, mats, wide_idx, s)

    monkeypatch.setattr(probe_cv, "fit", spy)
    wide = [r for r in wide_rows if r["kind"] in ("notes", "calendar")][::8]
    red = [{"text": f"row {k}", "label": ("benign", "injection")[k % 2], "kind": "redteam:x", "set": f"s{k % 3}"}
           for k in range(12)]
    sets = {"wide": _fake_set(wide), "redteam": _fake_set(red, seed=1)}
    s = probe_cv.Setting((12,), 1.0, 1, False, False, redteam=("s0", "s1", "s2"), calibrate_redteam=True)
    mats = {n: probe_cv.matrices(fs, fs.layer_slice(s.layers), None) for n, fs in sets.items()}
    z = probe_cv.redteam_out_of_set(sets, mats, s)
    assert [sorted(sets_seen) for sets_seen in seen] == [["s1", "s2"], ["s0", "s2"], ["s0", "s1"]]
    assert np.isfinite(z).all()
    for k, held in enumerate(("s0", "s1", "s2")):  # each set's scores are those of the model fitted without it
        fitted = real_fit({**sets, "redteam": FeatureSet([r for r in red if r["set"] != held],
                                                         [f for r, f in zip(red, sets["redteam"].feats) if r["set"] != held])},
                          {**mats, "redteam": [m for r, m in zip(red, mats["redteam"]) if r["set"] != held]},
                          np.arange(len(wide)), s)
        idx = [i for i, r in enumerate(red) if r["set"] == held]
        np.testing.assert_allclose(z[idx], [w.max() for w in probe_cv.window_logits(mats["redteam"], idx, fitted)], rtol=1e-6)


def test_the_folded_probe_gives_the_fitted_logit_of_features_and_base_probe() -> None:
    rng = np.random.default_rng(1)
    base = InjectionProbe.load(probe_cv.BASE_PROBE)
    layers = (9, 12)
    dims = len(layers) * 576 + 1
    fitted = (rng.standard_normal(dims), rng.random(dims) + 0.5, rng.standard_normal(dims), 0.3)
    probe_layers, w, bias = probe_cv.fold_prior(fitted, layers, base)
    hidden = {layer: rng.standard_normal((20, 576)).astype(np.float32) for layer in probe_layers}
    folded = window_features(hidden, probe_layers, 16, 8) @ w + bias
    prior_z = ((window_features(hidden, base.layers, 16, 8) - base.mean) / base.scale) @ base.coef + base.intercept
    x = np.concatenate([window_features(hidden, layers, 16, 8), prior_z[:, None]], axis=1)
    want = ((x - fitted[0]) / fitted[1]) @ fitted[2] + fitted[3]
    np.testing.assert_allclose(folded, want, rtol=1e-6, atol=1e-6)


def test_contrast_positives_mark_their_instruction_and_negatives_have_none() -> None:
    rows = contrast.rows(10)
    assert {r["kind"] for r in rows} == set(contrast.BENIGN) | set(contrast.INJECTED)
    for r in rows:
        if r["label"] == "benign":
            assert "span" not in r
        else:
            a, b = r["span"]
            assert 0 <= a < b <= len(r["text"])
            assert any(word in r["text"][a:b].lower() for word in ("assistant", "ai", "agent", "model", "llm", "instructions", "system"))


def test_second_round_contrast_rows_mark_their_request_and_stay_off_the_wide_sets_kinds_and_families(wide_rows) -> None:
    rows = contrast.extra_rows(20)
    assert {r["kind"] for r in rows} == set(contrast.EXTRA_BENIGN) | set(contrast.EXTRA_INJECTED)
    assert not {r["kind"] for r in rows} & {r["kind"] for r in wide_rows}
    assert not set(contrast.TRAIN_FAMILIES) & {"manipulate_output", "scam"}
    wide_texts = {r["text"] for r in wide_rows}
    for r in rows:
        assert r["text"] not in wide_texts
        if r["label"] == "benign":
            assert "span" not in r
            continue
        a, b = r["span"]
        assert 0 <= a < b <= len(r["text"])
        inside = r["text"][a:b]
        assert "@@MARK@@" not in r["text"] and inside.strip() == inside and len(inside) > 10
    calendar = [r for r in rows if r["kind"] == "c-agenda-injected"]
    assert any(r["text"].startswith("BEGIN:VCALENDAR") for r in calendar)
    assert any(json.loads(r["text"])["items"] for r in calendar if r["text"].startswith("{"))


def _six_words(text: str) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i:i + 6]) for i in range(max(0, len(words) - 5))}


def _without(text: str, phrases: tuple[str, ...]) -> str:
    for phrase in phrases:
        text = text.replace(phrase, " | ")
    return text


@pytest.mark.parametrize("round_", [3, 4])
def test_later_round_rows_mark_their_instruction_and_share_no_six_words_with_the_red_teams_sets(wide_rows, round_) -> None:
    from gate.train import contrast3, contrast4

    rows, kinds = {3: (contrast3.third_rows(), {*contrast3.THIRD_BENIGN, *contrast3.THIRD_INJECTED}),
                   4: (contrast4.fourth_rows(), {*contrast4.FOURTH_BENIGN, *contrast4.FOURTH_INJECTED})}[round_]
    assert {r["kind"] for r in rows} == kinds
    assert not {r["kind"] for r in rows} & {r["kind"] for r in wide_rows}
    # Public boilerplate both sides wrote from common usage, not from each other (sets s6, s8 and s9
    # were written after these templates, by writers who never saw them): the example IBAN of every
    # IBAN guide, the German invoice's standard payment term, Spanish for "all the files in the
    # folder", a release manager's "before the release branch is cut", and Spanish for "if you are a
    # model" (s13, written in session 9, four sessions after round 3's templates), and a Spanish
    # invoice's "payment method: bank transfer" line (s14, session 10).
    boilerplate = ("DE89 3704 0044 0532 0130 00", "Zahlbar innerhalb von 14 Tagen ohne Abzug",
                   "todos los archivos de la carpeta", "before the release branch is cut", "Si eres un modelo de",
                   "Forma de pago: transferencia")
    held_out = [json.loads(line)["text"] for path in sorted(WIDE.parent.glob("fresh_redteam_*.jsonl"))
                for line in path.read_text().splitlines()]
    held_out_words = {w for text in held_out for w in _six_words(_without(text, boilerplate))}
    assert held_out_words
    for r in rows:
        assert not _six_words(r["text"]) & held_out_words, r["text"]
        if r["label"] == "benign":
            assert "span" not in r
            continue
        a, b = r["span"]
        inside = r["text"][a:b]
        assert "@@MARK@@" not in r["text"] and inside.strip() == inside and len(inside) > 10


def test_third_round_plants_injections_in_every_language_it_writes() -> None:
    from gate.train import contrast3

    rows = contrast3.third_rows()
    languages = {lang for r in rows if r["kind"] == "c-multilingual-injected"
                 for lang, wraps in contrast3.WRAPS.items() if any(w.split("{x}")[0] in r["text"] for w in wraps)}
    assert languages == set(contrast3.WRAPS)


def test_the_newest_red_team_set_stays_out_of_training_as_the_judge() -> None:
    from gate.train.probe_features import REDTEAM_TRAIN

    sets = sorted(p.name for p in WIDE.parent.glob("fresh_redteam_s*.jsonl"))
    assert set(REDTEAM_TRAIN) - set(sets) == {p.name for p in WIDE.parent.glob("redteam_train_t*.jsonl")}
    assert max(sets, key=lambda name: int(name.removeprefix("fresh_redteam_s").removesuffix(".jsonl"))) not in REDTEAM_TRAIN


def test_a_setting_trains_on_the_red_team_files_it_names_and_no_others() -> None:
    red = [{"text": f"row {k}", "label": "benign", "kind": "redteam:x", "set": f"s{k % 3}"} for k in range(9)]
    sets = {"wide": _fake_set(red[:1]), "redteam": _fake_set(red, seed=1)}
    cut = probe_cv.for_setting(sets, probe_cv.Setting((12,), 1.0, 1, False, redteam=("s0", "s2")))
    assert [r["set"] for r in cut["redteam"].rows] == ["s0", "s2"] * 3
    assert all(f is sets["redteam"].feats[int(r["text"].split()[1])] for r, f in zip(cut["redteam"].rows, cut["redteam"].feats))
    assert cut["wide"] is sets["wide"]
    with pytest.raises(SystemExit, match=r"\['s7'\].*REDTEAM_TRAIN"):
        probe_cv.for_setting(sets, probe_cv.Setting((12,), 1.0, 1, False, redteam=("s0", "s7")))


def test_the_red_team_cache_is_per_file_so_a_new_file_costs_only_its_own_states() -> None:
    from gate.train import probe_features

    rows = [{"text": f"{name} {k}", "set": name} for name in reversed(probe_features.REDTEAM_TRAIN) for k in range(2)]
    asked: list[tuple[str, list[str]]] = []

    def load(name: str, part: list[dict]) -> FeatureSet | None:
        asked.append((name, [r["text"] for r in part]))
        return None if name.endswith(probe_features.REDTEAM_TRAIN[1]) else _fake_set(part)

    got = probe_features._per_file(rows, load)
    assert [n for n, _ in asked] == [f"redteam-{n}" for n in probe_features.REDTEAM_TRAIN]
    assert all(texts == [f"{n.removeprefix('redteam-')} {k}" for k in range(2)] for n, texts in asked)
    assert got is not None and [r["set"] for r in got.rows] == [n for n in probe_features.REDTEAM_TRAIN
                                                                 if n != probe_features.REDTEAM_TRAIN[1] for _ in range(2)]
    assert probe_features._per_file(rows, lambda name, part: None) is None


def test_red_team_rows_that_mark_their_injection_label_exactly_its_tokens(real_model) -> None:
    from gate.train import probe_features

    tok = real_model.tokenizer
    rows = probe_features.redteam_rows(tok)
    marked = [r for r in rows if "injected" in r]
    # t1-t7 name their planted passages; t8 (session 11) does not, and is multiple-instance like s4-s10
    assert {f"redteam_train_t{k}.jsonl" for k in range(1, 8)} <= {r["set"] for r in marked}
    assert "redteam_train_t8.jsonl" not in {r["set"] for r in marked}
    assert all(r["label"] == "injection" for r in marked)
    assert not any("tokens" in r for r in rows if "injected" not in r)
    for r in marked[::7]:
        ids = tok(r["text"], add_special_tokens=False)["input_ids"]
        a, b = r["tokens"]
        if r["injected"] in r["text"]:  # the token span decodes to the passage (tokens may start mid-word)
            assert a < b and r["injected"].strip()[:20] in tok.decode(ids[a:b])
            assert r["injected"].strip()[-20:] in tok.decode(ids[a:b])
        else:  # cut by the truncation: what is left runs to the end, or nothing is (every window a negative)
            assert (a, b) == (0, 0) or (a < b == len(ids))


def test_widened_windows_are_the_means_of_the_longer_windows() -> None:
    rng = np.random.default_rng(2)
    states = rng.standard_normal((80, 4)).astype(np.float32)
    from gate.probe import window_means

    cached = window_means(states, 16, 8)
    want = window_means(states, 32, 8)
    got = probe_cv.widen(cached, 2)
    np.testing.assert_allclose(got, want[: len(got)], rtol=1e-5, atol=1e-5)
    assert len(got) == len(want) - 1 or len(got) == len(want)
    np.testing.assert_allclose(probe_cv.widen(cached[:2], 2), cached[:2].mean(axis=0, keepdims=True), rtol=1e-6)


def test_a_setting_refuses_to_run_without_the_contrast_states_it_trains_on(wide_rows) -> None:
    rows = [r for r in wide_rows if r["kind"] == "notes"][:4]
    with pytest.raises(SystemExit, match="contrast-extra"):
        probe_cv.cross_validate({"wide": _fake_set(rows)}, probe_cv.Setting((12,), 1.0, 1, False, False, extra=True))


def test_the_policy_default_is_the_shipped_probes_calibrated_point_within_the_issues_fpr_bound() -> None:
    meta = InjectionProbe.load().meta
    defaults = json.loads((WIDE.parents[2] / "policies" / "data" / "defaults.json").read_text())
    assert defaults["lethe"]["defaults"]["thresholds"]["injection"] == round(meta["policy_threshold"]["value"], 2)
    assert meta["policy_threshold"]["target_fpr"] <= 0.02 and meta["setting"]["policy_fpr"] == meta["policy_threshold"]["target_fpr"]
    cv = meta["cross_validated"]
    assert cv["recall_at_1pct_fpr"] >= 0.80
    assert cv["at_training_fold_threshold"]["fpr"] <= 0.02 and cv["at_training_fold_threshold"]["recall"] >= 0.70


def test_the_gate_bench_reports_the_shipped_probes_cross_validated_figures_which_meet_issue_15_there_only():
    """`lethe bench gate --json` carries the figures the shipped weights were trained and
    calibrated with (held out by host and attack kind), named with where they came from."""
    from gate.bench import shipped_cv
    from gate.probe import InjectionProbe

    got = shipped_cv()
    assert got["recall_at_1pct_fpr"] == InjectionProbe.load().meta["cross_validated"]["recall_at_1pct_fpr"]
    assert "probe_cv" in got["source"] and got["host_folds"] and got["attack_folds"]
    assert got["recall_at_1pct_fpr"] >= 0.80
    held = got["at_training_fold_threshold"]
    assert held["fpr"] <= 0.02 and held["recall"] >= 0.70


def test_a_sets_share_weights_its_windows_and_leaves_the_unweighted_fit_bit_for_bit() -> None:
    """`Setting.redteam_weight`: shares of 1 are the plain fit exactly; a smaller share for a set
    that contradicts the other moves the fit towards the other's labels."""
    from gate.train.train_probe import fit_logreg

    rng = np.random.default_rng(5)
    x = rng.standard_normal((400, 6)).astype(np.float32)
    truth = (x[:, 0] > 0).astype(float)
    ours, theirs = (x[:200], truth[:200]), (x[200:], 1.0 - truth[200:])  # the second set says the opposite
    plain = fit_logreg(np.concatenate([ours[0], theirs[0]]), np.concatenate([ours[1], theirs[1]]), 0.1)
    for got, want in zip(probe_cv._fit([ours, theirs], [1.0, 1.0], 0.1), plain):
        np.testing.assert_array_equal(got, want)

    def agreement(share: float) -> float:
        mean, scale, coef, b = probe_cv._fit([ours, theirs], [1.0, share], 0.1)
        return float((((((x - mean) / scale) @ coef + b) > 0) == truth).mean())
    assert agreement(0.05) > agreement(0.5) > agreement(2.0)
    assert agreement(0.05) > 0.9
