"""A secret split across consecutive tool results leaves no fragment anywhere (issue 13, red team).

An AWS key id and secret cut into two or three tool results: each part alone looks harmless, the
joined scan finds the secret. Every part that holds bytes of it must get the secret action (redact
by default, forget by tenant policy); afterwards no fragment of 8 or more characters is in the
cache, in lethe.db, its -wal or anywhere in the data directory (red team: allow, forget, allow
kept the first 10 characters of the key id and the last 20 of the secret in lethe.db)."""
from __future__ import annotations

import random
import string
from pathlib import Path

import pytest

from gate import Gate

from .conftest import turns_settled, wait_until

pytestmark = pytest.mark.model

FRAGMENT = 8  # the shortest fragment searched for


def _credentials(seed: int) -> tuple[str, str]:
    """A fresh AWS-style key id and secret (never a live key) that the gate finds when whole."""
    rng = random.Random(seed)
    kid = "AKIA" + "".join(rng.choice(string.ascii_uppercase + "234567") for _ in range(16))
    sec = "".join(rng.choice(string.ascii_letters + string.digits + "/+") for _ in range(40))
    return kid, sec


def _document(kid: str, sec: str, name: str = "") -> str:
    """The spaced layout, or for a `tight-` cut the red team #13 layout with no space around '='."""
    eq = "=" if name.startswith("tight-") else " = "
    return f"aws_access_key_id{eq}{kid}\naws_secret_access_key{eq}{sec}\n"


LABEL = "aws_secret_access_key"
# cut points: (where, offset) — inside the key id ("kid"), the secret ("sec") or the secret's label ("lab"),
# from its first character. A cut in the label leaves the secret's part without the context its rule needs.
CUTS = {
    "2-in-key-id": [("kid", 4)],
    "2-mid-key-id": [("kid", 10)],
    "2-in-secret": [("sec", 8)],
    "2-mid-secret": [("sec", 20)],
    "2-late-secret": [("sec", 33)],
    "3-key-id-and-secret": [("kid", 10), ("sec", 20)],  # the red team's split
    "3-both-in-key-id": [("kid", 3), ("kid", 12)],
    "3-both-in-secret": [("sec", 6), ("sec", 27)],
    "3-key-id-end-and-secret": [("kid", 16), ("sec", 9)],
    "tight-3-red-team-bytes-30-60": [("kid", 12), ("lab", 21)],  # red team #13: allowed the third part
    "tight-3-key-id-and-label-end": [("kid", 12), ("lab", 20)],
    "tight-2-label-start": [("lab", 0)],
    "tight-2-mid-label": [("lab", 11)],
    "tight-2-label-end": [("lab", 19)],
    "3-key-id-and-mid-label": [("kid", 12), ("lab", 7)],
    "2-label-end": [("lab", 20)],
    "2-after-label": [("lab", 21)],
}


def _parts(seed: int, name: str) -> tuple[list[str], str, str]:
    """The document cut at `name`'s cuts; every part holds bytes of the key id or the secret."""
    cuts = CUTS[name]
    kid, sec = _credentials(seed)
    text = _document(kid, sec, name)
    at = {"kid": text.index(kid), "sec": text.index(sec), "lab": text.index(LABEL)}
    bounds = [0, *(at[where] + offset for where, offset in cuts), len(text)]
    spans = [(at["kid"], at["kid"] + len(kid)), (at["sec"], at["sec"] + len(sec))]
    assert all(any(a < e and b > s for s, e in spans) for a, b in zip(bounds, bounds[1:]))
    return [text[a:b] for a, b in zip(bounds, bounds[1:])], kid, sec


def _fragments(*secrets: str) -> set[bytes]:
    """Every substring of FRAGMENT characters: a longer fragment holds one of them."""
    return {s[i:i + FRAGMENT].encode() for s in secrets for i in range(len(s) - FRAGMENT + 1)}


def _files(data_dir: Path) -> list[Path]:
    return sorted(p for p in data_dir.rglob("*") if p.is_file())


def _found(data_dir: Path, fragments: set[bytes]) -> dict[str, list[bytes]]:
    """Which fragments each file under `data_dir` holds (lethe.db and its -wal included)."""
    hits: dict[str, list[bytes]] = {}
    for path in _files(data_dir):
        data = path.read_bytes()
        held = sorted(f for f in fragments if f in data)
        if held:
            hits[str(path.relative_to(data_dir))] = held
    return hits


def _messages(parts: list[str]) -> list[dict]:
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
             for i in range(len(parts))]
    return [{"role": "user", "content": "read the credentials file"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": f"c{i}", "content": p} for i, p in enumerate(parts))]


def _send(live, key: str, parts: list[str]) -> tuple[str, list[dict]]:
    with live.client(key) as http:
        response = http.post("/v1/chat/completions",
                             json={"model": "m", "messages": _messages(parts), "max_tokens": 1})
    assert response.status_code == 200, response.text
    wait_until(lambda: turns_settled(live), what="the turn's post-turn erasures")
    tool = [a for a in response.json()["lethe"]["actions"] if a["channel"] == "tool"]
    return response.headers["x-lethe-session"], tool


@pytest.fixture(scope="module")
def gate() -> Gate:
    return Gate()


def _seed(name: str, mode: str) -> int:
    return list(CUTS).index(name) + (100 if mode == "forget" else 200)


@pytest.mark.parametrize("mode", ["forget", "redact"])
@pytest.mark.parametrize("name", list(CUTS))
def test_the_generated_credentials_are_found_whole(gate: Gate, name: str, mode: str) -> None:
    """The premise of the tests below: the gate finds both when they are not cut."""
    kid, sec = _credentials(_seed(name, mode))
    whole = {f.rule_id for f in gate.scan(_document(kid, sec, name).encode()).findings}
    assert {"aws-access-key-id", "aws-secret-access-key"} <= whole


def test_the_red_teams_split_passes_part_by_part(gate: Gate) -> None:
    """The attack: the outer parts alone are no secret (allow, forget, allow when scored alone)."""
    parts, _, _ = _parts(_seed("3-key-id-and-secret", "forget"), "3-key-id-and-secret")
    assert [gate.scan(p.encode()).secret >= 0.5 for p in parts] == [False, True, False]


@pytest.mark.parametrize("name", list(CUTS))
def test_every_part_of_a_split_secret_is_forgotten_and_no_fragment_stays_at_rest(live_gateway, with_tenant_policy,
                                                                                 tmp_path, name: str) -> None:
    parts, kid, sec = _parts(_seed(name, "forget"), name)
    tenant = f"split-forget-{name}"
    key = live_gateway.new_key(tenant, user="fay")
    with with_tenant_policy(live_gateway.state.policy, tmp_path, {tenant: {"sensitive_action": "forget"}}):
        sid, actions = _send(live_gateway, key, parts)
    assert [a["action"] for a in actions] == ["forget"] * len(parts)
    segments = live_gateway.state.ledger.segments(sid)
    assert [s.state.value for s in segments[2:2 + len(parts)]] == ["forgotten"] * len(parts)
    assert _found(live_gateway.data_dir, _fragments(kid, sec)) == {}


@pytest.mark.parametrize("name", list(CUTS))
def test_every_part_of_a_split_secret_is_redacted_over_its_own_fragment(live_gateway, name: str) -> None:
    parts, kid, sec = _parts(_seed(name, "redact"), name)
    key = live_gateway.new_key(f"split-redact-{name}", user="ray")
    sid, actions = _send(live_gateway, key, parts)
    fragments = _fragments(kid, sec)
    assert [a["action"] for a in actions] == ["redact"] * len(parts)
    state = live_gateway.state
    text = state.model.tokenizer.decode(list(state.gateway.cache(sid).tokens)).encode()
    assert not [f for f in fragments if f in text]
    segments = state.ledger.segments(sid)
    for seg in segments[2:2 + len(parts)]:
        redacted = state.ledger.content.get(seg.replacement_sha256)
        assert b"[REDACTED:" in redacted and not [f for f in fragments if f in redacted]
    assert _found(live_gateway.data_dir, fragments) == {}
