"""The wide held-out-by-kind set is big enough to measure 1% FPR, matches its manifest, and holds
only host and attack kinds that no training set generates."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from gate.train import kinds_wide, synth
from gate.train.train_injection import BIPIA_DIR, TEST_ONLY_FAMILIES

DATA = Path(kinds_wide.__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in (DATA / "kinds_wide.jsonl").read_text(encoding="utf-8").splitlines()]


def test_a_thousand_negatives_so_one_percent_fpr_is_ten_documents_and_the_manifest_says_so(rows) -> None:
    manifest = json.loads((DATA / "kinds_wide.manifest.json").read_text())
    labels = Counter(r["label"] for r in rows)
    assert labels["benign"] == manifest["benign"] >= 1000 and labels["injection"] == manifest["injected"] >= 300
    per_kind = Counter((r["kind"], r["label"]) for r in rows)
    assert {k: {"benign": per_kind[k, "benign"], "injected": per_kind[k, "injection"]} for k in manifest["per_kind"]} == manifest["per_kind"]
    assert manifest["attack_kinds"] == dict(sorted(Counter(r["attack"] for r in rows if "attack" in r).items()))


def test_no_host_kind_or_attack_family_is_one_a_training_generator_has(rows) -> None:
    kinds = {r["kind"] for r in rows}
    assert not kinds & set(synth.BENIGN_KINDS)
    attacks = {r["attack"] for r in rows if "attack" in r}
    trained_families = {f"synth:{f}" for f in synth.FAMILIES if f not in TEST_ONLY_FAMILIES}
    assert not attacks & trained_families
    assert {a for a in attacks if a.startswith("new:")} == {"new:tool_hijack", "new:short_output"}
    assert not {a.split(":", 1)[1] for a in attacks if a.startswith("new:")} & set(synth.FAMILIES)


def test_no_document_of_the_set_is_in_the_training_pipelines_dev_or_test_files(rows) -> None:
    seen = {json.loads(line)["text"] for name in ("dev", "test") for line in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()}
    assert not {r["text"] for r in rows} & seen


@pytest.mark.skipif(not (BIPIA_DIR / "email" / "train.jsonl").is_file(), reason=f"BIPIA train files not present at {BIPIA_DIR} (the shared/ folder beside the checkout; CI has it)")
def test_agent_workspace_hosts_carry_tool_hijacks_inside_their_json_fields() -> None:
    built = kinds_wide.build(benign_per_kind=2, injected_per_kind=4)
    assert built == kinds_wide.build(benign_per_kind=2, injected_per_kind=4)  # deterministic
    hijacks = [r for r in built if r.get("attack") == "new:tool_hijack" and r["kind"] in ("banking-json", "travel-json", "chat-json", "calendar")]
    assert hijacks and all(isinstance(json.loads(r["text"]), dict) for r in hijacks)
    shorts = [r for r in built if r["kind"] == "short-output" and r["label"] == "injection"]
    assert shorts and all(len(r["text"]) < 400 for r in shorts)
