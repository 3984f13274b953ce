"""C2SP signed notes and tlog checkpoints, Ed25519 only. Pure: stdlib + cryptography.

A checkpoint is the note text ``<origin>\\n<tree size>\\n<base64 root hash>\\n``; a signed note
appends a blank line and one line ``— <key name> <base64(key id || signature)>`` per signature.
Keeping to the C2SP format byte for byte means Go's ``sumdb/note`` and other transparency-log
tooling can check Lethe's checkpoints too.
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = ["Checkpoint", "NoteError", "NoteSigner", "NoteVerifier", "key_id", "sign_note"]

ED25519 = b"\x01"  # the C2SP signature type byte
SIG_PREFIX = "\u2014 "  # em dash, space


class NoteError(ValueError):
    """A note or checkpoint is malformed or its signature does not verify."""


def key_id(name: str, public_key: bytes) -> bytes:
    """C2SP key ID: the first four bytes of SHA-256(name || 0x0A || 0x01 || public key)."""
    return hashlib.sha256(name.encode() + b"\n" + ED25519 + public_key).digest()[:4]


def _check_name(name: str) -> str:
    if not name or any(c.isspace() or c == "+" for c in name) or not _is_utf8(name):
        raise NoteError(f"key name {name!r} must be non-empty UTF-8, without spaces or '+'")
    return name


def _is_utf8(text: str) -> bool:
    """False for a str holding lone surrogates (a JSON "\\ud800" escape), which has no UTF-8 bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class NoteSigner(Protocol):
    name: str
    key_id_bytes: bytes

    def sign(self, message: bytes) -> bytes: ...


@dataclass(frozen=True)
class NoteVerifier:
    """A public key under a name, as a note verifier knows it."""

    name: str
    public_key: Ed25519PublicKey

    @classmethod
    def from_pem(cls, name: str, pem: str | bytes) -> NoteVerifier:
        try:
            key = serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
        except (ValueError, UnsupportedAlgorithm) as e:
            raise NoteError(f"not a PEM public key ({e})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise NoteError("the audit public key must be Ed25519")
        return cls(_check_name(name), key)

    @classmethod
    def from_raw(cls, name: str, raw: bytes) -> NoteVerifier:
        try:
            return cls(_check_name(name), Ed25519PublicKey.from_public_bytes(raw))
        except ValueError as e:
            raise NoteError(f"not an Ed25519 public key ({e})") from None

    @property
    def raw(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def key_id(self) -> str:
        return key_id(self.name, self.raw).hex()

    @property
    def public_key_pem(self) -> str:
        return self.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ).decode()

    @property
    def vkey(self) -> str:
        """The C2SP verifier key string ``<name>+<hex key id>+<base64(0x01 || key)>``."""
        return f"{self.name}+{self.key_id}+{base64.b64encode(ED25519 + self.raw).decode()}"

    def verify(self, message: bytes, signature: bytes) -> bool:
        try:
            self.public_key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


def sign_note(text: str, signer: NoteSigner) -> str:
    if not text.endswith("\n") or "\n\n" in text:
        raise NoteError("note text must end in one newline and contain no blank line")
    sig = base64.b64encode(signer.key_id_bytes + signer.sign(text.encode())).decode()
    return f"{text}\n{SIG_PREFIX}{_check_name(signer.name)} {sig}\n"


def _split_note(note: str) -> tuple[str, list[tuple[str, bytes, bytes]]]:
    """(text, [(key name, key id, signature)]) of a signed note, unverified."""
    if not _is_utf8(note):
        raise NoteError("a note is UTF-8 text; this one holds a lone surrogate")
    cut = note.rfind("\n\n")
    if cut < 0 or not note.endswith("\n"):
        raise NoteError("not a signed note: no blank line before the signature lines")
    text, sigs = note[: cut + 1], []
    for line in note[cut + 2 :].splitlines():
        if not line.startswith(SIG_PREFIX) or line.count(" ") != 2:
            raise NoteError(f"malformed signature line {line!r}")
        name, b64 = line[len(SIG_PREFIX) :].split(" ")
        try:
            blob = base64.b64decode(b64, validate=True)
        except ValueError as e:  # binascii.Error, or a non-ASCII str
            raise NoteError(f"signature line for {name} is not base64") from e
        if base64.b64encode(blob).decode() != b64:  # one spelling: unused bits set would verify too
            raise NoteError(f"signature line for {name} is not canonical base64")
        if len(blob) != 4 + 64:
            raise NoteError(f"signature line for {name} is not an Ed25519 signature")
        sigs.append((name, blob[:4], blob[4:]))
    if not sigs:
        raise NoteError("signed note has no signature line")
    return text, sigs


@dataclass(frozen=True)
class Checkpoint:
    """A signed tree head: the log ``origin`` had ``size`` records with Merkle root ``root_hash``."""

    origin: str
    size: int
    root_hash: bytes
    note: str

    @classmethod
    def from_note(cls, note: str) -> Checkpoint:
        """Parse (not verify) a checkpoint note; ``verify`` checks its signature."""
        text, _ = _split_note(note)
        lines = text.split("\n")
        if len(lines) < 4:
            raise NoteError("checkpoint needs an origin, a tree size and a root hash line")
        origin, size, root = lines[0], lines[1], lines[2]
        if not (size.isascii() and size.isdigit()) or (size != "0" and size.startswith("0")) or len(size) > 19:
            raise NoteError(f"checkpoint tree size {size!r} is not a decimal number")
        try:
            root_hash = base64.b64decode(root, validate=True)
        except ValueError as e:
            raise NoteError("checkpoint root hash is not base64") from e
        if base64.b64encode(root_hash).decode() != root:
            raise NoteError("checkpoint root hash is not canonical base64")
        if len(root_hash) != 32:
            raise NoteError("checkpoint root hash is not 32 bytes")
        return cls(origin, int(size), root_hash, note)

    @classmethod
    def sign(cls, origin: str, size: int, root_hash: bytes, signer: NoteSigner) -> Checkpoint:
        text = f"{origin}\n{size}\n{base64.b64encode(root_hash).decode()}\n"
        return cls(origin, size, root_hash, sign_note(text, signer))

    @property
    def key_ids(self) -> list[str]:
        return [kid.hex() for _, kid, _ in _split_note(self.note)[1]]

    @property
    def key_id(self) -> str:
        """The key id of the first (the log's own) signature."""
        return self.key_ids[0]

    def verify(self, verifier: NoteVerifier) -> None:
        """Raise NoteError unless ``verifier`` signed this checkpoint.

        As C2SP asks, signature lines from other keys are ignored, and a failing line from the
        verifier's key rejects the note.
        """
        text, sigs = _split_note(self.note)
        kid = bytes.fromhex(verifier.key_id)
        mine = [sig for name, k, sig in sigs if name == verifier.name and k == kid]
        if not mine:
            raise NoteError(f"no signature by key {verifier.name} {verifier.key_id}")
        if not verifier.verify(text.encode(), mine[0]):
            raise NoteError(f"signature by key {verifier.name} {verifier.key_id} does not verify")

    def to_dict(self) -> dict:
        return {
            "origin": self.origin,
            "size": self.size,
            "root_hash": self.root_hash.hex(),
            "key_id": self.key_id,
            "note": self.note,
        }
