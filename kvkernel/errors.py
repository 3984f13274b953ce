"""Errors raised by the kernel. Each message names the fix."""


class KernelError(Exception):
    """Base class for every error the kernel raises on purpose."""


class SpanError(KernelError, ValueError):
    """A span is empty, out of range, unsorted or overlapping; the cache was left unchanged."""


class StateError(KernelError, RuntimeError):
    """The call does not fit the cache's state (e.g. commit without stage); nothing was changed."""


class ModelError(KernelError, RuntimeError):
    """The model cannot be found, converted or loaded."""


class ExactnessError(KernelError, RuntimeError):
    """The start-up self-test found the canonical computation not chunking-invariant here."""
