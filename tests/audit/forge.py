"""An attacker's toolkit for exports: rehash records, rebuild the tree, re-sign with any key.

What an outside attacker who holds some key (their own, or a stolen one) can produce: every
signature in the result verifies; only the verifier's roots of trust and rules can refuse it.
"""
from __future__ import annotations

import base64
import copy
from datetime import datetime, timezone
from typing import Any

from audit import Signer, layout
from audit.merkle import CompactRange, hash_leaf
from audit.note import Checkpoint
from audit.records import canonical, format_time, rotation_message


def rehash(rec: dict[str, Any]) -> None:
    rec["leaf_hash"] = hash_leaf(canonical(rec["body"])).hex()


def renumber(doc: dict[str, Any]) -> None:
    for i, rec in enumerate(doc["records"]):
        rec["index"] = i


def lay_out(doc: dict[str, Any]) -> bytes:
    """``doc`` as ``AuditLog.export`` lays an export out (each body in RFC 8785 bytes, each record's
    index and leaf hash as ``doc`` has them): what the verifier reads with its fast reader."""
    head = layout.head({name: doc[name] for name in layout.HEAD_NAMES}, doc["checkpoints"]).encode()
    records = [layout.record(r["index"], r["leaf_hash"], canonical(r["body"])) for r in doc["records"]]
    return head + layout.RECORD_SEPARATOR.join(records) + layout.TAIL


def rotation(doc: dict[str, Any], old: Signer, new: Signer) -> dict[str, Any]:
    """A key-rotation record from ``old`` to ``new``, signed by ``old`` (what any key holder can write)."""
    key = {
        "origin": doc["origin"], "old_key_id": old.key_id, "old_key_name": old.name,
        "new_key_id": new.key_id, "new_key_name": new.name,
        "new_public_key": base64.b64encode(new.verifier.raw).decode(),
    }
    key["signature"] = base64.b64encode(old.sign(rotation_message(key))).decode()
    body = {"kind": "key-rotation", "key": key, "time": format_time(datetime.now(timezone.utc))}
    rec = {"index": len(doc["records"]), "leaf_hash": "", "body": body}
    rehash(rec)
    return rec


def resign(doc: dict[str, Any], signer: Signer, *, every: int = 8) -> dict[str, Any]:
    """Rebuild the tree of ``doc``'s records and sign a checkpoint every ``every`` records (and at the
    end) with ``signer``, following the records' own key rotations; rewrite the header to match."""
    doc = copy.deepcopy(doc)
    renumber(doc)
    for rec in doc["records"]:
        rehash(rec)
    keys = [{"key_id": signer.key_id, "name": signer.name, "public_key_pem": signer.public_key_pem, "from_size": 0}]
    tree, notes, active = CompactRange(), [], signer
    rotations: dict[int, Signer] = doc.pop("_next_signers", {})
    n = len(doc["records"])
    for rec in doc["records"]:
        tree.append(bytes.fromhex(rec["leaf_hash"]))
        if tree.size % every == 0 or tree.size == n or tree.size - 1 in rotations:
            notes.append(Checkpoint.sign(doc["origin"], tree.size, tree.root(), active).note)
        if tree.size - 1 in rotations:  # the checkpoint covering a rotation is the old key's; then the new one
            active = rotations[tree.size - 1]
            keys.append({"key_id": active.key_id, "name": active.name, "public_key_pem": active.public_key_pem,
                         "from_size": tree.size + 1})
    doc.update(size=n, keys=keys, checkpoints=notes)
    return doc


def append_rotation(doc: dict[str, Any], old: Signer, new: Signer) -> None:
    """Append a rotation record; ``resign`` then switches to ``new`` after it."""
    doc["records"].append(rotation(doc, old, new))
    doc.setdefault("_next_signers", {})[len(doc["records"]) - 1] = new
