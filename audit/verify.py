"""Offline verification of an audit export or an erasure proof. Trusts nothing the gateway says.

Imports only the stdlib, cryptography, rfc8785, httpx (for ``verify_url``) and audit's pure
modules (merkle, note, records): no database, gateway or kernel code, so an auditor can run it
alone (``python -m audit.verify --export FILE``).

For an export the verifier rebuilds the whole tree from the records and checks, in one pass:
each record's position, leaf hash, schema and witness; each key rotation's signature by the key
it replaces; each checkpoint's signature by the key active at its size and its root against the
rebuilt tree; that every record is covered by a signed checkpoint (a rebuilt root equal to a
signed one proves the inclusion of every record under it); and that a trusted checkpoint, kept
from earlier, is a prefix of the export (the consistency check, made on the leaves themselves).
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import AuditError
from .merkle import CompactRange, InclusionProof, ProofError, hash_leaf
from .note import Checkpoint, NoteError, NoteVerifier
from .records import ERASURE_KINDS, body_errors, canonical, rotation_message, witness_errors

__all__ = ["VerifyReport", "verify_erasure_proof", "verify_export", "verify_url"]

EXPORT_FORMAT = "lethe-audit-export/1"
PROOF_FORMAT = "lethe-erasure-proof/1"


@dataclass
class VerifyReport:
    """``errors`` each name the failing record or checkpoint and the check; ``checked`` counts what passed."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def summary(self, max_errors: int = 20) -> str:
        lines = [f"FAIL: {e}" for e in self.errors[:max_errors]]
        if len(self.errors) > max_errors:
            lines.append(f"... and {len(self.errors) - max_errors} more errors")
        lines += [f"warning: {w}" for w in self.warnings]
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.checked.items()))
        lines.append(f"{'OK' if self.ok else 'FAILED'}: {counts}")
        return "\n".join(lines)


def _load(source: dict | str | Path) -> Any:
    if isinstance(source, dict):
        return source
    return json.loads(Path(source).read_text(encoding="utf-8"))


def _read_note(source: str | Path) -> str:
    """A checkpoint given as note text, or as a path to a file holding it."""
    if isinstance(source, str) and "\n" in source:
        return source
    return Path(source).read_text(encoding="utf-8")


class _KeyChain:
    """Which key signs checkpoints of which size: the genesis key, then each verified rotation."""

    def __init__(self, genesis: NoteVerifier) -> None:
        self._keys: list[tuple[int, NoteVerifier]] = [(0, genesis)]

    def at(self, size: int) -> NoteVerifier:
        return next(v for start, v in reversed(self._keys) if start <= size)

    def rotate(self, index: int, key: Mapping[str, Any]) -> str | None:
        """Apply a key-rotation record; return why it is invalid, or None."""
        active = self._keys[-1][1]
        if (key.get("old_key_name"), key.get("old_key_id")) != (active.name, active.key_id):
            return f"names old key {key.get('old_key_name')} {key.get('old_key_id')}, but {active.name} {active.key_id} is active"
        try:
            new = NoteVerifier.from_raw(str(key["new_key_name"]), base64.b64decode(key["new_public_key"], validate=True))
            signature = base64.b64decode(key["signature"], validate=True)
        except (KeyError, ValueError, NoteError) as e:
            return f"malformed new key or signature ({e})"
        if new.key_id != key.get("new_key_id"):
            return f"new key id {key.get('new_key_id')} does not match the new key ({new.key_id})"
        if not active.verify(rotation_message(key), signature):
            return f"hand-over is not signed by the old key {active.key_id}"
        self._keys.append((index + 2, new))  # checkpoint index + 1 is still signed by the old key
        return None

    def contains(self, verifier: NoteVerifier) -> bool:
        return any(v.raw == verifier.raw for _, v in self._keys)


def _parse_note(report: VerifyReport, note: str, label: str) -> Checkpoint | None:
    try:
        return Checkpoint.from_note(note)
    except NoteError as e:
        report.errors.append(f"{label}: malformed note: {e}")
        return None


def _check_signature(report: VerifyReport, cp: Checkpoint, origin: str, verifier: NoteVerifier, label: str) -> None:
    if cp.origin != origin:
        report.errors.append(f"{label} {cp.size}: origin {cp.origin!r} is not the log's {origin!r}")
    try:
        cp.verify(verifier)
        report.count("checkpoint_signatures")
    except NoteError as e:
        report.errors.append(f"{label} {cp.size}: signature: {e}")


def _check_record(report: VerifyReport, position: int, rec: Mapping[str, Any], chain: _KeyChain) -> None:
    label = f"record {position}"
    if rec.get("index") != position:
        report.errors.append(f"{label}: index {rec.get('index')} found at position {position} (records deleted, inserted or reordered)")
    body = rec.get("body", {})
    leaf = hash_leaf(canonical(body)).hex()
    if rec.get("leaf_hash") != leaf:
        report.errors.append(f"{label}: leaf hash {rec.get('leaf_hash')} does not match the body's {leaf}")
    report.errors += [f"{label}: schema: {e}" for e in body_errors(body)]
    report.errors += [f"{label}: witness: {e}" for e in witness_errors(body)]
    if body.get("kind") == "key-rotation" and isinstance(body.get("key"), Mapping):
        error = chain.rotate(position, body["key"])
        if error:
            report.errors.append(f"{label}: key rotation: {error}")
        else:
            report.count("key_rotations")
    report.count("records")


class _ExportCheck:
    """One pass over an export's records, checking each signed tree head as the tree reaches its size."""

    def __init__(self, report: VerifyReport, doc: Mapping[str, Any], trusted_note: str | None) -> None:
        self.report, self.origin = report, doc["origin"]
        genesis = doc["keys"][0]
        self.chain = _KeyChain(NoteVerifier.from_pem(genesis["name"], genesis["public_key_pem"]))
        self.tree, self.last_signed = CompactRange(), 0
        self.pending: dict[int, list[tuple[Checkpoint, str]]] = {}
        for note in doc["checkpoints"]:
            self._expect(note, "checkpoint")
        if trusted_note is not None:
            self._expect(trusted_note, "trusted checkpoint")

    def _expect(self, note: str, label: str) -> None:
        cp = _parse_note(self.report, note, label)
        if cp is not None:
            self.pending.setdefault(cp.size, []).append((cp, label))

    def run(self, records: list[Mapping[str, Any]]) -> None:
        self._reached()
        for position, rec in enumerate(records):
            _check_record(self.report, position, rec, self.chain)
            self.tree.append(hash_leaf(canonical(rec.get("body", {}))))
            self._reached()
        for size, cps in sorted(self.pending.items()):
            for _, label in cps:
                self.report.errors.append(
                    f"{label} {size}: covers {size} records but the export holds {len(records)}: the log was truncated"
                )
        if self.last_signed < len(records):
            self.report.errors.append(f"records {self.last_signed}..{len(records) - 1}: not covered by any signed checkpoint")
        else:
            self.report.count("records_included", len(records))

    def _reached(self) -> None:
        size, root = self.tree.size, self.tree.root()
        for cp, label in self.pending.pop(size, []):
            _check_signature(self.report, cp, self.origin, self.chain.at(size), label)
            if cp.root_hash == root:
                self.report.count("checkpoint_roots")
            elif label == "checkpoint":
                self.report.errors.append(
                    f"checkpoint {size}: root hash differs from the tree of records 0..{size - 1} "
                    f"(records {self.last_signed}..{size - 1} were modified, inserted, deleted or reordered)"
                )
            else:
                self.report.errors.append(f"{label} {size}: not consistent with the export: the log was rewritten")
            if label == "checkpoint":
                self.last_signed = size


def verify_export(
    export: dict | Path | str,
    *,
    trusted_checkpoint: str | Path | None = None,
    public_key_pem: str | None = None,
) -> VerifyReport:
    """Verify an export document (a dict or a file); see the module docstring for the checks."""
    report = VerifyReport()
    doc = _load(export)
    if doc.get("format") != EXPORT_FORMAT:
        report.errors.append(f"export: format {doc.get('format')!r} is not {EXPORT_FORMAT!r}")
        return report
    try:
        check = _ExportCheck(report, doc, _read_note(trusted_checkpoint) if trusted_checkpoint is not None else None)
        check.run(doc["records"])
    except (AuditError, KeyError, IndexError, TypeError, ValueError) as e:  # a malformed document, not a crash
        report.errors.append(f"export: malformed document ({e.__class__.__name__}: {e})")
        return report
    if public_key_pem is None:
        report.warnings.append("no trusted public key given: the export's own genesis key was trusted")
    elif not check.chain.contains(NoteVerifier.from_pem(doc["keys"][0]["name"], public_key_pem)):
        report.errors.append("public key: not the genesis key nor any rotated-in key of this log")
    return report


def verify_erasure_proof(proof: dict | Path | str, *, public_key_pem: str | None = None) -> VerifyReport:
    """Check one erasure proof: record hash, witness, checkpoint signature, inclusion in the checkpoint.

    ``public_key_pem`` is the key the auditor trusts; without it the proof's own key is used (and
    the report warns), which shows integrity but not who signed.
    """
    report = VerifyReport()
    doc = _load(proof)
    if doc.get("format") != PROOF_FORMAT:
        report.errors.append(f"proof: format {doc.get('format')!r} is not {PROOF_FORMAT!r}")
        return report
    rec, key = doc["record"], doc["public_key"]
    if public_key_pem is None:
        report.warnings.append("no trusted public key given: the proof's own key was trusted")
    verifier = NoteVerifier.from_pem(key["name"], public_key_pem or key["public_key_pem"])
    index = rec.get("index")
    _check_record(report, index, rec, _KeyChain(verifier))
    if rec["body"].get("kind") not in ERASURE_KINDS:
        report.warnings.append(f"record {index} is a {rec['body'].get('kind')} record, not an erasure")
    cp = _parse_note(report, doc["checkpoint"], "checkpoint")
    if cp is None:
        return report
    _check_signature(report, cp, cp.origin, verifier, "checkpoint")
    try:
        ip = InclusionProof.from_dict(doc["inclusion_proof"])
        if (ip.leaf_index, ip.tree_size) != (index, cp.size):
            raise ProofError(f"proof is for leaf {ip.leaf_index} in size {ip.tree_size}, not {index} in {cp.size}")
        ip.verify(hash_leaf(canonical(rec["body"])), cp.root_hash)
        report.count("inclusion_proofs")
    except (ProofError, KeyError, ValueError) as e:
        report.errors.append(f"record {index}: inclusion: {e}")
    return report


def verify_url(
    url: str,
    *,
    api_key: str,
    trusted_checkpoint: str | Path | None = None,
    public_key_pem: str | None = None,
    client: Any = None,
) -> VerifyReport:
    """Fetch ``GET {url}/v1/audit/export`` with an admin key and verify it like ``verify_export``.

    ``client`` is an ``httpx.Client`` to use (a test client, a proxy); by default a new one.
    """
    import httpx  # only this entry point needs it

    with client or httpx.Client(timeout=300.0) as http:
        response = http.get(url.rstrip("/") + "/v1/audit/export", headers={"Authorization": f"Bearer {api_key}"})
    response.raise_for_status()
    return verify_export(response.json(), trusted_checkpoint=trusted_checkpoint, public_key_pem=public_key_pem)


def main(argv: list[str] | None = None) -> int:
    """``python -m audit.verify``: the verifier without the gateway installed."""
    parser = argparse.ArgumentParser(prog="python -m audit.verify", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--export", type=Path, help="an export file (`lethe audit export`)")
    source.add_argument("--url", help="a gateway base URL; needs --api-key")
    source.add_argument("--proof", type=Path, help="an erasure proof (GET /v1/audit/erasures/N/proof)")
    parser.add_argument("--api-key")
    parser.add_argument("--trusted-checkpoint", type=Path, help="a checkpoint note saved earlier")
    parser.add_argument("--public-key", type=Path, help="the log's Ed25519 public key PEM")
    args = parser.parse_args(argv)
    pem = args.public_key.read_text() if args.public_key else None
    if args.proof:
        report = verify_erasure_proof(args.proof, public_key_pem=pem)
    elif args.url:
        if not args.api_key:
            parser.error("--url needs --api-key (an admin key)")
        report = verify_url(args.url, api_key=args.api_key, trusted_checkpoint=args.trusted_checkpoint, public_key_pem=pem)
    else:
        report = verify_export(args.export, trusted_checkpoint=args.trusted_checkpoint, public_key_pem=pem)
    print(report.summary(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
