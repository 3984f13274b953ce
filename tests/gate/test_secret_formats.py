"""Secret recall on credentials generated for every format gitleaks/CredSweeper ship rules for,
inside realistic carriers, and false positives on real package text and look-alikes."""

from __future__ import annotations

import json
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
    # the armoured block, its body read alone (the rule for a key pasted without BEGIN/END), and its
    # body lines with the END line (the rule for a key's second half, shown without its BEGIN line)
    assert {f.rule_id for f in report.findings} == {"private-key", "private-key-body", "private-key-tail"}
    assert report.secret >= 0.99


def _body(pem: bytes) -> str:
    return "\n".join(line for line in pem.decode().splitlines() if not line.startswith("-----"))


def _private_bodies() -> list[tuple[str, str]]:
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    keys = {"rsa-2048": rsa.generate_private_key(65537, 2048), "rsa-4096": rsa.generate_private_key(65537, 4096),
            "ec-p256": ec.generate_private_key(ec.SECP256R1()), "ec-p384": ec.generate_private_key(ec.SECP384R1()),
            "ed25519": ed25519.Ed25519PrivateKey.generate()}
    formats = {"pkcs1-or-sec1": s.PrivateFormat.TraditionalOpenSSL, "pkcs8": s.PrivateFormat.PKCS8,
               "openssh": s.PrivateFormat.OpenSSH}
    out = []
    for name, key in keys.items():
        for fmt, value in formats.items():
            if name == "ed25519" and fmt == "pkcs1-or-sec1":
                continue  # no such format
            out.append((f"{name}/{fmt}", _body(key.private_bytes(s.Encoding.PEM, value, s.NoEncryption()))))
    return out


def test_a_private_key_body_without_its_begin_and_end_lines_is_a_secret_in_every_carrier(gate: Gate) -> None:
    """Red team 14: a key pasted without its armour read as plain base64. Each format's body, as
    lines, indented YAML, a JSON string and one line, is found and covered whole."""
    for label, body in _private_bodies():
        flat = body.replace("\n", "")
        for carrier in (body, "key: |\n  " + body.replace("\n", "\n  "), json.dumps({"key": body}), f"KEY={flat}"):
            data = carrier.encode()
            spans = [(f.byte_start, f.byte_end) for f in gate.scan_secrets(data) if f.rule_id == "private-key-body"]
            assert spans, f"{label} missed in {carrier[:24]!r}"
            first, last = body.split("\n")[0], body.split("\n")[-1]
            start, end = data.index(first.encode()), data.rindex(last.encode()) + len(last)
            assert min(s for s, _ in spans) <= start and max(e for _, e in spans) >= end, (label, spans, start, end)


def test_a_public_key_or_certificate_body_without_its_armour_is_not_a_secret(gate: Gate) -> None:
    """They open with the same `MII…` base64, but their ASN.1 opens a SEQUENCE with a SEQUENCE,
    never the version a private key starts with."""
    import certifi
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    publics = [k.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo)
               for k in (rsa.generate_private_key(65537, 2048), ec.generate_private_key(ec.SECP256R1()))]
    certificates = open(certifi.where(), "rb").read()  # 140-odd CA certificates
    for text in [_body(p) for p in publics] + [_body(certificates)]:
        assert not [f.rule_id for f in gate.scan_secrets(text.encode())], text[:40]


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
