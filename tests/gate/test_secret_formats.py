"""Secret recall on credentials generated for every format gitleaks/CredSweeper ship rules for,
inside realistic carriers, and false positives on real package text and look-alikes."""

from __future__ import annotations

import random

import pytest

from gate import Gate
from gate.evaluate import evaluate_secrets
from gate.train import secretgen


@pytest.fixture(scope="module")
def gate() -> Gate:
    return Gate(learned=False)


@pytest.fixture(scope="module")
def result(gate: Gate) -> dict:
    return evaluate_secrets(gate, megabytes=10.0, per_format=7)


def test_recall_over_all_formats_and_carriers_is_at_least_098(result: dict) -> None:
    assert result["formats"] >= 140 and result["credentials"] >= 1000
    assert result["recall"] >= 0.98, result["missed"]
    weak = {k: v for k, v in result["recall_by_format"].items() if v < 6 / 7}
    assert not weak, f"formats missed in 2+ of 7 carriers: {weak}"


def test_at_most_one_false_positive_per_10mb_of_real_package_text(result: dict) -> None:
    assert result["benign_megabytes"] >= 10.0
    assert result["false_positives_per_10mb"] <= 1.0, result["false_positive_files"]


def test_lockfile_hashes_public_keys_and_documentation_keys_are_not_secrets(result: dict) -> None:
    assert result["lookalike_documents"] == 300
    assert result["lookalike_false_positives"] == 0, result["lookalike_false_positive_rules"]


@pytest.mark.parametrize("fmt_id", ["openssh", "age", "digitalocean-pat", "digitalocean-oauth", "digitalocean-refresh",
                                    "mailchimp", "shopify-access", "shopify-custom", "shopify-private-app",
                                    "shopify-shared-secret", "db-password", "password", "url-postgres",
                                    "ado-connection-string", "generic-api-key", "pem-encrypted", "pgp-private"])
def test_formats_the_independent_check_missed_are_found_in_every_carrier(gate: Gate, fmt_id: str) -> None:
    fmt = next(f for f in secretgen.FORMATS if f.id == fmt_id)
    rng = random.Random(fmt_id)
    for carrier in secretgen.CARRIERS:
        value = secretgen.credential(rng, fmt)
        text = secretgen.carry(rng, fmt, value, carrier).encode()
        report = gate.scan(text)
        assert report.secret >= 0.5, (fmt_id, carrier, text[:200])
        for f in report.findings:  # the value never leaks into the report
            assert text[f.byte_start : f.byte_end].decode() not in f.excerpt


def test_cat_of_an_ed25519_key_is_a_secret_despite_its_aaaa_runs(gate: Gate) -> None:
    key = secretgen.credential(random.Random(1), next(f for f in secretgen.FORMATS if f.id == "openssh"))
    assert "AAAAAAA" in key
    report = gate.scan(f"$ cat ~/.ssh/id_ed25519\n{key}\n$ ".encode())
    assert {f.rule_id for f in report.findings} == {"private-key"} and report.secret >= 0.99


@pytest.mark.parametrize("code", [
    "password = get_password(user)", "token = tokens[0]", "api_key = os.environ['API_KEY']",
    "secret_key = settings.SECRET_KEY", "l1_key = accessor_info.l1_key", "password: ${DB_PASSWORD}",
    "token: {{ secrets.GITHUB_TOKEN }}", "password = 'password'", "PrivateKey = rust_openssl.hpke.X25519PrivateKey",
    "passwd: !vault |", "access_token_url = 'https://example.org/oauth/token'", "password_hash = 'sha256:' + digest",
])
def test_code_that_names_a_credential_is_not_one(gate: Gate, code: str) -> None:
    assert gate.scan(code.encode()).secret == 0.0


def test_windowed_confirmation_finds_exactly_what_whole_input_confirmation_finds() -> None:
    """Rules with a ``window`` are confirmed only before Hyperscan's match ends; on real package
    text and every generated carrier that must change nothing but the cost."""
    from dataclasses import replace

    from gate.evaluate import package_text
    from gate.secrets import SecretScanner, load_rules

    rules, allow = load_rules()
    assert any(r.window for r in rules)
    windowed, whole = SecretScanner(rules, allow), SecretScanner([replace(r, window=0) for r in rules], allow)
    docs = [d for _, d in package_text(2.0)] + [r["text"].encode() for r in secretgen.corpus(per_format=2)]
    docs.append(b"x" * 5000 + b"\npassword = Kp9vX2mQz7Lw\n" + b"token: " + b"A1b2" * 40 + b"\n")
    key = lambda fs: sorted((f.rule_id, f.byte_start, f.byte_end) for f in fs)
    for d in docs:
        assert key(windowed.scan(d)) == key(whole.scan(d))


def test_a_secrets_only_scan_finds_exactly_the_secret_findings_of_a_whole_scan() -> None:
    """`Gate.scan_secrets` (the MCP guard's look across parts, a tool name's check) skips the
    injection layers; over every format in every carrier, plain and split by a zero-width space
    or spelled in fullwidth (the normalised readings), it must report what `scan` reports."""
    gate = Gate()  # with the learned layer: the whole scan the gateway runs
    rng = random.Random(15)
    texts = []
    for fmt in secretgen.FORMATS:
        carrier = rng.choice(secretgen.CARRIERS)
        value = secretgen.credential(rng, fmt)
        text = secretgen.carry(rng, fmt, value, carrier)
        texts += [text, text.replace(value, value[:6] + "\u200b" + value[6:]),
                  text.replace(value, value.translate({c: c + 0xFEE0 for c in range(0x21, 0x7F)}))]
    found = 0
    for text in texts:
        whole = [f for f in gate.scan(text.encode()).findings if f.kind == "secret"]
        assert gate.scan_secrets(text) == whole, text[:200]
        found += bool(whole)
    assert found >= 2 * len(secretgen.FORMATS)  # the property is tested on findings, not on empty lists
