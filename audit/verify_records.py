"""Step 2 of verifying an export (every record: its position, leaf hash, schema and witness), and,
for an export laid out as the log writes it, step 1 too: read a block at a time, on two cores in
two processes. Pure: stdlib, orjson and audit's pure modules (no database, gateway or kernel).

Why blocks. An export of 10^5 records is about 100 MB of JSON, four million Python objects once
parsed. Parsed whole, each object is created and freed far from the caches, and that, not the
checks, took most of the time; parsed :data:`BLOCK` bytes at a time, every step finds its data in
the cache. A block is proven as written, then checked:

a. orjson parses it (no hook per object, and so no duplicate-name check of its own);
b. each body is spelt again, compact and sorted (``records.compact_sorted``), and hashed (its leaf);
c. the records are laid out again from that (``layout.record``: the record's position, its
   computed leaf hash, its spelt body) and compared with the file's bytes. Equal bytes prove
   what the strict reader checks object by object: no duplicate name anywhere (the layout of a
   parse spells each name once), every field of its type, every body in the spelling hashed, and
   every record at its position with its true leaf hash. If only positions or leaf hashes differ
   (a tampered export), the layout of the file's own values is compared instead and those records
   go to the rules, which name the fault; any other difference sends the whole file to the strict
   reader;
d. where that spelling may differ from RFC 8785 (``records.spelling_doubts``) the body is encoded
   by RFC 8785, and a difference, too, sends the file to the strict reader;
e. the rules: ``accept.accepted`` vouches for most bodies a column at a time, and
   :func:`record_findings` (``records.body_errors``, ``rules.witness_errors``) judges the rest.

Why two processes. With two cores, a forked process reads the second part of the records while
this one checks the checkpoint signatures and reads the first part (:data:`SHARE` of the bytes);
it sends back only leaf hashes and the findings of the few records with any, and its first
position is the count of newlines before its part (one per record). Where there is no fork, or
this process runs threads, or no second process can be had, or it dies, this process reads that
part itself: the report is the same either way, word for word.
"""
from __future__ import annotations

import os
import pickle
import signal
import threading
from binascii import b2a_hex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from hashlib import sha256
from itertools import repeat
from operator import itemgetter
from typing import Any

import orjson

from . import layout
from .accept import accepted
from .errors import AuditError
from .merkle import hash_leaf
from .records import body_errors, canonical, canonical_parsed, compact_sorted, spelling_doubts
from .rules import witness_errors

__all__ = ["BLOCK", "PARALLEL_FROM", "Findings", "findings", "layout_findings", "layout_head", "record_findings"]

BLOCK = 1 << 16  # bytes of records parsed at a time: their objects stay in the cache while checked
BATCH = 1024  # records per call of ``accept.accepted``: enough to pay for its per-column calls
PARALLEL_FROM = 4 << 20  # bytes of records; below this a second process costs more than it saves
SHARE = 0.42  # of the records' bytes read here while the other process reads the rest: this one also checks signatures
NO_LEAF = b"\xff" * 32  # stands in for a leaf that could not be hashed; equals no real leaf
_OPEN, _BODY = b'{"index": %d, "leaf_hash": "', b'", "body": '  # layout.record's pieces (a test holds them equal)
_CLOSE = b"}" + layout.RECORD_SEPARATOR  # closes a record that has another after it
_NEXT = _CLOSE + b"{"  # found only between two records of a file in the layout: no raw newline is in a body
_HEAD_END = b'"records": [\n'

Note = tuple[list[str], "Mapping[str, str] | None"]  # a record's messages, and its hand-over if a key rotation


@dataclass
class Findings:
    """Step 2 for a run of records: their leaf hashes (32 bytes each, in order), and the messages
    and key hand-overs of the few records that have any, by position. ``processes``: how many
    read them."""

    start: int
    count: int
    leaves: bytes
    notes: dict[int, Note] = field(default_factory=dict)
    processes: int = 1


# --- one record --------------------------------------------------------------------------------

def record_findings(position: int, rec: Mapping[str, Any], entry: bytes | None = None) -> tuple[bytes, list[str], bool]:
    """Step 2 for one record, on its own (``entry``: its body's canonical bytes, if known): its leaf
    hash (for the tree), what is wrong with it (each message naming it), and whether it is a
    well-formed key rotation, which the key chain then applies in order."""
    body, errors = rec["body"], []
    if rec["index"] != position:
        errors.append(f"index {rec['index']} found at position {position} (records deleted, inserted or reordered)")
    try:
        entry = canonical_parsed(body) if entry is None else entry
        leaf = hash_leaf(entry)
    except (AuditError, ValueError, TypeError, RecursionError) as e:
        errors.append(f"body is not canonical JSON ({e})")
        entry, leaf = None, NO_LEAF
    if rec["leaf_hash"] != leaf.hex():
        errors.append(f"leaf hash {rec['leaf_hash']} does not match the body's {leaf.hex()}")
    schema = body_errors(body, entry)
    if "time" not in body:
        schema.append("'time' missing: the log stamps every record")
    witness = witness_errors(body)
    messages = [f"record {position}: {e}" for e in errors]
    messages += [f"record {position}: schema: {e}" for e in schema]
    messages += [f"record {position}: witness: {e}" for e in witness]
    return leaf, messages, body.get("kind") == "key-rotation" and not schema


def _note(findings: Findings, position: int, rec: Mapping[str, Any], entry: bytes | None) -> bytes:
    leaf, messages, rotation = record_findings(position, rec, entry)
    if messages or rotation:
        findings.notes[position] = (messages, rec["body"]["key"] if rotation else None)
    return leaf


def findings(records: list[Mapping[str, Any]]) -> Findings:
    """Step 2 for records already read (by the strict reader), one at a time."""
    found = Findings(0, len(records), b"")
    found.leaves = b"".join([_note(found, position, rec, None) for position, rec in enumerate(records)])
    return found


# --- an export in the log's layout -------------------------------------------------------------

def layout_head(data: bytes) -> tuple[dict[str, Any], int, int] | None:
    """The export's header and checkpoints, and where its records lie (``data[start:end]``), if
    everything before and after them is exactly as the log writes it; else None."""
    start = data.find(_HEAD_END) + len(_HEAD_END)
    end = len(data) - len(layout.TAIL)
    if start < len(_HEAD_END) or end < start or not data.endswith(layout.TAIL):
        return None
    try:
        doc = orjson.loads(data[:start] + b"]}")
        if type(doc) is not dict or list(doc) != layout.NAMES:
            return None
        head = layout.head({name: doc[name] for name in layout.HEAD_NAMES}, doc["checkpoints"]).encode()
    except (ValueError, TypeError):  # not JSON, or not a header json.dumps can spell
        return None
    return (doc, start, end) if head == data[:start] else None


def layout_findings(data: bytes, start: int, end: int, *, workers: int, meanwhile: Callable[[], None]) -> Findings | None:
    """Steps 1 and 2 for the records in ``data[start:end]`` (see the module docstring), in
    ``workers`` processes (1 or 2); None if they are not exactly as the log writes them.

    With two processes, ``meanwhile`` runs here while the other one reads its part."""
    if start == end:
        return Findings(0, 0, b"")
    cut = data.find(_NEXT, start + int((end - start) * SHARE), end) if workers > 1 and _can_fork() else -1
    if cut < 0:
        return _read(data, start, end, 0)
    other_start = cut + len(_CLOSE)  # each record before it ends in one newline: there is none inside a record
    theirs = _forked(lambda: _read(data, other_start, end, data.count(b"\n", start, other_start)))
    try:
        meanwhile()
        mine = _read(data, start, cut + 1, 0)
    except BaseException:
        theirs(cancel=True)
        raise
    if mine is None:
        theirs(cancel=True)
        return None
    other = theirs()
    if other is None or other.start != mine.count:  # the other process failed (its start is otherwise right: see above)
        other = _read(data, other_start, end, mine.count)
        if other is None:
            return None
    else:
        mine.processes = 2
    mine.count += other.count
    mine.leaves += other.leaves
    mine.notes.update(other.notes)
    return mine


def _can_fork() -> bool:
    """A second process is forked only where fork exists and this process runs one thread (a fork
    of a threaded process may deadlock on a lock another thread held)."""
    return hasattr(os, "fork") and threading.active_count() == 1


def _forked(work: Callable[[], Findings | None]) -> Callable[..., Findings | None]:
    """Start ``work`` in a forked process; return the function that waits for its result (None if
    the fork failed, or the process died or found nothing), or with ``cancel`` ends it."""
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:  # no process to be had (EAGAIN, ENOMEM): this one reads that part itself
        os.close(read_end)
        os.close(write_end)
        return lambda cancel=False: None
    if pid == 0:  # the forked process: leaves without cleaning up (the OS frees it all)
        code = 1
        try:
            os.close(read_end)
            with os.fdopen(write_end, "wb") as out:
                pickle.dump(work(), out, protocol=pickle.HIGHEST_PROTOCOL)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)

    def result(cancel: bool = False) -> Findings | None:
        try:
            if cancel:
                os.kill(pid, signal.SIGKILL)
                return None
            with os.fdopen(read_end, "rb") as got:
                payload = got.read()
            return pickle.loads(payload) if payload else None
        except (OSError, pickle.UnpicklingError, EOFError):
            return None
        finally:
            if cancel:
                os.close(read_end)
            os.waitpid(pid, 0)

    return result


@dataclass
class _Block:
    """One block's parsed records, their canonical bodies and leaves, their layout (``text``), and
    the positions (in the block) that the rules must judge one at a time: a position or leaf hash
    the file has wrong."""

    records: list[Any]
    bodies: list[dict[str, Any]]
    entries: list[bytes]
    leaves: list[bytes]
    text: bytes
    suspects: set[int]


def _read(data: bytes, start: int, stop: int, first: int) -> Findings | None:
    """Steps 1 and 2 for the records in ``data[start:stop]``, a block at a time; the first is at
    position ``first``."""
    found, pending, batched, leaves, pos = Findings(first, 0, b""), [], 0, [], start
    while pos < stop:
        cut = data.find(_NEXT, pos + BLOCK, stop)
        end = stop if cut < 0 else cut + 1
        block = _block(data, pos, end, first + found.count)
        if block is None:
            return None
        pending.append((first + found.count, block))
        found.count += len(block.records)
        batched += len(block.records)
        leaves += block.leaves
        if batched >= BATCH or end == stop:
            _judge(found, pending)
            pending, batched = [], 0
        pos = end + len(layout.RECORD_SEPARATOR)
    found.leaves = b"".join(leaves)
    return found


def _block(data: bytes, pos: int, end: int, first: int) -> _Block | None:
    """Parse the records in ``data[pos:end]`` and prove them as written (a to d in the module docstring)."""
    try:
        records = orjson.loads(b"".join((b"[", memoryview(data)[pos:end], b"]")))
        bodies = list(map(itemgetter("body"), records))
        if set(map(type, bodies)) != {dict}:
            return None
        entries = list(map(compact_sorted, bodies))
    except (ValueError, TypeError, KeyError):  # not JSON, not records, or a body orjson cannot spell
        return None
    leaves = [sha256(b"\x00" + entry).digest() for entry in entries]
    hashes = list(map(b2a_hex, leaves))
    positions = range(first, first + len(records))
    written = _laid_out(positions, hashes, entries)
    suspects: set[int] = set()
    if not (len(written) == end - pos and data.startswith(written, pos)):
        wrong = _wrong_places(data, pos, end, records, positions, hashes, entries)
        if wrong is None:
            return None
        suspects = wrong
    if spelling_doubts(written) and not _rfc8785(bodies, entries):
        return None
    return _Block(records, bodies, entries, leaves, written, suspects)


def _laid_out(indices: Any, hashes: Any, entries: list[bytes]) -> bytes:
    """``layout.record`` of each record, separated as in the file, built in one join."""
    n = len(entries)
    parts: list[bytes] = [_BODY] * (5 * n)
    parts[0::5] = map(_OPEN.__mod__, indices)
    parts[1::5] = hashes
    parts[3::5] = entries
    parts[4::5] = repeat(_CLOSE, n)
    parts[-1] = b"}"
    return b"".join(parts)


def _wrong_places(data: bytes, pos: int, end: int, records: list[Any], positions: range, hashes: list[bytes],
                  entries: list[bytes]) -> set[int] | None:
    """The block's records whose index or leaf hash is not their position's or their body's, if
    the file is the layout of its own values; None if it is not even that."""
    try:
        indices = list(map(itemgetter("index"), records))
        claimed = list(map(itemgetter("leaf_hash"), records))
    except KeyError:  # a record without its index or leaf hash: the strict reader names it
        return None
    if set(map(type, indices)) != {int} or set(map(type, claimed)) != {str}:
        return None
    try:
        spelt = [h.encode() for h in claimed]
    except UnicodeEncodeError:
        return None
    written = _laid_out(indices, spelt, entries)
    if not (len(written) == end - pos and data.startswith(written, pos)):
        return None
    return {i for i, (index, place, h, mine) in enumerate(zip(indices, positions, spelt, hashes)) if index != place or h != mine}


def _rfc8785(bodies: list[Any], entries: list[bytes]) -> bool:
    """Whether each body whose spelling may differ from RFC 8785 is spelt as RFC 8785 spells it."""
    try:
        return all(canonical(body) == entry for body, entry in zip(bodies, entries) if spelling_doubts(entry))
    except AuditError:
        return False


def _judge(found: Findings, pending: list[tuple[int, _Block]]) -> None:
    """e in the module docstring, for a batch of blocks: the rules for every record ``accept.accepted`` does not vouch for."""
    bodies = [body for _, block in pending for body in block.bodies]
    ok = accepted(bodies, [block.text for _, block in pending])
    if all(ok) and not any(block.suspects for _, block in pending):
        return
    vouched = iter(ok)
    for first, block in pending:
        for i, (rec, entry, passed) in enumerate(zip(block.records, block.entries, vouched)):
            if not passed or i in block.suspects:
                _note(found, first + i, rec, entry)
