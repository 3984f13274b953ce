"""A policy bundle: the Rego modules and data files of one directory, read once and never mutated.

Layout (the same as the shipped package data): `<dir>/*.rego` are the policies, `<dir>/data/*.json`
the data documents (each a JSON object, merged at the root of `data`, so files namespace themselves
with a top-level `"lethe"` key). `*_test.rego` files are tests, not policy: they are left out of the
bundle and of its hash, so editing a test never changes the identity of what decides.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any
from dataclasses import dataclass
from pathlib import Path

from policies.model import PolicyError
from policies.schema import validate_data

SHIPPED_BUNDLE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bundle:
    root: Path
    modules: tuple[tuple[str, str], ...]  # (relative path, Rego source)
    data: tuple[tuple[str, str], ...]  # (relative path, JSON text)
    data_json: str  # all data files merged into one document, as OPA's loader merges them
    hash: str


def bundle_files(root: Path) -> list[Path]:
    """The files that make up the bundle in `root`, sorted by relative path."""
    rego = [p for p in root.glob("*.rego") if not p.name.endswith("_test.rego")]
    data = list(root.glob("data/*.json"))
    return sorted((p for p in rego + data if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def hash_files(root: Path, files: list[Path]) -> tuple[str, dict[str, bytes]]:
    """sha256 over each file's relative path and bytes, length-framed so no two bundles collide by concatenation."""
    digest = hashlib.sha256()
    contents: dict[str, bytes] = {}
    for path in files:
        rel = path.relative_to(root).as_posix()
        body = path.read_bytes()
        contents[rel] = body
        for part in (rel.encode(), body):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
    return digest.hexdigest(), contents


def load_bundle(bundle_dir: Path | None = None) -> Bundle:
    """Read a bundle directory; raises PolicyError naming the file (and, for data, the field) at fault."""
    root = (Path(bundle_dir) if bundle_dir is not None else SHIPPED_BUNDLE_DIR).resolve()
    if not root.is_dir():
        raise PolicyError(f"policy bundle directory {root} not found; pass an existing directory")
    try:
        files = bundle_files(root)
        bundle_hash, contents = hash_files(root, files)
    except OSError as exc:
        raise PolicyError(f"cannot read policy bundle {root}: {exc}") from exc
    modules, data, parsed_files = [], [], {}
    merged: dict[str, Any] = {}
    for rel, body in contents.items():
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(f"{root / rel} is not UTF-8: {exc}") from exc
        if rel.endswith(".rego"):
            modules.append((rel, text))
            continue
        try:
            parsed = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise PolicyError(f"{root / rel} is not valid JSON: {exc}") from exc
        except _DuplicateKey as exc:
            raise PolicyError(f"{root / rel} has the key {exc.args[0]!r} twice in one object; keep one "
                              "(JSON parsers keep the last silently, so the first would never apply)") from exc
        if not isinstance(parsed, dict):
            raise PolicyError(f"{root / rel} must hold a JSON object (e.g. {{\"lethe\": {{...}}}})")
        data.append((rel, text))
        parsed_files[rel] = json.loads(text)  # its own copy: _merge shares (and extends) the first file's objects
        _merge(merged, parsed, root / rel)
    if not modules:
        raise PolicyError(f"policy bundle {root} has no .rego files")
    validate_data(merged, parsed_files, root)
    return Bundle(root, tuple(modules), tuple(data), json.dumps(merged), bundle_hash)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (red team #13 F8: a second "lethe" tenant entry
    silently replaced the first)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _merge(into: dict, doc: dict, source: Path, path: str = "data") -> None:
    """Deep-merge like OPA: objects merge key by key, any other value set twice is a conflict."""
    for key, value in doc.items():
        here = f"{path}.{key}"
        if key not in into:
            into[key] = value
        elif isinstance(into[key], dict) and isinstance(value, dict):
            _merge(into[key], value, source, here)
        else:
            raise PolicyError(f"{source} sets {here}, which another data file already sets; keep each key in one file")
