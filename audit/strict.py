"""Strict reading of what an auditor is handed: files, JSON documents, fields. Pure: stdlib only.

Everything the verifier reads (an export, a proof, a checkpoint note, a PEM file, a gateway's
reply) goes through here, so a malformed input is one :class:`Malformed` naming the place,
never a traceback and never a silently "repaired" document:

- bytes must be UTF-8; a leading byte-order mark is harmless and dropped;
- JSON must be RFC 8259 JSON with unique names in every object (RFC 8785 input has no duplicate
  names, and ``json.loads`` would keep only the last one, which is how a forged field hides
  in front of the real one), and without ``NaN`` / ``Infinity`` (not JSON);
- every field the verifier uses is checked for presence and type before it is used.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["Malformed", "decode_text", "expect", "fields", "load_json", "read_bytes", "read_text"]

T = TypeVar("T")
BOM = b"\xef\xbb\xbf"
_TYPE_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer", bool: "true or false"}


class Malformed(ValueError):
    """An input is not what it must be; ``str()`` is one line: ``<where>: <what is wrong>``."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where


def read_bytes(path: str | Path, where: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise Malformed(where, f"cannot read {path}: {e.strerror or e}") from None


def decode_text(data: bytes | str, where: str) -> str:
    """UTF-8 (strict) without its byte-order mark."""
    if isinstance(data, str):
        return data.removeprefix("\ufeff")
    try:
        return data.removeprefix(BOM).decode("utf-8")
    except UnicodeDecodeError as e:
        raise Malformed(where, f"not UTF-8 (invalid byte at offset {e.start})") from None


def read_text(path: str | Path, where: str) -> str:
    return decode_text(read_bytes(path, where), where)


class _Duplicate(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(data: bytes | str, where: str) -> Any:
    """Parse one JSON document strictly (see the module docstring)."""
    text = decode_text(data, where)
    try:
        return json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant)
    except _Duplicate as e:
        raise Malformed(where, f"duplicate name {e.name!r} in one object (refused: a reader would keep only one)") from None
    except json.JSONDecodeError as e:
        raise Malformed(where, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise Malformed(where, "JSON nested too deeply") from None
    except ValueError as e:  # NaN / Infinity, or an integer too long to convert
        raise Malformed(where, f"invalid JSON: {e}") from None


def _type_name(t: type | tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(x, x.__name__) for x in (t if isinstance(t, tuple) else (t,)))


def expect(value: Any, t: type[T], where: str) -> T:
    """``value`` if it is of JSON type ``t`` (a bool is not an integer), else Malformed."""
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        got = "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)
        raise Malformed(where, f"must be {_type_name(t)}, not {got}")
    return value


def fields(obj: Any, where: str, required: Mapping[str, type], optional: Mapping[str, type] | None = None) -> dict[str, Any]:
    """An object with exactly the ``required`` names (and maybe ``optional`` ones), each typed."""
    obj = expect(obj, dict, where)
    optional = optional or {}
    missing = [k for k in required if k not in obj]
    if missing:
        raise Malformed(where, f"missing {', '.join(repr(k) for k in missing)}")
    unknown = [k for k in obj if k not in required and k not in optional]
    if unknown:
        raise Malformed(where, f"unexpected {', '.join(repr(k) for k in unknown)} (not part of this format)")
    for name, t in {**required, **optional}.items():
        if name in obj:
            expect(obj[name], t, f"{where}.{name}")
    return obj
