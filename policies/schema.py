"""Policy data validated on load: data.lethe must match `settings.schema.json` before a bundle is used.

Why: Rego compares across types without an error (every number sorts below every string), so
`"thresholds": {"injection": "0.8"}` would make `injection >= limit` false for every score and
turn quarantine off, and `"blocked_tools": "shell.exec"` would block nothing. Such a bundle is
refused with the field's path and the data file that set it, and the active bundle stays.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

from policies.model import PolicyError

SCHEMA_PATH = Path(__file__).resolve().parent / "settings.schema.json"


def _without_required(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_required(v) for k, v in node.items() if k != "required"}
    if isinstance(node, list):
        return [_without_required(v) for v in node]
    return node


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    schema["$defs"]["override"] = _without_required(copy.deepcopy(schema["$defs"]["settings"]))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _path(error: jsonschema.ValidationError) -> str:
    return "data" + "".join(f"[{p!r}]" if not isinstance(p, str) or not p.isidentifier() else f".{p}"
                            for p in error.absolute_path)


def _source(error: jsonschema.ValidationError, files: dict[str, Any]) -> str:
    """The data file whose document contains the failing path (the first one, as they may not overlap)."""
    for rel, doc in files.items():
        node = doc
        for part in error.absolute_path:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                break
        else:
            return rel
    return "the bundle's data files"


def validate_data(merged: dict, files: dict[str, Any], root: Path) -> None:
    """Raise PolicyError naming every bad field (path, problem, file) of the merged data document."""
    errors = sorted(_validator().iter_errors(merged), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = [f"{_path(e)}: {e.message} (in {root / _source(e, files)})" for e in errors[:10]]
        more = f"; and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise PolicyError("policy data does not match policies/settings.schema.json, fix these fields: "
                          + "; ".join(lines) + more)
