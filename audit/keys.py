"""The log's Ed25519 signing key: loaded from a PEM file (created 0600 on first run) or a PEM string."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .errors import AuditError
from .note import NoteVerifier, key_id

__all__ = ["DEFAULT_KEY_NAME", "Signer"]

log = structlog.get_logger(__name__)

DEFAULT_KEY_NAME = "lethe.local/audit"


class Signer:
    """An Ed25519 private key under a C2SP key name. ``key_id`` is the hex of the 4-byte note key ID."""

    def __init__(self, private_key: Ed25519PrivateKey, name: str = DEFAULT_KEY_NAME) -> None:
        self._key = private_key
        self.verifier = NoteVerifier(name, private_key.public_key())
        self.name = self.verifier.name
        self.key_id_bytes = key_id(self.name, self.verifier.raw)
        self.key_id = self.key_id_bytes.hex()
        self.public_key_pem = self.verifier.public_key_pem

    def __repr__(self) -> str:  # never the private key
        return f"Signer(name={self.name!r}, key_id={self.key_id!r})"

    @classmethod
    def generate(cls, name: str = DEFAULT_KEY_NAME) -> Signer:
        return cls(Ed25519PrivateKey.generate(), name)

    @classmethod
    def from_pem(cls, pem: str | bytes, name: str = DEFAULT_KEY_NAME) -> Signer:
        try:
            key = serialization.load_pem_private_key(pem.encode() if isinstance(pem, str) else pem, password=None)
        except ValueError as e:
            raise AuditError("the audit key is not an unencrypted PEM private key") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise AuditError("the audit key must be Ed25519; generate one with `openssl genpkey -algorithm ed25519`")
        return cls(key, name)

    @classmethod
    def load_or_create(cls, path: Path, name: str = DEFAULT_KEY_NAME) -> Signer:
        """Load the key at ``path``, or create it there (mode 0600) when the file does not exist.

        A key others can read is refused rather than used: anyone who reads it can forge checkpoints.
        """
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            try:
                return cls._create(path, name)
            except FileExistsError:  # another process created it first
                return cls.load_or_create(path, name)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuditError(
                f"audit key {path} is accessible by group or others (mode {stat.S_IMODE(mode):04o}); "
                f"run `chmod 600 {path}`"
            )
        return cls.from_pem(path.read_bytes(), name)

    @classmethod
    def _create(cls, path: Path, name: str) -> Signer:
        signer = cls.generate(name)
        pem = signer._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # O_EXCL: two first runs never race
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        log.info("audit key created", path=str(path), key_id=signer.key_id)
        return signer

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)
