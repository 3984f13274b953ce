"""The audit package's exceptions. Messages name the fix."""
from __future__ import annotations

__all__ = ["AuditError", "LogBusy", "RecordNotFound"]


class AuditError(Exception):
    """The log refused an operation: invalid record, wrong key, or a database changed behind its back."""


class RecordNotFound(AuditError, LookupError):
    """No record with that index (yet)."""


class LogBusy(AuditError):
    """An append that was told not to wait (`wait=False`) found the log's write lock held by another
    writer: nothing was written; append again with waiting, or elsewhere."""
