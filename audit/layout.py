"""The export's one spelling: how ``AuditLog.export`` lays the document out. Pure: stdlib only.

The log writes every export this way, and the offline verifier recognises it: a file that is byte
for byte this layout of its own parsed document holds no duplicate name anywhere (the layout of a
parsed document spells each name once) and carries every record body in its RFC 8785 bytes, which
lets the verifier skip the slower strict reader. Each record is one line (RFC 8785 bytes hold no
raw newline), so the verifier can cut the records into blocks, and between two processes, at any
``},\n{``. Any other spelling of an export (indented, re-serialised, hand-edited) is still valid
and goes through the strict reader.

    {"format": ..., "origin": ..., "size": ..., "keys": [...],
    "checkpoints": [<note>,
    <note>],
    "records": [
    {"index": 0, "leaf_hash": "<hex>", "body": <RFC 8785 bytes>},
    {"index": 1, ...}
    ]}
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["EXPORT_FORMAT", "HEAD_NAMES", "NAMES", "RECORD_SEPARATOR", "TAIL", "head", "record"]

EXPORT_FORMAT = "lethe-audit-export/1"
HEAD_NAMES = ("format", "origin", "size", "keys")
NAMES = [*HEAD_NAMES, "checkpoints", "records"]  # in the order written
RECORD_SEPARATOR = b",\n"
TAIL = b"\n]}\n"


def head(header: Mapping[str, Any], notes: Iterable[str]) -> str:
    """Everything before the first record: the header object, left open, and the checkpoint notes."""
    return json.dumps(dict(header))[:-1] + ',\n"checkpoints": [' + ",\n".join(map(json.dumps, notes)) + '],\n"records": [\n'


def record(index: int, leaf_hash: str, entry: bytes) -> bytes:
    """One record: its position, its leaf hash (hex) and its body's canonical bytes, as they are."""
    return b'{"index": %d, "leaf_hash": "%s", "body": %s}' % (index, leaf_hash.encode(), entry)
