"""Lethe gate: scores every tool result for prompt injection and secrets before it reaches the model."""

from ._text import normalised
from .core import Gate, scan
from .errors import GateError
from .findings import Finding, GateReport
from .probe import InjectionProbe
from .redact import Cut, Redaction, placeholder, redact

__all__ = ["Cut", "Finding", "Gate", "GateError", "GateReport", "InjectionProbe", "Redaction", "normalised", "placeholder", "redact", "scan"]
