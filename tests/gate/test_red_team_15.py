"""Red team 15's breaks of the secret readings, kept as properties: a private key's body without
its armour at any width from 16 columns, behind the prefixes a listing, a quote or a program puts
on each line, encrypted (PKCS#8 with PBES2) or bundled (PKCS#12), or base64url on one line; and a
token spelled out with any one separator between its characters, or in groups of two or four."""
from __future__ import annotations

import base64
import json
import textwrap

import pytest

from gate import Gate

KEY = "AKIAPTGZ6JFEBZSDOXRL"


@pytest.fixture(scope="module")
def gate() -> Gate:
    return Gate()


@pytest.fixture(scope="module")
def der() -> dict[str, bytes]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, rsa
    from cryptography.hazmat.primitives.serialization import pkcs12
    from cryptography.x509.oid import NameOID
    import datetime
    from cryptography import x509

    rsa_key, ec_key = rsa.generate_private_key(65537, 2048), ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rt15")])
    now = datetime.datetime(2026, 1, 1)
    cert = x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ec_key.public_key()) \
        .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)).sign(ec_key, hashes.SHA256())
    der = s.Encoding.DER
    return {
        "rsa-pkcs1": rsa_key.private_bytes(der, s.PrivateFormat.TraditionalOpenSSL, s.NoEncryption()),
        "ec-pkcs8": ec_key.private_bytes(der, s.PrivateFormat.PKCS8, s.NoEncryption()),
        "ed448-pkcs8": ed448.Ed448PrivateKey.generate().private_bytes(der, s.PrivateFormat.PKCS8, s.NoEncryption()),
        "rsa-pkcs8-encrypted": rsa_key.private_bytes(der, s.PrivateFormat.PKCS8, s.BestAvailableEncryption(b"hunter22")),
        "pkcs12": pkcs12.serialize_key_and_certificates(b"rt15", ec_key, cert, None, s.BestAvailableEncryption(b"pw")),
    }


def _covered(gate: Gate, data: bytes, pieces: list[str]) -> bool:
    """Whether one private-key-body finding covers every piece of the key."""
    spans = [(f.byte_start, f.byte_end) for f in gate.scan_secrets(data) if f.rule_id == "private-key-body"]
    at = [data.index(p.encode()) for p in pieces]
    return any(s <= min(at) and e >= max(a + len(p) for a, p in zip(at, pieces)) for s, e in spans)


def _keyed(lines: list[str]) -> list[str]:
    """The lines the rule covers: all but a last line under 16 characters of letters only, which
    reads as a word after the key (a known gap, README: at most 11 bytes of the key's end shown)."""
    last = lines[-1]
    return lines[:-1] if len(last) < 16 and last.isalpha() else lines


@pytest.mark.parametrize("width", [16, 24, 40, 56, 64, 76, 77, 96])
def test_a_key_body_of_any_width_from_16_columns_is_covered_whole(gate: Gate, der: dict[str, bytes], width: int) -> None:
    for label in ("rsa-pkcs1", "ec-pkcs8"):
        lines = textwrap.wrap(base64.b64encode(der[label]).decode(), width)
        assert _covered(gate, "\n".join(lines).encode(), _keyed(lines)), (label, width)


PREFIXES = {
    "quoted-reply": lambda lines: "\n".join("> " + x for x in lines),
    "comment": lambda lines: "\n".join("# " + x for x in lines),
    "html-breaks": lambda lines: "<p>" + "<br>".join(lines) + "</p>",
    "html-breaks-and-newlines": lambda lines: "<br>\n".join(lines),
    "python-concatenation": lambda lines: "KEY = (\n" + "\n".join(f'    "{x}"' for x in lines) + "\n)",
    "js-plus": lambda lines: "const k = " + " +\n  ".join(f"'{x}'" for x in lines) + ";",
    "json-array": lambda lines: json.dumps(lines, indent=2),
    "one-space": lambda lines: " ".join(lines),
    "cat-n": lambda lines: "\n".join(f"{n:6}\t{x}" for n, x in enumerate(lines, 1)),
    "editor-gutter": lambda lines: "\n".join(f"{n}\u2192{x}" for n, x in enumerate(lines, 1)),
}


@pytest.mark.parametrize("carrier", PREFIXES)
def test_a_key_body_behind_per_line_prefixes_or_joiners_is_covered_whole(gate: Gate, der: dict[str, bytes],
                                                                          carrier: str) -> None:
    for label in ("rsa-pkcs1", "ed448-pkcs8"):
        lines = textwrap.wrap(base64.b64encode(der[label]).decode(), 64)
        assert _covered(gate, PREFIXES[carrier](lines).encode(), lines), (label, carrier)


@pytest.mark.parametrize("label", ["rsa-pkcs8-encrypted", "pkcs12"])
def test_an_encrypted_or_bundled_key_body_is_a_secret(gate: Gate, der: dict[str, bytes], label: str) -> None:
    lines = textwrap.wrap(base64.b64encode(der[label]).decode(), 64)
    assert _covered(gate, "\n".join(lines).encode(), lines)


def test_a_key_in_base64url_on_one_line_is_a_secret(gate: Gate, der: dict[str, bytes]) -> None:
    body = base64.urlsafe_b64encode(der["rsa-pkcs1"]).decode().rstrip("=")
    assert "-" in body or "_" in body
    assert _covered(gate, f"PRIVATE_KEY_DER={body}\n".encode(), [body])


SPELLED = {
    "two-spaces": "  ".join(KEY), "dots": ".".join(KEY), "dashes": "-".join(KEY), "newlines": "\n".join(KEY),
    "tabs": "\t".join(KEY), "comma-space": ", ".join(KEY), "json-array": json.dumps(list(KEY)),
    "python-list": str(list(KEY)), "pairs": " ".join(KEY[i:i + 2] for i in range(0, 20, 2)),
    "groups-of-four": " ".join(KEY[i:i + 4] for i in range(0, 20, 4)),
    "groups-of-four-dashed": "-".join(KEY[i:i + 4] for i in range(0, 20, 4)),
    "json-value": json.dumps({"text": " ".join(KEY)}),
}


@pytest.mark.parametrize("carrier", SPELLED)
def test_a_token_spelled_out_with_any_separator_is_found(gate: Gate, carrier: str) -> None:
    data = f"note: {SPELLED[carrier]} end".encode()
    found = [data[f.byte_start:f.byte_end] for f in gate.scan_secrets(data)]
    assert any(KEY[0].encode() in s and KEY[-1].encode() in s for s in found), (carrier, found)


def test_words_dates_versions_and_card_like_groups_are_not_spelled_tokens(gate: Gate) -> None:
    text = ("we had to go in at it so we did and then on to it. v1.2.3.4.5.6.7.8.9.1.2.3 "
            "a-b-c-d-e-f-g-h-i-j-k-l-m then that with from have been done some more\n"
            "fingerprint ABCD EF12 3456 7890 ABCD EF12 3456 7890 ABCD EF12\n"
            "Y\nN\nY\nN\nY\nN\nY\nN\nY\nN\nY\nN\nY\nN\n2026-12-03 12:00:00\n")
    assert gate.scan_secrets(text.encode()) == []


CREDENTIALS = "[default]\naws_access_key_id = AKIAPTGZ6JFEBZSDOXRL\naws_secret_access_key = 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\n"
PADDING = "log line: the nightly job finished without errors and nothing changed\n" * 40  # compresses ~30x


def _gzip_carriers() -> dict[str, str]:
    import gzip
    import zlib
    one = base64.b64encode(gzip.compress(CREDENTIALS.encode())).decode()
    return {
        "wrapped-76": "\n".join(textwrap.wrap(one, 76)),
        "wrapped-64": "\n".join(textwrap.wrap(one, 64)),
        "after-compressible-text": base64.b64encode(gzip.compress((PADDING + CREDENTIALS).encode())).decode(),
        "second-member": base64.b64encode(gzip.compress(b"first member\n") + gzip.compress(CREDENTIALS.encode())).decode(),
        "zlib": base64.b64encode(zlib.compress(CREDENTIALS.encode())).decode(),
        "gzip-as-hex": gzip.compress(CREDENTIALS.encode()).hex(),
    }


@pytest.mark.parametrize("carrier", list(_gzip_carriers()))
def test_a_compressed_credential_is_found_wrapped_late_in_a_second_member_as_zlib_or_hex(gate: Gate, carrier: str) -> None:
    text = _gzip_carriers()[carrier]
    data = f"backup:\n{text}\n".encode()
    found = [data[f.byte_start:f.byte_end] for f in gate.scan_secrets(data)]
    lines = text.split("\n")
    assert any(lines[0].encode() in s and lines[-1].encode() in s for s in found), (carrier, found)


def test_inflating_stops_at_one_budget_for_the_whole_document() -> None:
    import gzip

    from gate.unwrap import INFLATE_RATIO, MIN_INFLATE, readings
    bomb = base64.b64encode(gzip.compress(b"password=" + b"A" * 10_000_000)).decode()
    data = " ".join([bomb] * 20).encode()  # twenty bombs share one budget
    assert len(bomb) < 20_000
    budget = max(MIN_INFLATE, INFLATE_RATIO * len(data))
    assert all(len(r.data) <= len(data) + budget for r in readings(data))
