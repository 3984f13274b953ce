"""A child process that appends to an audit log and acknowledges each index once append returned.

Usage: audit_worker.py URL KEY_PATH ACK_FILE COUNT [GO_FILE]. COUNT 0 appends until killed. Each
acknowledged index is written (and flushed) to ACK_FILE only after ``append`` returned, so the parent
knows which indices the log promised were durable.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from audit import AuditLog, Signer


def main(url: str, key: str, ack: str, count: str, go: str | None = None) -> None:
    log = AuditLog(url, Signer.load_or_create(Path(key)), batch_size=64 if go else 8)
    if go:
        while not Path(go).exists():
            time.sleep(0.01)
    n, i = int(count), 0
    with open(ack, "a", buffering=1) as out:
        while n == 0 or i < n:
            records = [{"kind": "quarantine", "tenant": "t", "segment_id": f"{ack}:{i + j}"} for j in range(1 + i % 3 if not go else 1)]
            indices = log.append_many(records)
            out.write("".join(f"{x}\n" for x in indices))
            i += len(records)


if __name__ == "__main__":
    main(*sys.argv[1:])
