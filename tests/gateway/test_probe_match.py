"""The probe follows the model: an enabled probe trained on other weights is refused, the byte
gate alone must be chosen explicitly, and the active scorer is visible in /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from gate import GateError, InjectionProbe
from gateway.app import injection_scorer, load_probe
from gateway.config import Settings
from gateway.metrics import Metrics


def test_probe_trained_on_another_model_is_refused_with_the_fix_named(tiny_model) -> None:
    assert InjectionProbe.load().model_identity != tiny_model.identity
    with pytest.raises(GateError) as err:
        load_probe(Settings(probe=True), tiny_model)
    assert "LETHE_PROBE=false" in str(err.value) and "train_probe" in str(err.value)


def test_byte_gate_only_is_an_explicit_setting(tiny_model) -> None:
    probe = load_probe(Settings(probe=False), tiny_model)
    assert probe is None and injection_scorer(probe) == "byte gate"


def test_probe_path_setting_is_read(tiny_model, tmp_path) -> None:
    with pytest.raises(GateError, match="not found"):
        load_probe(Settings(probe=True, probe_path=tmp_path / "missing.npz"), tiny_model)


def test_active_scorer_is_exported_as_a_metric() -> None:
    m = Metrics()
    m.injection_scorer.info({"scorer": injection_scorer(InjectionProbe.load()), "probe_model": "3ac0c172da6bdd04"})
    text = generate_latest(m.registry).decode()
    assert 'lethe_injection_scorer_info{probe_model="3ac0c172da6bdd04",scorer="stack(probe, byte gate)"} 1.0' in text
