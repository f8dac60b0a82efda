"""A deployment secret: keys nobody else can compute, entries nobody else can forge or read.

Without a secret, whoever can read a store can confirm a guessed prompt (prefix keys are an
unkeyed hash chain) and read its KV, and whoever can write it can plant KV that passes every
check. With one, three keys are derived from it (HKDF-SHA256, one label each):

- a key-derivation key: prefix keys become an HMAC-SHA256 chain, so without the secret nobody
  can compute or confirm a key;
- a MAC key: every entry carries a GMAC (AES-256-GCM over no plaintext, with the entry's header
  and bytes as associated data, a fresh 96-bit nonce per entry), so an entry written without the
  secret is a miss;
- an encryption key: with ``encrypt=True`` an entry's bytes are AES-256-GCM ciphertext (the
  header is the associated data), so a store reader sees no KV.

The secret itself is never logged, shown or stored; ``repr`` says only that one is set.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvgroups.errors import KVGroupsError

ENVIRONMENT_VARIABLE = "KVGROUPS_STORE_SECRET"
MIN_SECRET_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
_SALT = b"kvgroups.store-secret/1"


class SecretError(KVGroupsError):
    """A secret that cannot be used (too short, unreadable); the message never shows it."""


def _derive(secret: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=label).derive(secret)


class StoreSecret:
    """The keys derived from one deployment secret (at least 16 bytes; a passphrase works, a random
    32-byte value is better: ``python -c "import secrets; print(secrets.token_hex(32))"``)."""

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode("utf-8") if isinstance(secret, str) else secret
        if not isinstance(raw, bytes):
            raise TypeError(f"a store secret is str or bytes, got {type(secret).__name__}")
        raw = raw.strip()
        if len(raw) < MIN_SECRET_BYTES:
            raise SecretError(f"a store secret needs at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
        self._key_derivation = _derive(raw, b"prefix keys")
        self._mac = AESGCM(_derive(raw, b"entry mac"))
        self._encryption = AESGCM(_derive(raw, b"entry encryption"))
        # Tells secrets apart (a namespace binds it) without revealing anything about them.
        self.identity = hmac.new(self._key_derivation, b"identity", "sha256").hexdigest()[:16]

    def __repr__(self) -> str:
        return "StoreSecret(<set>)"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> StoreSecret:
        """The secret in a file (its whole content, whitespace stripped)."""
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise SecretError(f"cannot read the secret file {str(path)!r}: {error.strerror or error}") from None
        return cls(data)

    @classmethod
    def resolve(cls, secret: str | bytes | StoreSecret | None) -> StoreSecret | None:
        """``secret`` as a StoreSecret; None: ``$KVGROUPS_STORE_SECRET`` when set, else no secret."""
        if isinstance(secret, StoreSecret):
            return secret
        if secret is None:
            secret = os.environ.get(ENVIRONMENT_VARIABLE) or None
            if secret is None:
                return None
        return cls(secret)

    # --- keys -----------------------------------------------------------------------------
    def chain(self, previous: bytes, chunk: bytes) -> bytes:
        """The next link of a prefix-key chain: HMAC-SHA256 of the previous link and a chunk's tokens."""
        return hmac.new(self._key_derivation, previous + chunk, "sha256").digest()

    # --- entries --------------------------------------------------------------------------
    @staticmethod
    def nonce() -> bytes:
        """A fresh random nonce for one entry (96 bits: never repeats in practice)."""
        return secrets.token_bytes(NONCE_BYTES)

    def mac(self, nonce: bytes, header: bytes, data: memoryview) -> bytes:
        """The tag authenticating ``header`` and ``data`` together under ``nonce``."""
        # AES-GCM with the header as its plaintext and the data as associated data: the tag covers
        # both, and the data (megabytes) is read in place rather than joined to the header.
        return self._mac.encrypt(nonce, header, data)[-TAG_BYTES:]

    def mac_holds(self, nonce: bytes, tag: bytes, header: bytes, data: memoryview) -> bool:
        if len(nonce) != NONCE_BYTES or len(tag) != TAG_BYTES:
            return False
        return hmac.compare_digest(self.mac(nonce, header, data), tag)

    def encrypt(self, nonce: bytes, header: bytes, data: memoryview) -> bytes:
        """The ciphertext of ``data`` with its tag, ``header`` authenticated with it."""
        return self._encryption.encrypt(nonce, data, header)

    def decrypt(self, nonce: bytes, header: bytes, ciphertext: memoryview) -> bytes | None:
        """The plaintext, or None when the ciphertext or header was not sealed with this secret."""
        if len(nonce) != NONCE_BYTES:
            return None
        try:
            return self._encryption.decrypt(nonce, ciphertext, header)
        except Exception:  # InvalidTag: written without this secret, or changed since
            return None
