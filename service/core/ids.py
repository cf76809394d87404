"""Every id either surface shows, and how each is read back.

- A conversation is a uuid: ``/api/v1`` shows it dashed, ``/v1`` as ``conv_<hex>``; both
  forms are accepted everywhere. A malformed id looks exactly like an unknown one.
- Every other id turnstore mints is opaque: ``<prefix>_ts<token>``, the token being AES-SIV
  (deterministic authenticated encryption, under the deployment's ``ids`` secret, migration
  0019) of what the id names, in lowercase base32. The same thing is shown by the same id on
  every replica and in every listing; the id reveals neither the conversation nor a revision,
  cannot be derived from another id, and an id altered or made up names nothing. Its ``ts``
  marker and its length keep it from ever having the shape of a provider's id (OpenAI's are a
  prefix and 48 hex digits), so an id is matched whoever minted it.
- A response is a turn: its id names the conversation and the revision its turn makes, so its
  lookup needs no index of its own and stays within its conversation (one shard's). A
  background response is named before its turn holds the conversation, so by its run. A
  ``store: false`` response's id names nothing.
- An item is shown by an id naming the turn that holds it and, for an item the provider named,
  a digest of the provider's id (``shown``: the stored bytes, the provider's own id included,
  never change), else its place in the turn: a client that sends it back names the one turn to
  read, so any replica finds the stored copy by its primary key.
- The previous release's response ids (``resp_<conversation hex><revision, 8 hex>`` and
  ``resp_<conversation hex><run hex>``, never 48 hex digits) still resolve, for clients that
  hold them across an upgrade; its item ids are read as a provider's.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import struct
import uuid
from dataclasses import dataclass
from functools import lru_cache

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from service.core.errors import ConversationNotFound, ResponseNotFound
from service.core.model import Origin

MAX_REVISION = 2**31 - 1  # revisions are PostgreSQL integers
MARKER = "ts"  # after the prefix: never a hex digit, so never a provider's id
_OPAQUE = re.compile(rf"([a-z]{{1,16}})_{MARKER}([a-z2-7]{{40,100}})")
_LEGACY_RESPONSE = re.compile(r"resp_([0-9a-f]{32})([0-9a-f]{8}|[0-9a-f]{32})")
_PREFIX = re.compile(r"([a-z]{1,16})_")
_RESPONSE, _RUN, _ITEM = b"turnstore response", b"turnstore run response", b"turnstore item"
_AT, _NAMED = 0, 1  # an item shown by its place in its turn, or by its provider's id
_PREFIXES = {  # an item stored without an id of its own is shown with OpenAI's prefix
    "message": "msg",
    "reasoning": "rs",
    "function_call": "fc",
    "function_call_output": "fco",
    "compaction": "cmp",
}


def conversation_id(cid: uuid.UUID) -> str:
    """The /v1 form."""
    return f"conv_{cid.hex}"


def parse_conversation_id(raw: str) -> uuid.UUID:
    """A uuid in any of its usual forms, or the ``conv_<hex>`` the OpenAI surface shows."""
    try:
        return uuid.UUID(raw.removeprefix("conv_"))
    except ValueError:
        raise ConversationNotFound() from None  # malformed looks exactly like unknown


def unstored_response_id() -> str:
    """The id of a ``store: false`` response: it names nothing, anywhere."""
    return unstored_id("resp")


def unstored_id(prefix: str) -> str:
    """An id of turnstore's shape that names nothing (random)."""
    token = base64.b32encode(uuid.uuid4().bytes + uuid.uuid4().bytes).decode()
    return f"{prefix}_{MARKER}{token.lower().rstrip('=')}"


@dataclass(frozen=True)
class ResponseRef:
    """What a response id names: a conversation and the revision its turn makes, or (a
    background response) the run that makes it."""

    conversation_id: uuid.UUID
    revision: int | None = None
    run_id: uuid.UUID | None = None


@dataclass(frozen=True)
class ItemRef:
    """What a shown item id names: the turn that holds the item (the one that made
    ``revision``), and the item in it: its place, or the digest of its provider's id."""

    conversation_id: uuid.UUID
    revision: int
    index: int | None = None
    digest: bytes | None = None

    def names(self, index: int, own: str | None) -> bool:
        """Whether this names the item at ``index`` of its turn, stored with id ``own``."""
        if self.digest is not None:
            return own is not None and _digest(own) == self.digest
        return own is None and index == self.index


class Ids:
    """turnstore's own ids under one deployment's ``ids`` secret (every replica reads the
    same, so each shows and reads back the same ids)."""

    def __init__(self, secret: bytes) -> None:
        key = _derived(secret, b"turnstore ids v1", 64)
        self._siv, self._gcm = AESSIV(key), AESGCM(_derived(secret, b"turnstore sealed v1", 32))
        self.item = lru_cache(maxsize=8192)(self._item)  # a listing shows the same ids again

    def response(self, cid: uuid.UUID, revision: int) -> str:
        return self._seal("resp", _RESPONSE, cid.bytes + struct.pack(">I", revision))

    def run_response(self, cid: uuid.UUID, run_id: uuid.UUID) -> str:
        return self._seal("resp", _RUN, cid.bytes + run_id.bytes)

    def _item(
        self, cid: uuid.UUID, revision: int, index: int, own: str | None, kind: str | None
    ) -> str:
        """The id an item shows: the one at ``index`` of the turn that made ``revision``,
        stored with id ``own`` (None: none) and of type ``kind``."""
        head = cid.bytes + struct.pack(">I", revision)
        if own is not None:
            prefix = _PREFIX.match(own)
            body = head + bytes([_NAMED]) + _digest(own)
            return self._seal(prefix.group(1) if prefix else "item", _ITEM, body)
        body = head + bytes([_AT]) + struct.pack(">I", index)
        return self._seal(prefix_of(kind), _ITEM, body)

    def parse_response(self, raw: str) -> ResponseRef:
        """What ``raw`` names (ResponseNotFound if it names nothing)."""
        legacy = _LEGACY_RESPONSE.fullmatch(raw)
        if legacy is not None:
            return _legacy_response(legacy)
        match = _OPAQUE.fullmatch(raw)
        if match is None or match.group(1) != "resp":
            raise ResponseNotFound()
        token = match.group(2)
        if (plain := self._open(token, _RESPONSE)) is not None and len(plain) == 20:
            return _at_revision(uuid.UUID(bytes=plain[:16]), struct.unpack(">I", plain[16:])[0])
        if (plain := self._open(token, _RUN)) is not None and len(plain) == 32:
            return ResponseRef(uuid.UUID(bytes=plain[:16]), run_id=uuid.UUID(bytes=plain[16:]))
        raise ResponseNotFound()

    def parse_item(self, raw: str) -> ItemRef | None:
        """What a shown item id names (None: not one of turnstore's, e.g. a provider's)."""
        match = _OPAQUE.fullmatch(raw)
        plain = self._open(match.group(2), _ITEM) if match else None
        if plain is None or len(plain) not in (25, 29):
            return None
        cid, (revision,) = uuid.UUID(bytes=plain[:16]), struct.unpack(">I", plain[16:20])
        if plain[20] == _NAMED and len(plain) == 29:
            return ItemRef(cid, revision, digest=plain[21:])
        if plain[20] == _AT and len(plain) == 25:
            return ItemRef(cid, revision, index=struct.unpack(">I", plain[21:])[0])
        return None

    def seal(self, origin: Origin, content: str) -> str:
        """``content`` (an opaque item's ``encrypted_content``, shown to a client that keeps
        its own history) sealed with the origin that made it: only turnstore opens it, and a
        client can neither forge nor alter it."""
        where = (origin.provider, origin.endpoint, origin.model)
        plain = _SEAL_ENCODER.encode(_Sealed(*where, content, origin.kind, origin.key_fingerprint))
        nonce = os.urandom(12)
        token = base64.urlsafe_b64encode(nonce + self._gcm.encrypt(nonce, plain, _SEAL_AD))
        return SEALED + token.decode()

    def unseal(self, sealed: str) -> tuple[Origin, str] | None:
        """The origin and content ``seal`` sealed (None: not such a value); ValueError when
        it is one but does not open (altered, or another deployment's)."""
        if not sealed.startswith(SEALED):
            return None
        try:
            raw = base64.urlsafe_b64decode(sealed[len(SEALED) :])
            got = _SEAL_DECODER.decode(self._gcm.decrypt(raw[:12], raw[12:], _SEAL_AD))
        except (InvalidTag, ValueError, msgspec.DecodeError):
            raise ValueError("sealed content that does not open") from None
        origin = Origin(got.provider, got.endpoint, got.model, got.kind, got.key_fingerprint)
        return origin, got.content

    @staticmethod
    def minted(raw: str) -> bool:
        """Whether ``raw`` has the shape of an id turnstore mints (whether or not it names
        anything): such an id is never a provider's."""
        return _OPAQUE.fullmatch(raw) is not None

    def _seal(self, prefix: str, kind: bytes, plain: bytes) -> str:
        token = base64.b32encode(self._siv.encrypt(plain, [kind])).decode().rstrip("=")
        return f"{prefix}_{MARKER}{token.lower()}"

    def _open(self, token: str, kind: bytes) -> bytes | None:
        padded = token.upper() + "=" * (-len(token) % 8)
        try:
            sealed = base64.b32decode(padded)
            if base64.b32encode(sealed).decode() != padded:
                return None  # one id per thing: its unused last bits must be zero
            return self._siv.decrypt(sealed, [kind])
        except (InvalidTag, ValueError):
            return None


def prefix_of(kind: str | None) -> str:
    """The prefix OpenAI gives an item of type ``kind`` (None: a message)."""
    return _PREFIXES.get(kind or "message", "item")


SEALED = "tsc1_"  # what content turnstore sealed begins with
_SEAL_AD = b"turnstore sealed content"


class _Sealed(msgspec.Struct, array_like=True):
    provider: str
    endpoint: str
    model: str
    content: str
    kind: str | None = None  # (sealed before 0020's origins: absent)
    key_fingerprint: str | None = None


_SEAL_ENCODER, _SEAL_DECODER = msgspec.json.Encoder(), msgspec.json.Decoder(_Sealed)


def _derived(secret: bytes, info: bytes, size: int) -> bytes:
    return HKDF(hashes.SHA256(), size, salt=None, info=info).derive(secret)


def _digest(provider_id: str) -> bytes:
    return hashlib.blake2b(provider_id.encode(), digest_size=8).digest()


def _at_revision(cid: uuid.UUID, revision: int) -> ResponseRef:
    if not 1 <= revision <= MAX_REVISION:
        raise ResponseNotFound()  # a revision PostgreSQL's integer cannot hold names nothing
    return ResponseRef(cid, revision=revision)


def _legacy_response(match: re.Match[str]) -> ResponseRef:
    cid, rest = uuid.UUID(match.group(1)), match.group(2)
    if len(rest) == 32:
        return ResponseRef(cid, run_id=uuid.UUID(rest))
    return _at_revision(cid, int(rest, 16))
