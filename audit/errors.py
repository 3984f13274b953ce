"""The audit package's exceptions. Messages name the fix."""
from __future__ import annotations

__all__ = ["AuditError", "RecordNotFound"]


class AuditError(Exception):
    """The log refused an operation: invalid record, wrong key, or a database changed behind its back."""


class RecordNotFound(AuditError, LookupError):
    """No record with that index (yet)."""
