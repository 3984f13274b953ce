"""The secret rules read escaped and base64-encoded text too (gate/unwrap.py), and every finding
there reports the raw bytes it came from, so a redaction cuts the key where it stands."""
from __future__ import annotations

import base64
import gzip
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gate import Gate
from gate.redact import redact
from gate import unwrap
from gate.unwrap import readings

KEY = "AKIAPTGZ6JFEBZSDOXRL"
SECRET = "nHBdHIyvNLVlRXFwF8JlMaLNy02K35uDNHfkf7J8"
CREDENTIALS = f"[default]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n"


@pytest.fixture(scope="module")
def gate() -> Gate:
    return Gate(learned=False)


def _found(gate: Gate, data: bytes) -> set[str]:
    return {f.rule_id for f in gate.scan(data).findings if f.kind == "secret"}


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_a_credentials_file_escaped_into_json_strings_is_found_at_its_raw_bytes(gate: Gate, levels: int) -> None:
    text = CREDENTIALS
    for _ in range(levels):
        text = json.dumps({"content": text})
    data = text.encode()
    found = [f for f in gate.scan(data).findings if f.rule_id == "aws-secret-access-key"]
    assert found and all(data[f.byte_start:f.byte_end] == SECRET.encode() for f in found)


def test_every_byte_of_a_reading_maps_to_the_raw_span_it_came_from() -> None:
    raw = b'{"a": "x\\ny\\\\n\\u00e9\\"z"}'
    plain = readings(raw)[0]
    assert plain.data == '{"a": "x\ny\\n\u00e9"z"}'.encode()
    spans = [plain.raw_span(i, i + 1) for i in range(len(plain.data))]
    assert spans[8] == (8, 10)  # "\n" from the two bytes `\` `n`
    assert raw[spans[plain.data.index("é".encode())][0]:spans[plain.data.index("é".encode()) + 1][1]] == b"\\u00e9"


def test_a_base64_kubernetes_secret_is_found_and_redacted_whole(gate: Gate) -> None:
    pem = ("-----BEGIN OPENSSH PRIVATE KEY-----\n" + "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n" * 4
           + "-----END OPENSSH PRIVATE KEY-----\n")
    encoded = base64.b64encode(pem.encode()).decode()
    password = base64.b64encode(b"Kq7#vLp2Xz9!").decode()
    data = f"apiVersion: v1\nkind: Secret\ndata:\n  id_ed25519: {encoded}\n  db_password: {password}\n".encode()
    report = gate.scan(data)
    cut = {data[f.byte_start:f.byte_end] for f in report.findings if f.kind == "secret"}
    assert encoded.encode() in cut and password.encode() in cut
    redacted = redact(data, report.findings, ("secret",)).data
    assert encoded.encode() not in redacted and password.encode() not in redacted and b"kind: Secret" in redacted


def test_base64_inside_base64_is_read_two_levels_deep(gate: Gate) -> None:
    auth = base64.b64encode(b"ci:Zt8Vq2Lm9#Rk").decode()
    config = base64.b64encode(json.dumps({"auths": {"ghcr.io": {"auth": auth}}}).encode()).decode()
    data = f"data:\n  .dockerconfigjson: {config}\n".encode()
    assert "docker-config-auth" in _found(gate, data)


def test_ordinary_base64_and_escapes_add_no_finding(gate: Gate) -> None:
    picture = base64.b64encode(bytes(range(256)) * 8).decode()
    prose = base64.b64encode(b"The meeting moved to Thursday at ten; bring the quarterly figures.").decode()
    data = json.dumps({"image": picture, "note": prose, "text": "line one\nline \"two\"\n"}).encode()
    assert _found(gate, data) == set()


def _secret_spans(gate: Gate, data: bytes) -> list[bytes]:
    return [data[f.byte_start:f.byte_end] for f in gate.scan(data).findings if f.kind == "secret"]


def test_a_key_in_a_folded_calendar_line_is_found_whole_across_the_fold(gate: Gate) -> None:
    data = (f"BEGIN:VEVENT\r\nDESCRIPTION:creds\\naws_secret_access_key: {SECRET[:20]}\r\n {SECRET[20:]}\\n"
            "end\r\nEND:VEVENT\r\n").encode()
    assert any(SECRET[:20].encode() in s and SECRET[20:].encode() in s for s in _secret_spans(gate, data))


def test_a_private_key_in_a_numbered_listing_is_found_without_its_line_numbers(gate: Gate) -> None:
    body = base64.b64encode(bytes(range(256)) * 2).decode()
    lines = ["-----BEGIN RSA PRIVATE KEY-----"] + [body[i:i + 64] for i in range(0, 512, 64)] + ["-----END RSA PRIVATE KEY-----"]
    for gutter in ("{n:>6}\u2192", "{n:>4} | ", "{n}: "):
        data = "\n".join(gutter.format(n=n) + line for n, line in enumerate(lines, 1)).encode()
        assert any(s.startswith(b"-----BEGIN RSA") and s.endswith(b"-----END RSA PRIVATE KEY-----")
                   for s in _secret_spans(gate, data)), gutter


def test_a_token_under_a_secret_column_of_a_query_result_is_found_and_its_digest_column_is_not(gate: Gate) -> None:
    token, digest = "pat_UmpVywTdmCxrlNDBUTQfXXK5j58SjigHoDJTbQdJ", "6f036318a23a6ea02b76df97598f151d13f83e2abc0b82be8bd547c409a71ded"
    psql = (" id | email          | api_token\n----+----------------+----------\n"
            f"  1 | ann@example.com | {token}\n(1 row)\n").encode()
    assert _secret_spans(gate, psql) == [token.encode()]
    hashed = (" id | sha256_of_token | last4\n----+-----------------+------\n"
              f"  1 | {digest} | mDcG\n").encode()
    assert _secret_spans(gate, hashed) == []


def test_a_token_a_terminal_wrapped_inside_a_quoted_string_is_found_whole(gate: Gate) -> None:
    key = "sk-proj-bniove65_KRQhrF6LXXTiwuyD3AU82SFBJdLiU4xKkInUcJ7rHzqW_R3jNQ1-ilcWJiJHfWUONT3BlbkFJu_5hdUfI2OCsePrwLsXIh1Zyf0"
    data = f'["LANG=C.UTF-8", "OPENAI_API_KEY={key[:40]}\n{key[40:]}", "X=1"]'.encode()
    assert any(key[:40].encode() in s and key[40:].encode() in s for s in _secret_spans(gate, data))
    prose = b'He said "the key\nis under the mat" and left.\n'
    assert _secret_spans(gate, prose) == []


def test_a_credential_gzipped_then_base64_encoded_is_found_and_redacted_whole(gate: Gate) -> None:
    """Red team 14: `H4sI...` (gzip in base64) hid a credentials file from every rule."""
    encoded = base64.b64encode(gzip.compress(CREDENTIALS.encode())).decode()
    data = f'{{"backup": "{encoded}"}}'.encode()
    assert encoded.encode() in _secret_spans(gate, data)
    assert encoded.encode() not in redact(data, gate.scan(data).findings, ("secret",)).data


def test_a_gzip_bomb_is_read_only_to_the_document_s_inflate_budget() -> None:
    from gate.unwrap import INFLATE_RATIO, MIN_INFLATE
    bomb = base64.b64encode(gzip.compress(b"password=" + b"A" * 10_000_000))
    assert len(bomb) < 20_000
    assert all(len(r.data) <= len(bomb) + max(MIN_INFLATE, INFLATE_RATIO * len(bomb)) for r in readings(bomb))


def test_a_credential_in_base32_is_found_at_its_raw_bytes(gate: Gate) -> None:
    encoded = base64.b32encode(CREDENTIALS.encode()).decode()
    data = f"restore-code: {encoded}\n".encode()
    assert encoded.encode() in _secret_spans(gate, data)


def test_a_key_spelled_out_a_character_at_a_time_is_found(gate: Gate) -> None:
    data = f"the key is {' '.join(KEY)} and the rest is prose".encode()
    assert data[data.index(b"A K I A"):].startswith(_secret_spans(gate, data)[0])
    assert _secret_spans(gate, data)[0] == " ".join(KEY).encode()


def test_base32_words_spaced_letters_and_ordinary_gzip_add_no_finding(gate: Gate) -> None:
    note = base64.b64encode(gzip.compress(b"The meeting moved to Thursday at ten.")).decode()
    data = (f"totp seed: {base64.b32encode(bytes(range(40))).decode()}\n"
            f"spelled: t h e q u i c k b r o w n f o x j u m p s\nnote: {note}\n").encode()
    assert _found(gate, data) == set()


SCREENED = [name for name in dir(unwrap) if isinstance(getattr(unwrap, name), re.Pattern)
            and unwrap._screen(getattr(unwrap, name)) is not None]


@pytest.mark.parametrize("name", SCREENED)
def test_a_reading_s_screen_never_says_no_where_its_pattern_matches(name: str) -> None:
    """The Hyperscan screen that skips a reading's `re` pass is a superset of the pattern: every
    text Hypothesis builds to hold a match (backreferences and lookarounds included) passes it, and
    the pass over the screen's windows finds the very matches the pass over the whole text finds."""
    rx = getattr(unwrap, name)
    matched = []

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=400), st.from_regex(rx), st.binary(max_size=400))
    def holds(before: bytes, inner: bytes, after: bytes) -> None:
        for data in (inner, before + inner + after):
            if rx.search(data):
                matched.append(data)
                assert unwrap.may_match(rx, data), data
            # the windowed pass finds exactly what the whole-text pass finds
            assert [m.span() for m in unwrap.matches(rx, data)] == [m.span() for m in rx.finditer(data)], data

    holds()
    assert len(matched) >= 100  # not vacuous: most examples hold a match


def test_the_screens_skip_readings_an_ordinary_json_result_has_no_run_for() -> None:
    rows = json.dumps([{"id": i, "sku": f"S-{i:04d}", "name": f"Widget {i}", "qty": i % 13} for i in range(30)]).encode()
    assert SCREENED and "_SPACED" in SCREENED and "_GROUPED" in SCREENED
    assert [n for n in ("_SPACED", "_GROUPED", "_HEX", "_BASE32", "_BASE64_LINES", "_PLUS")
            if unwrap.may_match(getattr(unwrap, n), rows)] == []
