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
