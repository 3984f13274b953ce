"""Lethe's audit log: a signed, append-only transparency log of every erasure (RFC 9162 + C2SP notes).

Exports resolve lazily (PEP 562) so that ``import audit.verify`` — the auditor's side — loads
neither SQLAlchemy nor FastAPI: the verifier must run on a machine with none of the gateway.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AuditError",
    "AuditLog",
    "AuditRecord",
    "Checkpoint",
    "ConsistencyProof",
    "InclusionProof",
    "LogBusy",
    "RecordNotFound",
    "Signer",
    "VerifyReport",
    "verify_erasure_proof",
    "verify_export",
    "verify_url",
]

_WHERE = {
    "AuditError": "errors",
    "LogBusy": "errors",
    "RecordNotFound": "errors",
    "AuditLog": "log",
    "AuditRecord": "records",
    "Checkpoint": "note",
    "ConsistencyProof": "merkle",
    "InclusionProof": "merkle",
    "Signer": "keys",
    "VerifyReport": "verify",
    "verify_erasure_proof": "verify",
    "verify_export": "verify",
    "verify_url": "verify",
}

if TYPE_CHECKING:
    from .errors import AuditError, LogBusy, RecordNotFound
    from .keys import Signer
    from .log import AuditLog
    from .merkle import ConsistencyProof, InclusionProof
    from .note import Checkpoint
    from .records import AuditRecord
    from .verify import VerifyReport, verify_erasure_proof, verify_export, verify_url


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'audit' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
