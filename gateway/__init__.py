"""Lethe gateway: the OpenAI-compatible proxy that puts gate, policy, kernel, ledger and audit to work."""
__version__ = "0.1.0"
