"""The ledger's exceptions: one base class so the gateway can map every ledger failure at once."""
from __future__ import annotations


class LedgerError(Exception):
    """A ledger operation was refused; the ledger is unchanged (the transaction rolled back)."""


class UnknownSession(LedgerError):
    """The session id does not exist (or belongs to another tenant)."""


class UnknownSegment(LedgerError):
    """A segment id does not exist in the named session."""


class LedgerInvariantError(LedgerError):
    """The segments no longer tile the cache; raised inside the transaction, so the write rolls back."""


class ErasureIncomplete(LedgerError):
    """The ledger erased the rows but cannot vouch that no copy of the content remains at rest
    (a blob still stored with no holder, or the SQLite WAL could not be checkpointed and truncated).

    The ledger state change stands (failing toward erasure); the caller must not report success.
    ``Ledger.scrub()`` retries the at-rest part once the obstacle (a long-running reader) is gone.
    """
