"""Secrets layer: project rules plus an optional user ``gitleaks.toml``, one Hyperscan pass.

Hyperscan finds candidate spans; each candidate is then confirmed in Python (capture group,
keyword, entropy, checksum, allowlists) so that the expensive checks only run on the rare
spans that already look like credentials. Secret values never leave this module unmasked.
"""

from __future__ import annotations

import base64
import hashlib
import binascii
import json
import math
import re
import re._parser as sre_parse
import string
import tomllib
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from .dbcache import CompileCache
from .engine import MultiMatcher, Pattern, SpanMatcher, merge_spans
from .errors import GateError
from .findings import Finding

log = structlog.get_logger(__name__)

RULES_PATH = Path(__file__).parent / "rules" / "secrets.toml"
_B62 = string.digits + string.ascii_uppercase + string.ascii_lowercase


def mask(secret: str) -> str:
    """Audit-safe stand-in for a secret: a short prefix (never more than a quarter) and its length."""
    keep = min(4, len(secret) // 4)
    return f"{secret[:keep]}…({len(secret)} chars)"


def shannon_entropy(value: str) -> float:
    """Bits per character; random base62 tokens sit near 5, words and placeholders well below 4."""
    if not value:
        return 0.0
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in Counter(value).values())


def _github_crc32(secret: str) -> bool:
    """GitHub and npm tokens end in the base62 CRC32 of their 30 random characters."""
    body = secret.split("_", 1)[1]
    payload, check = body[:-6], body[-6:]
    n = zlib.crc32(payload.encode())
    digits = ""
    while n:
        n, d = divmod(n, 62)
        digits = _B62[d] + digits
    return digits.rjust(6, "0") == check


def _b64url_json(part: str) -> dict | None:
    try:
        value = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (ValueError, binascii.Error):
        return None
    return value if isinstance(value, dict) else None


def _jwt(secret: str) -> bool:
    header = _b64url_json(secret.split(".", 1)[0])
    return header is not None and "alg" in header


def _basic_auth(secret: str) -> bool:
    try:
        decoded = base64.b64decode(secret, validate=True).decode("utf-8")
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return False
    user, sep, password = decoded.partition(":")
    return bool(sep and user and len(password) >= 4)


_IDENTIFIER = re.compile(r"[A-Za-z_.\-]+|[0-9.,:_/\-]+|[a-z]+(?:[A-Z][a-z]+)+[0-9]?|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_PLACEHOLDER = re.compile(r"(?i)passw|secret|example|^anonymous|sample|changeme|dummy|placeholder|redacted|your|xxxx|\*\*\*|<|>|\.\.\.|^true$|^false$|^none$|^null$")


# tokens whose own rule verifies a checksum: a failed checksum means "not that token", not "generic secret"
_CHECKSUMMED = re.compile(r"(?:gh[pousr]|npm)_[A-Za-z0-9]{36}")
# a password's hash in a known scheme (Django, passlib, crypt, bcrypt, argon2): what a fixture or a
# user table stores instead of the password, not a credential (a blind set's fixtures file)
_PASSWORD_HASH = re.compile(r"(?:pbkdf2_sha(?:1|256|512)|pbkdf2|argon2(?:id|i|d)?|bcrypt(?:_sha256)?|scrypt|sha1|md5|sha256|sha512|crypt)\$|\$(?:2[abxy]?|5|6|y|argon2(?:id|i|d)?|scrypt|pbkdf2[-_a-z0-9]*)\$|\*[0-9A-F]{40}$")  # the last: MySQL's mysql_native_password


def _generic_value(secret: str) -> bool:
    """A value assigned to a password/key/token name that is a credential rather than code:
    not an identifier, dotted name, number, version, path or placeholder, and with a digit or
    symbol in it (random tokens of 8+ characters almost always have one; identifiers do not)."""
    if _PLACEHOLDER.search(secret) or secret.startswith(("/", "./", "~")) or _CHECKSUMMED.fullmatch(secret) \
            or _PASSWORD_HASH.match(secret):
        return False
    if _IDENTIFIER.fullmatch(secret) and not _random_case(secret):
        return False
    if "://" in secret or secret.lower().startswith(("http", "sha256:", "sha1:", "md5:")):
        return False
    return bool(re.search(r"[A-Za-z]", secret)) and (bool(re.search(r"[0-9!#%&*+=?@^~]", secret)) or _random_case(secret))


def _random_case(value: str) -> bool:
    """Letters in short case runs (``km-xhFSkVRkhg-n``: words of ~2 letters), unlike identifiers
    (``CustomGraphModulePass``, ``snake_case``: words of 4+ letters)."""
    words = re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", value)
    return len(value) >= 12 and bool(words) and sum(map(len, words)) / len(words) < 3



NAME_REACH = 40  # bytes before a match read by a context allowlist: the rest of the name it starts inside
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _bitcoin_wif(secret: str) -> bool:
    """Base58check with version byte 0x80 (mainnet private key), 33 or 34 bytes of payload."""
    n = 0
    for ch in secret:
        n = n * 58 + _BASE58.index(ch)
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    payload, check = raw[:-4], raw[-4:]
    return len(payload) in (33, 34) and payload[0] == 0x80 and \
        hashlib.sha256(hashlib.sha256(payload).digest()).digest()[:4] == check


def _session_value(secret: str) -> bool:
    """A session id: random letters and digits (a server's `node0….node0` or a Django key reads
    as a dotted or plain identifier to `_generic_value`, but random ids always carry a digit)."""
    return not _PLACEHOLDER.search(secret) and bool(re.search(r"[0-9]", secret)) and bool(re.search(r"[A-Za-z]", secret))


def _table_value(secret: str) -> bool:
    """A table cell under or beside a secret's name: a generic value, but not a short hex digest
    (`fly secrets list` and `docker images` print 12-16 hex digits where the value would be)."""
    return _generic_value(secret) and not re.fullmatch(r"[0-9a-f]{8,16}", secret)


_OPENSSH_KEY = b"openssh-key-v1\x00"
_KEY_LINE = re.compile(r"[A-Za-z0-9+/_-]{16,}")  # a key body's lines: the prefixes between them (`12→`, `<br>`, quotes) are shorter
_PBE_OIDS = (bytes.fromhex("2a864886f70d0105"), bytes.fromhex("2a864886f70d010c01"))  # PKCS#5 PBES1/PBES2, PKCS#12 PBE


def _der_length(der: bytes, at: int) -> tuple[int, int]:
    """The length of the DER element whose length octets start at `at`, and where its content starts."""
    if der[at] < 0x80:
        return der[at], at + 1
    n = der[at] & 0x7F
    return int.from_bytes(der[at + 1:at + 1 + n], "big"), at + 1 + n


def _der_private_key(secret: str) -> bool:
    """A private key's base64 body with no BEGIN/END lines, by what it decodes to: OpenSSH's
    `openssh-key-v1` magic, or the ASN.1 head of a private key format: a SEQUENCE, then the
    INTEGER version 0 or 1 and an INTEGER (PKCS#1 RSA and DSA), a SEQUENCE (PKCS#8's algorithm)
    or an OCTET STRING (SEC1 EC); the INTEGER version 3 and a SEQUENCE (a PKCS#12 bundle); or a
    SEQUENCE holding a PKCS#5 or PKCS#12 password-based encryption OID (PKCS#8 encrypted). A
    certificate, a CSR, a CMS message or a public key opens with another SEQUENCE or an OID of
    another family: they decode and are refused. The lines are read without what sits between
    them (line numbers, quotes, `<br>`: red team 15), and base64url as base64."""
    body = "".join(_KEY_LINE.findall(secret)).translate(str.maketrans("-_", "+/"))
    try:
        head = base64.b64decode(body[:min(64, len(body) // 4 * 4)], validate=True)
    except binascii.Error:
        return False
    if head.startswith(_OPENSSH_KEY):
        return len(body) >= 200  # magic, cipher, kdf, one public key and the private section
    if len(head) < 24 or head[0] != 0x30 or head[1] > 0x83:
        return False
    declared, at = _der_length(head, 1)
    if declared < 40:
        return False
    if head[at:at + 2] == b"\x02\x01":
        version, tag = head[at + 2], head[at + 3]
        return (version in (0, 1) and tag in (0x02, 0x30, 0x04)) or (version == 3 and tag == 0x30)
    if head[at] != 0x30 or head[at + 1] > 0x83:
        return False
    _, inner = _der_length(head, at + 1)
    return head[inner] == 0x06 and head[inner + 2:inner + 2 + head[inner + 1]].startswith(_PBE_OIDS)


CHECKSUMS: dict[str, Callable[[str], bool]] = {
    "session-value": _session_value,
    "table-value": _table_value,
    "github-crc32": _github_crc32,
    "jwt": _jwt,
    "basic-auth": _basic_auth,
    "generic-value": _generic_value,
    "bitcoin-wif": _bitcoin_wif,
    "der-private-key": _der_private_key,
}


@dataclass(frozen=True)
class Allowlist:
    """Values that look like secrets but are placeholders, docs keys or template variables."""

    regexes: tuple[re.Pattern[str], ...] = ()
    stopwords: tuple[str, ...] = ()

    def allows(self, secret: str) -> bool:
        low = secret.lower()
        return any(w in low for w in self.stopwords) or any(r.search(secret) for r in self.regexes)


@dataclass(frozen=True)
class SecretRule:
    id: str
    regex: str
    description: str = ""
    secret_group: int = 0
    caseless: bool = False
    keywords: tuple[str, ...] = ()
    entropy: float = 0.0
    checksum: str | None = None
    score: float = 0.9
    allowlist: Allowlist = field(default_factory=Allowlist)
    # read against the whole match, name included (gitleaks's `regexTarget = "match"`): what the
    # value is named says it is no credential (a CSRF token, a page cursor)
    context_allowlist: Allowlist = field(default_factory=Allowlist)
    examples: tuple[str, ...] = ()
    counterexamples: tuple[str, ...] = ()
    source: str = "lethe"
    global_allowlist: bool = True  # False where real keys contain what the global list rejects (AAAAAAA runs)
    window: int = 0  # longest possible match: confirm only around Hyperscan's match ends (0 = whole input)


def _compile_allow(regex: str) -> re.Pattern[str]:
    translated, caseless = _translate_re2(regex)
    return re.compile(translated, re.IGNORECASE if caseless else 0)


def _allowlist(table: dict) -> Allowlist:
    return Allowlist(
        regexes=tuple(_compile_allow(r) for r in table.get("regexes", [])),
        stopwords=tuple(w.lower() for w in table.get("stopwords", [])),
    )


def load_rules(path: Path = RULES_PATH) -> tuple[list[SecretRule], Allowlist]:
    """Parse the project rule file (schema documented at its top)."""
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    rules = [
        SecretRule(
            id=r["id"], regex=r["regex"], description=r.get("description", ""),
            secret_group=r.get("secret_group", 0), caseless=r.get("caseless", False),
            keywords=tuple(k.lower() for k in r.get("keywords", [])), entropy=r.get("entropy", 0.0),
            checksum=r.get("checksum"), score=r.get("score", 0.9),
            allowlist=_allowlist(r.get("allowlist", {})), context_allowlist=_allowlist(r.get("context_allowlist", {})),
            examples=tuple(r.get("examples", [])), counterexamples=tuple(r.get("counterexamples", [])),
            global_allowlist=r.get("global_allowlist", True), window=r.get("window", 0),
        )
        for r in doc["rules"]
    ]
    unknown = {r.checksum for r in rules if r.checksum} - CHECKSUMS.keys()
    if unknown:
        raise GateError(f"{path}: unknown checksum validator(s) {sorted(unknown)}; use one of {sorted(CHECKSUMS)}")
    return rules, _allowlist(doc.get("allowlist", {}))


_POSIX = {
    "[:alnum:]": "A-Za-z0-9", "[:alpha:]": "A-Za-z", "[:digit:]": "0-9", "[:xdigit:]": "0-9A-Fa-f",
    "[:upper:]": "A-Z", "[:lower:]": "a-z", "[:space:]": r"\s", "[:word:]": r"\w",
    "[:punct:]": r"!-/:-@\[-`{-~",
}


def _translate_re2(regex: str) -> tuple[str, bool]:
    """RE2 (Go) → Python/Hyperscan syntax for the constructs gitleaks configs actually use.

    Returns (regex, caseless): a leading ``(?i)`` becomes a flag because Hyperscan prefers it so.
    """
    caseless = regex.startswith("(?i)")
    if caseless:
        regex = regex[4:]
    for posix, cls in _POSIX.items():
        regex = regex.replace(posix, cls)
    regex = regex.replace(r"\z", r"\Z")
    regex = re.sub(r"\\x\{([0-9A-Fa-f]{1,4})\}", lambda m: "\\u" + m.group(1).rjust(4, "0"), regex)
    return regex, caseless


def _gitleaks_allowlists(table: dict) -> Allowlist:
    """Merge the v8 ``allowlist`` table and the newer ``allowlists`` array (paths are ignored)."""
    merged: dict[str, list[str]] = {"regexes": [], "stopwords": []}
    for al in [table.get("allowlist", {}), *table.get("allowlists", [])]:
        for key in merged:
            merged[key].extend(al.get(key, []))
    return _allowlist(merged)


def load_gitleaks(path: Path) -> tuple[list[SecretRule], Allowlist]:
    """Load a user's gitleaks.toml as an extra rule source; rules we cannot compile are skipped
    with a warning (path-only rules too: a tool result has no file path)."""
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise GateError(f"cannot read gitleaks config {path}: {exc}; pass a valid gitleaks.toml") from exc
    rules: list[SecretRule] = []
    for raw in doc.get("rules", []):
        rule_id = f"gitleaks:{raw.get('id', 'unnamed')}"
        if "regex" not in raw:
            log.warning("gitleaks_rule_skipped", rule_id=rule_id, reason="no regex (path-only rule)")
            continue
        regex, caseless = _translate_re2(raw["regex"])
        rule = SecretRule(
            id=rule_id, regex=regex, description=raw.get("description", ""),
            secret_group=int(raw.get("secretGroup", 0)), caseless=caseless,
            keywords=tuple(k.lower() for k in raw.get("keywords", [])),
            entropy=float(raw.get("entropy", 0.0)), score=0.8,
            allowlist=_gitleaks_allowlists(raw), source=str(path),
        )
        reason = _compile_problem(rule)
        if reason:
            log.warning("gitleaks_rule_skipped", rule_id=rule_id, reason=reason)
            continue
        rules.append(rule)
    return rules, _gitleaks_allowlists(doc)


def _compile_problem(rule: SecretRule) -> str | None:
    """Why a user rule cannot be used within the gate's time bound (None when it can)."""
    pattern = Pattern(0, rule.regex, caseless=rule.caseless)
    try:
        rx = re.compile(rule.regex)
    except re.error as exc:
        return f"python re: {exc}"
    if rule.secret_group > rx.groups:
        return f"secretGroup {rule.secret_group} > {rx.groups} groups"
    problem = MultiMatcher.hyperscan_error(pattern)
    if problem:
        return problem
    if _nested_unbounded(sre_parse.parse(rule.regex)):
        return ("not linear-safe: a repeat inside an unbounded repeat (like (a+)+) backtracks exponentially "
                "in Python re, which confirms matches; bound the outer or inner repeat (e.g. {1,64})")
    if _max_width(pattern) is None and not SpanMatcher([pattern]).has_start.get(0, False):
        return ("not linear-safe: its match length is unbounded (or over 4096 bytes) and Hyperscan has no "
                "start-of-match mode for it, so it would be confirmed over the whole text; bound its repeats "
                "(e.g. {1,256} for + or *)")
    return None


def _nested_unbounded(parsed: Iterable, inside: bool = False) -> bool:
    """Whether a repeat sits inside an unbounded repeat (star height 2) anywhere in the parse."""
    for op, arg in parsed:
        if op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, sre_parse.POSSESSIVE_REPEAT):
            low, high, body = arg
            if inside and high > 1:
                return True
            if _nested_unbounded(body, inside or high == sre_parse.MAXREPEAT):
                return True
        elif op is sre_parse.SUBPATTERN and _nested_unbounded(arg[-1], inside):
            return True
        elif op is sre_parse.BRANCH and any(_nested_unbounded(b, inside) for b in arg[1]):
            return True
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT) and _nested_unbounded(arg[1], inside):
            return True
    return False


WINDOW_REPORTS = 1024  # Hyperscan end reports per rule before confirmation falls back to the whole text
MAX_WINDOW = 4096  # widest rule confirmed in windows; wider (or unbounded) rules read the whole text


def _max_width(pattern: Pattern) -> int | None:
    """Longest match of the pattern in bytes (None if unbounded or over MAX_WINDOW)."""
    try:
        widest = sre_parse.parse(pattern.regex.encode("utf-8")).getwidth()[1]
    except re.error:
        return None
    return widest if widest <= MAX_WINDOW else None


class SecretScanner:
    """All secret rules compiled into one matcher."""

    def __init__(self, rules: Iterable[SecretRule], allowlist: Allowlist, *, cache: CompileCache | None = None) -> None:
        self.rules = list(rules)
        self.allowlist = allowlist
        patterns = [Pattern(i, r.regex, caseless=r.caseless, window=r.window) for i, r in enumerate(self.rules)]
        self.matcher = MultiMatcher(patterns, cache=cache)
        self._ends = SpanMatcher(patterns, limit=WINDOW_REPORTS, cache=cache)
        self._width = {p.ident: _max_width(p) or (p.window or None) for p in patterns}

    def _matches(self, data: bytes) -> Iterator[tuple[int, re.Match[bytes]]]:
        """Every ``re`` match of every flagged rule, confirmed only where Hyperscan reported one: in
        the exact [start, end] spans of rules Hyperscan compiles in start-of-match mode, else in
        the windows [end - W, end] of a rule of bounded width W (at most WINDOW_REPORTS reports,
        else the whole text). Only rules with neither read the whole text, which their regexes
        keep linear (each scan stops at a delimiter or the next start)."""
        for ident in self.matcher.triggered(data):
            rx, width = self.matcher._python[ident], self._width[ident]
            som = self._ends.has_start.get(ident, False)
            reports = self._ends.reports(ident, data) if width is not None or som else []
            if not reports or len(reports) >= WINDOW_REPORTS:
                yield from ((ident, m) for m in rx.finditer(data))
                continue
            seen: set[tuple[int, int]] = set()
            windows = ((s, e) if som else (max(0, e - width), e) for s, e in reports)  # type: ignore[operator]
            for lo, hi in merge_spans(windows):
                for m in rx.finditer(data, lo, hi):
                    if m.span() not in seen:
                        seen.add(m.span())
                        yield ident, m

    def scan(self, data: bytes) -> list[Finding]:
        """Confirm every match of every flagged rule. A match text seen before in this scan reuses
        its verdict, so 4 000 copies of one token cost one confirmation, not 4 000."""
        verdicts: dict[tuple[int, bytes], str | None] = {}
        out = []
        for ident, found in self._matches(data):
            rule = self.rules[ident]
            group = rule.secret_group if rule.secret_group <= (found.re.groups or 0) else 0
            key = (ident, found.group(0))
            if key not in verdicts:
                verdicts[key] = self._confirm(rule, found, group)
            verdict = verdicts[key]
            if verdict is not None:
                s, e = found.span(group)
                out.append(Finding("secret", rule.id, "rules", s, e, rule.score, verdict))
        return out

    @staticmethod
    def _named_otherwise(rule: SecretRule, found: re.Match[bytes]) -> bool:
        """The rule's context allowlist finds the match, or the name it starts inside
        (`next_page_token` for a match from `_token`), a non-credential."""
        start = found.start()
        context = found.string[max(0, start - NAME_REACH):found.end()]
        return rule.context_allowlist.allows(context.decode("utf-8", "replace"))

    def _confirm(self, rule: SecretRule, found: re.Match[bytes], group: int) -> str | None:
        """The masked secret if this match is a credential, else None."""
        if found.group(group) is None:
            return None
        secret = found.group(group).decode("utf-8", "replace")
        if rule.keywords and not any(k.encode() in found.group(0).lower() for k in rule.keywords):
            return None
        if shannon_entropy(secret) < rule.entropy:
            return None
        if rule.checksum and not CHECKSUMS[rule.checksum](secret):
            return None
        if (rule.global_allowlist and self.allowlist.allows(secret)) or rule.allowlist.allows(secret):
            return None
        if rule.context_allowlist.regexes and self._named_otherwise(rule, found):
            return None
        return mask(secret)
