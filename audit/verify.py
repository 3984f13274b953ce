"""Offline verification of an audit export or an erasure proof. Trusts nothing the gateway says.

Imports only the stdlib, cryptography, rfc8785, orjson, httpx (for ``verify_url``) and audit's pure
modules (merkle, note, records, rules, strict): no database, gateway or kernel code, so an auditor
can run it alone (``python -m audit.verify --export FILE --public-key KEY.pem``).

An export is verified in these steps (the numbers are the ``# Step N`` comments below):

1. Read strictly: UTF-8 (a byte-order mark is accepted), JSON with no duplicate name in any
   object and no NaN, and the export's shape: every field present and of its type. Malformed
   input stops here, with one line naming the place (exit code 2). A file laid out exactly as the
   log writes it (``audit.layout``) is read faster, a block at a time, by orjson, and proven free
   of duplicate names and canonical by comparison with the layout of its own parse
   (``audit.verify_records``), on two cores in two processes.
2. Replay the records, rebuilding the RFC 9162 tree: each record's position, its leaf hash
   (SHA-256 of 0x00 and its RFC 8785 bytes), its schema, its witness (``audit.rules``, the rules
   the log applied when it wrote it; ``audit.accept`` vouches for most records a column at a
   time), and each key rotation: signed by the key it replaces, for this log's origin.
3. Each checkpoint, when the tree reaches its size: signed by the key active at that size, with
   the root of the rebuilt tree (a rebuilt root equal to a signed one proves the inclusion of
   every record under it). Checkpoints come in increasing size.
4. The trusted checkpoint, if given: the rebuilt tree has its root at its size (the log was only
   appended to since) and the key active at that size signed it.
5. Coverage: every record lies under a signed checkpoint, and no checkpoint lies past the last
   record (a truncated log).
6. The unsigned header: ``size`` is the number of records; ``keys`` is exactly the genesis key
   followed by the keys the verified rotations handed over to, each from its size.
7. The root of trust. A pinned public key must be the genesis key (every rotation after it was
   checked in step 2) or the key that signed the trusted checkpoint; a rotation *to* the pinned
   key proves nothing, since whoever holds the key it rotates from can write one. A trusted
   checkpoint alone anchors the log at its size. With neither, the export is only shown to be
   internally consistent (anyone can sign a consistent export), which fails unless ``no_anchor``.

An erasure proof (``verify_erasure_proof``) is verified in four steps:

1. Read strictly, as above.
2. The record: leaf hash, schema, witness, and an erasure kind (an amortize is never an erasure).
3. The checkpoint: signed by the pinned key (the proof's own key only with ``no_anchor``).
4. The inclusion of the record's leaf in that checkpoint (RFC 9162 section 2.1.3.2).

Exit codes of the command line: 0 verified, 1 a check failed, 2 malformed input or an unusable source.
"""
from __future__ import annotations

import argparse
import base64
import gc
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .errors import AuditError
from .layout import EXPORT_FORMAT
from .merkle import CompactRange, InclusionProof, ProofError
from .note import Checkpoint, NoteError, NoteVerifier
from .records import rotation_message
from .rules import ERASURE_KINDS
from .strict import Malformed, expect, fields, load_json, read_bytes, read_text
from .verify_records import PARALLEL_FROM, Findings, findings, layout_findings, layout_head, record_findings

__all__ = ["VerifyReport", "run", "verify_erasure_proof", "verify_export", "verify_url"]

PROOF_FORMAT = "lethe-erasure-proof/1"

_EXPORT = {"format": str, "origin": str, "size": int, "keys": list, "checkpoints": list, "records": list}
_KEY = {"key_id": str, "name": str, "public_key_pem": str, "from_size": int}
_RECORD = {"index": int, "leaf_hash": str, "body": dict}
_PROOF = {"format": str, "record": dict, "checkpoint": str, "inclusion_proof": dict, "public_key": dict}
_PROOF_RECORD = {**_RECORD, "time": str}
_INCLUSION = {"leaf_index": int, "tree_size": int, "hashes": list}
_PROOF_KEY = {"name": str, "key_id": str, "public_key_pem": str}

NO_ANCHOR = (
    "no root of trust given: the export is internally consistent, but anyone can sign a consistent "
    "export; pin the log's key (--public-key) or a checkpoint saved earlier (--trusted-checkpoint), "
    "or pass --no-anchor to accept internal consistency only"
)


@dataclass
class VerifyReport:
    """``errors`` each name the place and the check; ``checked`` counts what passed.

    ``malformed`` is set when an input could not be read as what it must be (exit code 2);
    ``anchor`` says what the verdict is anchored to (the root of trust); ``processes``, how many
    read the records (the verdict does not depend on it).
    """

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    malformed: bool = False
    anchor: str = ""
    processes: int = 1

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 2 if self.malformed else 1

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def refuse(self, e: Malformed) -> VerifyReport:
        self.errors.append(str(e))
        self.malformed = True
        return self

    def summary(self, max_errors: int = 20) -> str:
        lines = [f"FAIL: {e}" for e in self.errors[:max_errors]]
        if len(self.errors) > max_errors:
            lines.append(f"... and {len(self.errors) - max_errors} more errors")
        lines += [f"warning: {w}" for w in self.warnings]
        if self.anchor:
            lines.append(f"anchored to: {self.anchor}")
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.checked.items()))
        verdict = "OK" if self.ok else "MALFORMED INPUT" if self.malformed else "FAILED"
        lines.append(f"{verdict}: {counts}" if counts else verdict)
        return "\n".join(lines)


# --- reading (step 1) --------------------------------------------------------------------------

def _document(source: dict | str | Path, where: str) -> Any:
    return source if isinstance(source, dict) else load_json(read_bytes(source, where), where)


def _shape(parsed: Any) -> dict[str, Any]:
    """The export's header and checkpoints, checked for their fields and types."""
    doc = fields(parsed, "export", _EXPORT)
    if doc["format"] != EXPORT_FORMAT:
        raise Malformed("export.format", f"{doc['format']!r} is not {EXPORT_FORMAT!r}")
    if not doc["origin"] or "\n" in doc["origin"]:
        raise Malformed("export.origin", "must be one non-empty line")
    if not doc["keys"]:
        raise Malformed("export.keys", "must list at least the genesis key")
    for i, key in enumerate(doc["keys"]):
        fields(key, f"export.keys[{i}]", _KEY)
    for i, note in enumerate(doc["checkpoints"]):
        expect(note, str, f"export.checkpoints[{i}]")
    return doc


def _read_export(source: dict | str | Path, workers: int | None, signed: _Signed) -> tuple[dict[str, Any], Findings]:
    """Step 1, and step 2 for each record on its own: the export, shape-checked, and its records' findings.

    A file in the log's layout is read a block at a time, maybe in two processes (``verify_records``;
    ``signed`` gets the signature checks done meanwhile); anything else, or a layout whose header
    is malformed, is read strictly and whole, and its records checked one at a time.
    """
    data = None if isinstance(source, dict) else read_bytes(source, "export")
    head = None if data is None else layout_head(data)
    if data is not None and head is not None:
        doc, start, end = head
        try:
            _shape(doc)
        except Malformed:
            pass  # the strict reader names the first fault in the file
        else:
            found = layout_findings(data, start, end, workers=_workers(workers, end - start),
                                    meanwhile=lambda: signed.update(_presigned(doc)))
            if found is not None:
                return doc, found
    doc = _shape(source if data is None else load_json(data, "export"))
    for i, rec in enumerate(doc["records"]):
        fields(rec, f"export.records[{i}]", _RECORD)
    return doc, findings(doc["records"])


def _checkpoint(note: str, where: str) -> Checkpoint:
    try:
        return Checkpoint.from_note(note)
    except ValueError as e:  # NoteError, or a note that is not even text lines
        raise Malformed(where, f"not a signed checkpoint note ({e})") from None


def _trusted_note(source: str | Path) -> str:
    """A checkpoint given as note text, or as a path to a file holding it."""
    if isinstance(source, str) and "\n" in source:
        return source
    return read_text(source, f"trusted checkpoint {source}")


def _verifier(name: str, pem: str, where: str) -> NoteVerifier:
    try:
        return NoteVerifier.from_pem(name, pem)
    except NoteError as e:
        raise Malformed(where, f"not an Ed25519 public key in PEM form ({e})") from None


def _guarded(check: Any) -> VerifyReport:
    """Run a verification; a malformed input becomes a report (exit code 2), never a traceback.

    The cyclic garbage collector is paused meanwhile: parsing an export makes millions of objects
    and no cycles, and its passes would cost a quarter of the time.
    """
    report, collecting = VerifyReport(), gc.isenabled()
    gc.disable()
    try:
        check(report)
    except Malformed as e:
        return VerifyReport(malformed=True, errors=[*report.errors, str(e)])
    finally:
        if collecting:
            gc.enable()
    return report


# --- the key chain (steps 2 and 7) -------------------------------------------------------------

class _KeyChain:
    """Which key signs checkpoints of which size: the genesis key, then each verified rotation."""

    def __init__(self, genesis: NoteVerifier, origin: str) -> None:
        self.keys: list[tuple[int, NoteVerifier]] = [(0, genesis)]
        self.origin = origin

    @property
    def genesis(self) -> NoteVerifier:
        return self.keys[0][1]

    def at(self, size: int) -> NoteVerifier:
        return next(v for start, v in reversed(self.keys) if start <= size)

    def rotate(self, index: int, key: Mapping[str, str]) -> str | None:
        """Apply a key-rotation record (its fields are strings: checked by its schema); return why it is invalid, or None."""
        active = self.keys[-1][1]
        if key["origin"] != self.origin:
            return f"hands over log {key['origin']!r}, not this log {self.origin!r}"
        if (key["old_key_name"], key["old_key_id"]) != (active.name, active.key_id):
            return f"names old key {key['old_key_name']} {key['old_key_id']}, but {active.name} {active.key_id} is active"
        try:
            new = NoteVerifier.from_raw(key["new_key_name"], base64.b64decode(key["new_public_key"], validate=True))
            signature = base64.b64decode(key["signature"], validate=True)
        except ValueError as e:  # NoteError, binascii.Error
            return f"malformed new key or signature ({e})"
        if new.key_id != key["new_key_id"]:
            return f"new key id {key['new_key_id']} does not match the new key ({new.key_id})"
        try:
            message = rotation_message(key)
        except AuditError as e:
            return f"the hand-over is not canonical JSON ({e})"
        if not active.verify(message, signature):
            return f"hand-over is not signed by the old key {active.key_id}"
        self.keys.append((index + 2, new))  # the checkpoint covering the rotation is still the old key's
        return None


# --- one record (step 2 of both) ---------------------------------------------------------------

def _rotate(report: VerifyReport, chain: _KeyChain, position: int, key: Mapping[str, str]) -> None:
    error = chain.rotate(position, key)
    if error:
        report.errors.append(f"record {position}: key rotation: {error}")
    else:
        report.count("key_rotations")


def _check_record(report: VerifyReport, position: int, rec: Mapping[str, Any]) -> bytes:
    """Step 2 for one record with no key chain (an erasure proof); return its leaf hash."""
    leaf, messages, _ = record_findings(position, rec)
    report.errors += messages
    return leaf


# --- an export ---------------------------------------------------------------------------------

_Signed = dict[tuple[str, bytes], "str | None"]  # (note, public key) -> why its signature fails, or None


def _signature_error(cp: Checkpoint, verifier: NoteVerifier) -> str | None:
    try:
        cp.verify(verifier)
    except NoteError as e:
        return str(e)
    return None


def _presigned(doc: Mapping[str, Any]) -> _Signed:
    """Each checkpoint's signature checked against the genesis key, ahead of the pass over the
    records (while another process reads some of them): the key chain decides in that pass which
    key had to sign each one, and uses these where it is the genesis key. Malformed keys and
    notes are left for that pass to name."""
    genesis = doc["keys"][0]
    try:
        verifier = NoteVerifier.from_pem(genesis["name"], genesis["public_key_pem"])
    except NoteError:
        return {}
    signed: _Signed = {}
    for note in doc["checkpoints"]:
        try:
            signed[(note, verifier.raw)] = _signature_error(Checkpoint.from_note(note), verifier)
        except ValueError:  # not a checkpoint note
            continue
    return signed


class _ExportCheck:
    """One pass over an export's records, checking each signed tree head as the tree reaches its size."""

    def __init__(self, report: VerifyReport, doc: Mapping[str, Any], trusted: Checkpoint | None, signed: _Signed) -> None:
        self.report, self.doc, self.origin, self.signed = report, doc, doc["origin"], signed
        genesis = doc["keys"][0]
        self.chain = _KeyChain(_verifier(genesis["name"], genesis["public_key_pem"], "export.keys[0]"), self.origin)
        self.tree, self.last_signed = CompactRange(), 0
        self.trusted, self.trusted_ok = trusted, False
        self.trusted_signer: NoteVerifier | None = None
        self.pending: dict[int, list[tuple[Checkpoint, str]]] = {}
        checkpoints = [_checkpoint(n, f"export.checkpoints[{i}]") for i, n in enumerate(doc["checkpoints"])]
        sizes = [cp.size for cp in checkpoints]
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            report.errors.append(f"export.checkpoints: sizes {sizes[:8]}... are not strictly increasing (checkpoints reordered or repeated)")
        for cp in checkpoints:
            self.pending.setdefault(cp.size, []).append((cp, "checkpoint"))
        if trusted is not None:
            self.pending.setdefault(trusted.size, []).append((trusted, "trusted checkpoint"))

    def run(self, found: Findings) -> None:
        """Steps 2 (in order: each record's messages and key rotation in its place) to 6, given
        step 2 for each record on its own (``found``)."""
        n, notes, tree = found.count, found.notes, self.tree
        self._reached()
        done = 0
        for position in sorted({*notes, *(size - 1 for size in self.pending if 0 < size <= n)}):
            tree.extend(found.leaves[32 * done : 32 * (position + 1)])
            done = position + 1
            if position in notes:
                messages, key = notes[position]
                self.report.errors += messages
                if key is not None:
                    _rotate(self.report, self.chain, position, key)
            self._reached()
        tree.extend(found.leaves[32 * done : 32 * n])
        if n:
            self.report.count("records", n)
        for size, cps in sorted(self.pending.items()):  # Step 5
            for _, label in cps:
                self.report.errors.append(f"{label} {size}: covers {size} records but the export holds {n}: the log was truncated")
        if self.last_signed < n:
            self.report.errors.append(f"records {self.last_signed}..{n - 1}: not covered by any signed checkpoint")
        else:
            self.report.count("records_included", n)
        self._header(n)  # Step 6

    def _reached(self) -> None:
        """Steps 3 and 4: the checkpoints (and the trusted one) at the tree's current size."""
        size = self.tree.size
        if size not in self.pending:
            return
        root = self.tree.root()
        for cp, label in self.pending.pop(size):
            signer = self.chain.at(size)
            signed = self._signature(cp, signer, label)
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
            else:
                self.trusted_ok, self.trusted_signer = signed and cp.root_hash == root, signer

    def _signature(self, cp: Checkpoint, verifier: NoteVerifier, label: str) -> bool:
        if cp.origin != self.origin:
            self.report.errors.append(f"{label} {cp.size}: origin {cp.origin!r} is not the log's {self.origin!r}")
            return False
        key = (cp.note, verifier.raw)
        error = self.signed[key] if key in self.signed else _signature_error(cp, verifier)
        if error is not None:
            self.report.errors.append(f"{label} {cp.size}: signature: {error}")
            return False
        self.report.count("checkpoint_signatures")
        return True

    def _header(self, n: int) -> None:
        """Step 6: the parts of the export no signature covers must agree with the signed ones."""
        if self.doc["size"] != n:
            self.report.errors.append(f"export.size: says {self.doc['size']} records, but the export holds {n}")
        keys = self.doc["keys"]
        if len(keys) != len(self.chain.keys):
            self.report.errors.append(
                f"export.keys: lists {len(keys)} keys, but the genesis key and the verified rotations make {len(self.chain.keys)}"
            )
        for i, (key, (start, verifier)) in enumerate(zip(keys, self.chain.keys)):
            listed = (key["name"], key["key_id"], key["public_key_pem"], key["from_size"])
            if listed != (verifier.name, verifier.key_id, verifier.public_key_pem, start):
                self.report.errors.append(
                    f"export.keys[{i}]: {key['name']} {key['key_id']} from size {key['from_size']} is not "
                    f"{verifier.name} {verifier.key_id} from size {start} (in its one PEM spelling), as the records say"
                )


def _workers(asked: int | None, size: int) -> int:
    """Processes to read ``size`` bytes of records in: as asked, else 2 from ``PARALLEL_FROM`` bytes where this process may use two cores."""
    if asked is not None:
        return asked
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 2 if size >= PARALLEL_FROM and cores >= 2 else 1


def _anchor(report: VerifyReport, check: _ExportCheck, pinned: NoteVerifier | None, no_anchor: bool) -> None:
    """Step 7: the root of trust."""
    trusted = check.trusted
    if pinned is not None:
        if pinned.raw == check.chain.genesis.raw:
            report.anchor = f"the pinned key is the genesis key {check.chain.genesis.key_id}; every rotation chains from it"
        elif trusted is not None and check.trusted_ok and check.trusted_signer is not None and check.trusted_signer.raw == pinned.raw:
            report.anchor = f"the pinned key {check.trusted_signer.key_id} signed the trusted checkpoint {trusted.size}"
        else:
            report.errors.append(
                "root of trust: the pinned public key is not this log's genesis key"
                + (" nor the key that signed the trusted checkpoint" if trusted is not None else "")
                + "; a key rotation to it inside the export proves nothing (whoever holds the key it rotates from "
                "can write one): pin the genesis key, or add a checkpoint the pinned key signed (--trusted-checkpoint)"
            )
    elif trusted is not None:
        if check.trusted_ok:
            report.anchor = f"the trusted checkpoint {trusted.size} (records 0..{trusted.size - 1} are the ones it covered)"
    elif no_anchor:
        report.warnings.append("no root of trust (--no-anchor): this shows internal consistency only, not that this is the real log")
    else:
        report.errors.append(f"root of trust: {NO_ANCHOR}")


def verify_export(
    export: dict | Path | str,
    *,
    trusted_checkpoint: str | Path | None = None,
    public_key_pem: str | None = None,
    no_anchor: bool = False,
    workers: int | None = None,
) -> VerifyReport:
    """Verify an export (a file, or a dict as ``json.load`` returns it); see the module docstring.

    ``trusted_checkpoint`` is a note (text, or a path to a file); ``public_key_pem`` the pinned key.
    ``workers`` (for a file in the log's layout): 1 reads every record in this process; 2 reads
    a part of them in a forked one (the same report, word for word; one process where there is no
    fork); by default 2 from ``PARALLEL_FROM`` bytes of records where there are two cores.
    """

    def check(report: VerifyReport) -> None:
        signed: _Signed = {}
        doc, found = _read_export(export, workers, signed)  # Step 1, and step 2 for each record on its own
        report.processes = found.processes
        pinned = _verifier("pinned", public_key_pem, "public key") if public_key_pem is not None else None
        trusted = _checkpoint(_trusted_note(trusted_checkpoint), "trusted checkpoint") if trusted_checkpoint is not None else None
        run = _ExportCheck(report, doc, trusted, signed)
        run.run(found)  # Steps 2 to 6
        _anchor(report, run, pinned, no_anchor)  # Step 7

    return _guarded(check)


# --- an erasure proof --------------------------------------------------------------------------

def _read_proof(source: dict | str | Path) -> dict[str, Any]:
    doc = fields(_document(source, "proof"), "proof", _PROOF)
    if doc["format"] != PROOF_FORMAT:
        raise Malformed("proof.format", f"{doc['format']!r} is not {PROOF_FORMAT!r}")
    fields(doc["record"], "proof.record", _PROOF_RECORD)
    fields(doc["public_key"], "proof.public_key", _PROOF_KEY)
    ip = fields(doc["inclusion_proof"], "proof.inclusion_proof", _INCLUSION)
    for i, h in enumerate(ip["hashes"]):
        if not (isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)):
            raise Malformed(f"proof.inclusion_proof.hashes[{i}]", "must be 64 lowercase hex digits")
    return doc


def verify_erasure_proof(proof: dict | Path | str, *, public_key_pem: str | None = None, no_anchor: bool = False) -> VerifyReport:
    """Check one erasure proof (see the module docstring). ``public_key_pem`` is the key the
    auditor trusts to have signed the proof's checkpoint; without it (and ``no_anchor``) the
    proof's own key is used, which shows integrity but not who signed."""

    def check(report: VerifyReport) -> None:
        doc = _read_proof(proof)  # Step 1
        rec, key = doc["record"], doc["public_key"]
        cp = _checkpoint(doc["checkpoint"], "proof.checkpoint")
        if public_key_pem is None and not no_anchor:
            report.errors.append(
                "root of trust: none given: the proof carries its own key, and anyone can sign a consistent proof; "
                "pin the key that signed its checkpoint (--public-key), or pass --no-anchor to accept integrity only"
            )
        verifier = _verifier(key["name"], public_key_pem or key["public_key_pem"], "public key" if public_key_pem else "proof.public_key")
        report.anchor = f"the {'pinned' if public_key_pem else 'proof’s own (--no-anchor)'} key {verifier.key_id}"
        index = rec["index"]
        leaf = _check_record(report, index, rec)  # Step 2
        report.count("records")
        if rec["time"] != rec["body"].get("time"):
            report.errors.append(f"record {index}: time {rec['time']!r} is not the signed body's {rec['body'].get('time')!r}")
        kind = rec["body"].get("kind")
        if not isinstance(kind, str) or kind not in ERASURE_KINDS:
            report.errors.append(f"record {index}: a {kind!r} record is not an erasure (erasures: {sorted(ERASURE_KINDS)}); it proves no erasure")
        try:  # Step 3
            cp.verify(verifier)
            report.count("checkpoint_signatures")
        except NoteError as e:
            report.errors.append(f"checkpoint {cp.size}: signature: {e}")
        try:  # Step 4
            ip = InclusionProof.from_dict(doc["inclusion_proof"])
            if (ip.leaf_index, ip.tree_size) != (index, cp.size):
                raise ProofError(f"proof is for leaf {ip.leaf_index} in size {ip.tree_size}, not {index} in {cp.size}")
            ip.verify(leaf, cp.root_hash)
            report.count("inclusion_proofs")
        except ProofError as e:
            report.errors.append(f"record {index}: inclusion: {e}")

    return _guarded(check)


# --- from a gateway ----------------------------------------------------------------------------

MAX_EXPORT_BYTES = 2 << 30  # ~2 million records; a bigger log is fetched with `lethe audit export`
FETCH_DEADLINE_S = 600.0  # the whole download, however slowly the server sends


def _fetch(url: str, api_key: str, client: Any, max_bytes: int, deadline_s: float) -> Any:
    """The export's bytes, streamed with a size cap and an overall deadline: the server being
    audited must not be able to exhaust the auditor's memory or hold the verifier forever."""
    import httpx  # only this entry point needs it

    endpoint = url.rstrip("/") + "/v1/audit/export"
    where = f"--url {endpoint}"
    try:
        with client or httpx.Client(timeout=60.0) as http, \
                http.stream("GET", endpoint, headers={"Authorization": f"Bearer {api_key}"}) as response:
            if response.status_code != 200:
                hint = "; give an admin API key (--api-key or LETHE_API_KEY)" if response.status_code in (401, 403) else ""
                raise Malformed(where, f"answered HTTP {response.status_code} {response.reason_phrase}{hint}")
            body = _capped_body(response.iter_bytes(), where, max_bytes, time.monotonic() + deadline_s)
    except Malformed:
        raise
    except (httpx.HTTPError, ValueError) as e:  # unreachable, timed out, or not a URL
        raise Malformed(where, f"cannot fetch the export ({type(e).__name__}: {e})") from None
    return load_json(body, f"reply of {endpoint}")


def _capped_body(chunks: Any, where: str, max_bytes: int, deadline: float) -> bytes:
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise Malformed(where, f"sent more than {max_bytes} bytes; fetch a log this large with "
                                   "`lethe audit export --out F` and verify it with --export F")
        if time.monotonic() > deadline:
            raise Malformed(where, "did not finish sending the export in time; fetch it with "
                                   "`lethe audit export --out F` and verify it with --export F")
    return bytes(body)


def verify_url(
    url: str,
    *,
    api_key: str,
    trusted_checkpoint: str | Path | None = None,
    public_key_pem: str | None = None,
    no_anchor: bool = False,
    client: Any = None,
    max_bytes: int = MAX_EXPORT_BYTES,
    deadline_s: float = FETCH_DEADLINE_S,
) -> VerifyReport:
    """Fetch ``GET {url}/v1/audit/export`` with an admin key and verify it like ``verify_export``.

    ``client`` is an ``httpx.Client`` to use (a test client, a proxy); by default a new one. A reply
    over ``max_bytes`` or still arriving after ``deadline_s`` is refused.
    """
    try:
        doc = _fetch(url, api_key, client, max_bytes, deadline_s)
    except Malformed as e:
        return VerifyReport().refuse(e)
    if not isinstance(doc, dict):
        return VerifyReport().refuse(Malformed(f"reply of {url}", "must be an export object"))
    return verify_export(doc, trusted_checkpoint=trusted_checkpoint, public_key_pem=public_key_pem, no_anchor=no_anchor)


# --- the command line --------------------------------------------------------------------------

def run(
    *,
    export: Path | None = None,
    url: str | None = None,
    proof: Path | None = None,
    api_key: str | None = None,
    trusted_checkpoint: Path | None = None,
    public_key: Path | None = None,
    no_anchor: bool = False,
    out: IO[str] | None = None,
) -> int:
    """Verify one source, print the report once (stdout if it passed, else stderr), return the exit code.

    Shared by ``python -m audit.verify`` and ``lethe audit verify``.
    """
    try:
        pem = read_text(public_key, f"public key {public_key}") if public_key is not None else None
    except Malformed as e:
        report = VerifyReport().refuse(e)
    else:
        if proof is not None:
            report = verify_erasure_proof(proof, public_key_pem=pem, no_anchor=no_anchor)
        elif url is not None:
            report = verify_url(url, api_key=api_key or "", trusted_checkpoint=trusted_checkpoint, public_key_pem=pem, no_anchor=no_anchor)
        else:
            assert export is not None
            report = verify_export(export, trusted_checkpoint=trusted_checkpoint, public_key_pem=pem, no_anchor=no_anchor)
    text = report.summary().encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates from the input, escaped
    print(text, file=out or (sys.stdout if report.ok else sys.stderr))
    return report.exit_code


def main(argv: list[str] | None = None) -> int:
    """``python -m audit.verify``: the verifier without the gateway installed."""
    parser = argparse.ArgumentParser(
        prog="python -m audit.verify", description=__doc__.splitlines()[0],
        epilog="exit codes: 0 verified, 1 a check failed, 2 malformed input or an unusable source",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--export", type=Path, help="an export file (`lethe audit export`)")
    source.add_argument("--url", help="a gateway base URL; needs --api-key")
    source.add_argument("--proof", type=Path, help="an erasure proof (GET /v1/audit/erasures/N/proof)")
    parser.add_argument("--api-key")
    parser.add_argument("--trusted-checkpoint", type=Path, help="a checkpoint note saved earlier (a root of trust)")
    parser.add_argument("--public-key", type=Path, help="the log's genesis Ed25519 public key PEM, or the signer of --trusted-checkpoint (a root of trust)")
    parser.add_argument("--no-anchor", action="store_true", help="accept an export with no root of trust (internal consistency only)")
    args = parser.parse_args(argv)
    if args.url and not args.api_key:
        parser.error("--url needs --api-key (an admin key)")
    return run(export=args.export, url=args.url, proof=args.proof, api_key=args.api_key,
               trusted_checkpoint=args.trusted_checkpoint, public_key=args.public_key, no_anchor=args.no_anchor)


if __name__ == "__main__":
    sys.exit(main())
