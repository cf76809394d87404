"""A conversation's search terms in PostgreSQL (migration 0021, service/core/search.py): what
each write adds to them, in the write's own transaction, and what a listing's filter asks.

In clear the words go to PostgreSQL as text (``to_tsvector('simple', ...)`` makes them); with
the owner's data key (encryption at rest) the process makes each word's keyed digest and the
database gets those alone. Metadata pairs are keyed too; models are not (a turn's model is
stored in clear with it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from uuid import UUID

import asyncpg

from service.core.model import Turn
from service.core.search import (
    MODEL,
    PAIR,
    WORD,
    Finding,
    clear_term,
    pair_value,
    searchable,
    turn_text,
    words,
)
from service.platform.crypto import DataKey
from service.store.postgres.adapter import Adapter
from service.store.postgres.tx import Params


def of_turn(key: DataKey | None, turn: Turn) -> Params:
    """A commit's ``:search_text`` and ``:search_terms`` (migrations/commit_function.py): what
    its turn adds to the conversation's terms, in the commit statement itself."""
    made = turn_terms(key, [turn])
    return {"search_text": made["text"], "search_terms": made["terms"]}


_NONE: Mapping[str, str] = MappingProxyType({})


def turn_terms(key: DataKey | None, turns: Iterable[Turn]) -> Params:
    """``:text`` and ``:terms`` (statements.SEARCH_ADD) for what ``turns`` add."""
    turns = list(turns)
    models = {clear_term(MODEL, t.origin.model) for t in turns if t.origin is not None}
    text = " ".join(turn_text(turn) for turn in turns)
    if key is None:
        return {"text": searchable(text), "terms": sorted(models)}
    return {"text": None, "terms": sorted(models | {key.term(WORD, w) for w in words(text)})}


def pair_terms(key: DataKey | None, pairs: Iterable[tuple[str, str]]) -> list[str]:
    term = key.term if key is not None else clear_term
    return [term(PAIR, pair_value(k, v)) for k, v in pairs]


@dataclass(frozen=True)
class Terms:
    """A conversation's search terms, changed in a write's transaction (``conn``); ``key``: the
    owner's data key (None: in clear)."""

    db: Adapter
    conn: asyncpg.Connection
    cid: UUID
    key: DataKey | None

    async def add(self, turns: Iterable[Turn] = (), metadata: Mapping[str, str] = _NONE) -> None:
        """The terms of ``turns`` (and of ``metadata``) added."""
        params = turn_terms(self.key, turns)
        params["terms"] += pair_terms(self.key, metadata.items())
        await self.db.sql.search_add.execute(self.conn, {**params, "cid": self.cid})

    async def pairs(self, metadata: Mapping[str, str]) -> None:
        """In a metadata update's transaction: the pairs' terms replaced."""
        terms = pair_terms(self.key, metadata.items())
        await self.db.sql.search_pairs.execute(self.conn, {"cid": self.cid, "terms": terms})

    async def rebuild(
        self, sealed_turns: Iterable[Turn] = (), metadata: Mapping[str, str] = _NONE
    ) -> None:
        """The terms made again from the turns the conversation holds (a fork's, or after an
        item's removal): those of turns in clear by the database, those of ``sealed_turns``
        and of sealed ``metadata`` here."""
        key = self.key
        terms = turn_terms(key, sealed_turns)["terms"] if key is not None else []
        terms += pair_terms(key, metadata.items())
        await self.db.sql.search_rebuild.execute(self.conn, {"cid": self.cid, "terms": terms})


def quoted(term: str) -> str:
    """A term as a tsquery literal (terms are "_", a letter and hex digits: nothing to escape,
    and quoted all the same)."""
    return "'" + term.replace("\\", "\\\\").replace("'", "''") + "'"


def query(key: DataKey | None, finding: Finding) -> tuple[tuple[str, ...], Params]:
    """The listing's filters (statements.FILTERS, by name) and their parameters."""
    params: Params = {}
    for name in ("created_after", "created_before", "updated_after", "updated_before"):
        if (value := getattr(finding, name)) is not None:
            params[name] = value
    terms = pair_terms(key, finding.metadata)
    terms += [clear_term(MODEL, finding.model)] if finding.model else []
    if finding.q is not None and key is not None:
        terms += [key.term(WORD, word) for word in words(finding.q)]
    elif finding.q is not None:
        params["q"] = finding.q
    if terms:
        params["terms"] = " & ".join(quoted(term) for term in terms)
    return tuple(params), params
