"""Lethe gate: scores every tool result for prompt injection and secrets before it reaches the model."""

from .core import Gate, scan
from .errors import GateError
from .findings import Finding, GateReport
from .probe import InjectionProbe

__all__ = ["Finding", "Gate", "GateError", "GateReport", "InjectionProbe", "scan"]
