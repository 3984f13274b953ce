"""The one exception type the gate raises (only for configuration problems, never for input)."""


class GateError(Exception):
    """A gate configuration error; the message names the fix."""
