"""What finds a conversation (GET /api/v1/conversations' filters): the filter a listing asks,
and the terms a conversation is found by.

A conversation's terms are its transcript's words (whole words, case-folded) and terms for
what else it is found by: each metadata pair (``m``) and each model a turn used (``o``). A
term is ``_`` + its kind + 32 hex digits of a digest of the kind and value: in clear
sha256 (``clear_term``, what migration 0021 computes in SQL too); under encryption at rest a
keyed digest under the owner's data key (platform/crypto.py ``DataKey.term``), for words
(``w``) and metadata alike, so the database never holds them in clear and a shred makes them
unmatchable. In clear, PostgreSQL makes the words itself (``to_tsvector('simple', ...)``);
``words`` is the same rule in Python, for sealed rows and the in-memory store.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from service.core.model import Turn, plain

WORD, PAIR, MODEL = "w", "m", "o"  # the kinds of terms
_WORDS = re.compile(r"[^\W_]+")  # letters and digits: PostgreSQL's parser splits at "_" too
# What PostgreSQL's parser may keep as one token (an e-mail address, a host, a URL, a path)
# holds one of these: ``searchable`` adds its words (statements.SEARCH_REBUILD and the
# listing's q split at the same characters).
_JOINT = re.compile(r"[@./:]")


def words(text: str) -> list[str]:
    """The distinct words of ``text``, lower-cased (as PostgreSQL's ``simple`` configuration
    folds them), in order of first appearance."""
    return list(dict.fromkeys(_WORDS.findall(text.lower())))


def searchable(text: str) -> str:
    """``text`` as PostgreSQL is given it in clear: followed by the words of what its parser
    keeps whole, so that ``example`` finds ``bob@example.com`` in clear as it does under
    encryption and in the in-memory store (which find by ``words`` alone)."""
    joined = [t for t in dict.fromkeys(text.split()) if not t.isalnum() and _JOINT.search(t)]
    return f"{text} {' '.join(words(' '.join(joined)))}" if joined else text


def turn_text(turn: Turn) -> str:
    """The text of a turn's messages as people read them (its transcript)."""
    said = turn.transcript if turn.transcript is not None else ()
    return " ".join(
        text for _, text in (*plain(turn.user_message, turn.assistant_message), *said) if text
    )


def pair_value(key: str, value: str) -> str:
    """What a metadata pair's term digests (unambiguous whatever the key holds)."""
    return json.dumps([key, value], ensure_ascii=False)  # as PostgreSQL writes json_build_array


def clear_term(kind: str, value: str) -> str:
    """A term of ``kind`` in clear (a digest anyone can compute: what is stored in clear)."""
    digest = hashlib.sha256(f"{kind}:{value}".encode()).hexdigest()[:32]
    return f"_{kind}{digest}"


@dataclass(frozen=True)
class Finding:
    """What a listing asks of the caller's conversations: each given filter must hold
    (``metadata``: every pair; ``q``: every word, whole and case-folded)."""

    metadata: tuple[tuple[str, str], ...] = ()
    model: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    updated_after: datetime | None = None
    updated_before: datetime | None = None
    q: str | None = None

    @property
    def searching(self) -> bool:
        """Whether it asks for terms (a word, a metadata pair or a model)."""
        return bool(self.metadata or self.model or self.q)

    def matches(self, created: datetime, updated: datetime, terms: Iterable[str]) -> bool:
        """Whether a conversation of these times and terms (words in clear, the others as
        ``clear_term``) is one it asks for (the in-memory store's rule)."""
        held = set(terms)
        wanted = [clear_term(PAIR, pair_value(k, v)) for k, v in self.metadata]
        wanted += [clear_term(MODEL, self.model)] if self.model else []
        wanted += words(self.q) if self.q else []
        return (
            all(term in held for term in wanted)
            and (self.created_after is None or created > self.created_after)
            and (self.created_before is None or created < self.created_before)
            and (self.updated_after is None or updated > self.updated_after)
            and (self.updated_before is None or updated < self.updated_before)
        )
