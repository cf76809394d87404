"""Encryption at rest: master keys, owners' data keys, and sealed values.

A value is sealed with AES-256-GCM under its owner's data key, with a fresh random 96-bit
nonce, and with associated data naming its place (a conversation's turn and field, a run's
event batch), so a ciphertext moved to another row, field or owner fails to open: a
``StorageError``, never wrong text. Data keys are kept wrapped by a master key (AES-256-GCM
too, bound to the owner's name) in the keyring (service/store/postgres/keyring.py); master keys come
from ``ENCRYPTION_KEYS_FILE``, the first one wrapping, all of them unwrapping.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service.core.errors import StorageError

KEY_BYTES = 32
_NONCE = 12
_FORMAT = b"\x01"  # the first byte of every sealed value: this layout (format, nonce, ciphertext)
OVERHEAD = len(_FORMAT) + _NONCE + 16  # bytes a sealed value has beyond its plaintext
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# What a client is told when stored data does not decrypt (the log line says why and where).
UNREADABLE = "Stored data could not be decrypted; nothing was returned."

log = logging.getLogger("turnstore.crypto")


class KeyFileError(ValueError):
    """ENCRYPTION_KEYS_FILE is unreadable or malformed; the message shows no key material."""


def place(kind: str, scope: UUID, seq: int, field: str) -> bytes:
    """The associated data of a value: what holds it (a conversation or run), where, which field."""
    return f"turnstore:{kind}:{scope}:{seq}:{field}".encode()


class DataKey:
    """An owner's data key: seals and opens that owner's values."""

    def __init__(self, secret: bytes) -> None:
        self._aead = AESGCM(secret)
        # A separate key for digests: one key is never used for two purposes.
        self._mac = hmac.new(secret, b"turnstore:digest", hashlib.sha256).digest()
        self._terms = hmac.new(secret, b"turnstore:terms", hashlib.sha256).digest()

    def seal(self, where: bytes, plaintext: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return _FORMAT + nonce + self._aead.encrypt(nonce, plaintext, where)

    def open(self, where: bytes, sealed: bytes) -> bytes:
        if sealed[:1] != _FORMAT or len(sealed) < OVERHEAD:
            raise _broken(where)
        try:
            return self._aead.decrypt(sealed[1 : 1 + _NONCE], sealed[1 + _NONCE :], where)
        except InvalidTag:
            raise _broken(where) from None

    def digest(self, text: str) -> str:
        """A keyed digest of ``text`` (an Idempotency-Key's request hash): unlike a plain
        hash, it cannot confirm a guess of what was said without the key."""
        return hmac.new(self._mac, text.encode(), hashlib.sha256).hexdigest()

    def term(self, kind: str, value: str) -> str:
        """A search term of ``kind`` (service/core/search.py) keyed by this data key: the
        database holds it, never the word or pair it stands for, and without the key (once
        shredded) nothing can be matched against it."""
        digest = hmac.new(self._terms, f"{kind}:{value}".encode(), hashlib.sha256).hexdigest()
        return f"_{kind}{digest[:32]}"


def _broken(where: bytes) -> StorageError:
    # The place names no content, only ids: safe to log.
    log.error("a stored value does not decrypt at %s (moved, altered or its key shredded)", where)
    return StorageError(UNREADABLE)


@dataclass(frozen=True)
class MasterKeys:
    """Master keys by id; the first wraps new data keys, all unwrap."""

    keys: dict[str, AESGCM]
    current: str

    def wrap(self, owner: str, secret: bytes) -> tuple[str, bytes]:
        nonce = os.urandom(_NONCE)
        sealed = self.keys[self.current].encrypt(nonce, secret, _owner_place(owner))
        return self.current, nonce + sealed

    def unwrap(self, owner: str, key_id: str, wrapped: bytes) -> bytes:
        master = self.keys.get(key_id)
        if master is None:
            log.error(
                "the data key of an owner is wrapped by master key %r, not in the file", key_id
            )
            raise StorageError(UNREADABLE)
        try:
            return master.decrypt(wrapped[:_NONCE], wrapped[_NONCE:], _owner_place(owner))
        except InvalidTag:
            log.error("a data key does not unwrap under master key %r", key_id)
            raise StorageError(UNREADABLE) from None


def _owner_place(owner: str) -> bytes:
    return b"turnstore:data-key:" + owner.encode()


def new_data_key() -> bytes:
    return AESGCM.generate_key(bit_length=KEY_BYTES * 8)


def read_master_keys(path: Path) -> MasterKeys:
    """The keys of ``path``: one ``<key id>:<base64 of 32 random bytes>`` per line, blank
    lines and ``#`` comments ignored. KeyFileError for anything else."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read {path}: {type(exc).__name__}") from None
    keys: dict[str, AESGCM] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key_id, colon, encoded = line.partition(":")
        if not colon or not _KEY_ID.fullmatch(key_id):
            raise KeyFileError(
                f"line {number} is not <key id>:<base64 of 32 bytes> (ids: letters, digits, ._-)"
            )
        try:
            secret = base64.b64decode(encoded.strip(), validate=True)
        except binascii.Error:
            raise KeyFileError(f"line {number}: the key is not valid base64") from None
        # Messages name lines, never ids: a line with its fields swapped has the key first.
        if len(secret) != KEY_BYTES:
            raise KeyFileError(f"line {number}: the key has {len(secret)} bytes, needs {KEY_BYTES}")
        if key_id in keys:
            raise KeyFileError(f"line {number}: its key id appears on an earlier line too")
        keys[key_id] = AESGCM(secret)
    if not keys:
        raise KeyFileError(f"{path} holds no key")
    return MasterKeys(keys, next(iter(keys)))
