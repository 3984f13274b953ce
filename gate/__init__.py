"""Lethe gate: scores every tool result for prompt injection and secrets before it reaches the model."""

from ._text import normalised
from .core import Gate, scan
from .dbcache import CompileCache, compile_cache
from .errors import GateError
from .findings import Finding, GateReport
from .probe import InjectionProbe
from .redact import Cut, Redaction, placeholder, redact

__all__ = ["CompileCache", "Cut", "Finding", "Gate", "GateError", "GateReport", "InjectionProbe", "Redaction", "compile_cache", "normalised", "placeholder", "redact", "scan"]
