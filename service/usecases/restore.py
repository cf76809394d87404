"""Items a client sends back, made what the provider must get again.

A client that keeps its own history sends back what it was shown: reasoning without its
``encrypted_content`` (listed without ``include``), ``item_reference``s, items under the ids
turnstore showed (service/core/ids.py), and items of a ``store: false`` response (under the
provider's own ids, their opaque content sealed by turnstore with the model that made it).
Wherever such items enter (a stateless or stored response's ``input``, items appended to a
conversation) they are restored:

- an item under one of turnstore's ids is replaced by the stored copy, byte for byte; the id
  names the turn that holds it, so each such turn is read once, by its primary key, runs of
  consecutive turns together (at most MAX_CONVERSATIONS conversations and MAX_TURNS turns a
  request: what a lookup costs never grows with the owner's data). An id found nowhere, or
  another owner's, is 400 (``param``);
- an item under any other id (a provider's: OpenAI's are a prefix and 48 hex digits) is sent
  on as it came, its sealed content opened; one that needs what only a stored copy holds
  (reasoning without ``encrypted_content``, an ``item_reference``) is 400;
- an item made by another provider, endpoint or model than the one the request goes to is
  sent as another origin gets it, as in a conversation (service/core/window.py): its opaque
  items (sealed reasoning, a compaction item, thinking) left out, a provider's own items as
  the Responses items they read as, so a handoff between agents on two models never fails;
- an item that stands for a provider's own item (a reasoning item whose sealed value opens
  to it, or a reference to the part of a Chat message that stands for the whole message:
  service/core/translate/ ``relayed``, ``Shown.whole``) brings that item back whole, and the
  items beside it that it was also shown as (its call, its text) are not sent twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import msgspec

from service.core.errors import InvalidInput
from service.core.ids import Ids, ItemRef
from service.core.items import restorable
from service.core.model import Origin
from service.core.translate import is_opaque, neutral, opened, shown, twin
from service.store.ports import Reads
from service.usecases.secret_ids import IdsSource

MAX_CONVERSATIONS = 20  # a request may name items of at most this many conversations
MAX_TURNS = 1000  # and of at most this many turns (a request body holds no more, mostly)
PAGE_TURNS = 16  # turns read at once
Stored = tuple[msgspec.Raw, Origin | None]  # an item's stored bytes and its turn's origin
# ... and whether it stands for a provider's own item shown as several (its twins beside it).
Restored = tuple[msgspec.Raw, Origin | None, bool]


class Restorer:
    def __init__(self, store: Reads, ids: IdsSource) -> None:
        self._store, self.ids = store, ids

    async def restore(
        self,
        owner: str,
        items: Sequence[dict[str, Any]],
        param: str = "input",
        origin: Origin | None = None,
    ) -> list[msgspec.Raw]:
        """The items to send to ``origin`` (None: every one), in order."""
        restored = await self._restored(owner, items, param)
        return _for(restored, origin)

    async def kept(
        self, owner: str, items: Sequence[dict[str, Any]], param: str
    ) -> tuple[list[msgspec.Raw], Origin | None]:
        """The items to keep in a conversation as one turn, and that turn's origin: the one
        that made the first opaque item among them whose maker is known (another's opaque
        items are left out, as a turn has one origin and its opaque items go back only there)."""
        restored = await self._restored(owner, items, param)
        makers = (made_by for raw, made_by in restored if made_by is not None and is_opaque(raw))
        origin = next(makers, None)
        return _for(restored, origin), origin

    async def _restored(
        self, owner: str, items: Sequence[dict[str, Any]], param: str
    ) -> list[Stored]:
        """Each item restored, with the origin that made it (None: not known)."""
        ids = await self.ids.get()
        refs = [_ref(ids, item, param) for item in items]
        stored = await self._stored(owner, [ref for ref in refs if ref is not None], param)
        restored: list[Restored] = []
        for item, ref in zip(items, refs, strict=True):
            if ref is None:
                raw, made_by = _as_sent(ids, item, param)
                restored.append((raw, made_by, made_by is not None and shown(raw) is not None))
            elif ref not in stored:
                raise InvalidInput(
                    f"{param}: no stored item {item.get('id')!r} of yours.", param=param
                )
            else:
                restored.append(stored[ref])
        return _without_twins(restored)

    async def _stored(self, owner: str, refs: list[ItemRef], param: str) -> dict[ItemRef, Restored]:
        """The stored items ``refs`` name: the turns they name, read by their primary keys, a
        run of consecutive turns (up to PAGE_TURNS) in one read."""
        if len({ref.conversation_id for ref in refs}) > MAX_CONVERSATIONS:
            raise InvalidInput(
                f"{param}: items of at most {MAX_CONVERSATIONS} conversations in one request.",
                param=param,
            )
        wanted: dict[tuple[UUID, int], list[ItemRef]] = {}
        for ref in refs:
            wanted.setdefault((ref.conversation_id, ref.revision), []).append(ref)
        if len(wanted) > MAX_TURNS:
            raise InvalidInput(
                f"{param}: items of at most {MAX_TURNS} turns in one request.", param=param
            )
        found: dict[ItemRef, Restored] = {}
        for cid, low, high in _runs(sorted(wanted)):
            page = await self._store.turns(
                cid, owner, low, high, newest_first=False, limit=high - low + 1
            )
            for revision, turn in page:
                # Its items, and its compaction item (shown in its Response; the kept messages
                # of a compacted context are never shown).
                placed = [*enumerate(turn.replay_items), *((-1, raw) for raw in turn.compacted)]
                for index, stored in placed:
                    for own, raw, whole in restorable(stored):
                        for ref in wanted.get((cid, revision), ()):
                            if ref.names(index, own):
                                found[ref] = (raw, turn.origin, whole)
        return found


def _runs(turns: list[tuple[UUID, int]]) -> list[tuple[UUID, int, int]]:
    """``turns`` (sorted) as runs of consecutive revisions of one conversation, each of at most
    PAGE_TURNS: (conversation, first revision, last revision)."""
    runs: list[tuple[UUID, int, int]] = []
    for cid, revision in turns:
        last = runs[-1] if runs else None
        if last and last[0] == cid and last[2] == revision - 1 and revision - last[1] < PAGE_TURNS:
            runs[-1] = (cid, last[1], revision)
        else:
            runs.append((cid, revision, revision))
    return runs


def _without_twins(restored: list[Restored]) -> list[Stored]:
    """``restored`` without what a provider's own item brought back whole was also shown as,
    sent beside it (a stateless client sends back every item it was shown: a Gemini call
    before the reasoning item that carries it, a Chat message's text and calls after the
    thinking that stands for it)."""
    dropped: set[int] = set()
    for n, (raw, _, whole) in enumerate(restored):
        if not whole:
            continue
        parts = shown(raw) or []
        left = sum(part.item["type"] != "reasoning" for part in parts)
        for side in (range(n - 1, -1, -1), range(n + 1, len(restored))):
            for m in side:
                if not left or m in dropped or restored[m][2]:
                    break
                if not twin(msgspec.json.decode(restored[m][0]), raw):
                    break
                dropped.add(m)
                left -= 1
    return [(raw, made_by) for n, (raw, made_by, _) in enumerate(restored) if n not in dropped]


def _for(restored: list[Stored], origin: Origin | None) -> list[msgspec.Raw]:
    """The restored items as ``origin`` (None: every one) gets them: what another origin made,
    as another origin gets it (its opaque content left out: ``origin`` could not open it)."""
    out: list[msgspec.Raw] = []
    for raw, made_by in restored:
        elsewhere = origin is not None and made_by is not None and made_by != origin
        out += neutral(raw) if elsewhere else [raw]
    return out


def _ref(ids: Ids, item: dict[str, Any], param: str) -> ItemRef | None:
    """The stored item ``item`` names by one of turnstore's ids (None: it names none)."""
    item_id = item.get("id")
    if not isinstance(item_id, str):
        return None
    ref = ids.parse_item(item_id)
    if ref is None and Ids.minted(item_id):  # turnstore's shape, but not of this deployment
        raise InvalidInput(f"{param}: no stored item {item_id!r} of yours.", param=param)
    return ref


def _as_sent(ids: Ids, item: dict[str, Any], param: str) -> tuple[msgspec.Raw, Origin | None]:
    """An item under no id of turnstore's: as it came, its sealed content opened (with the
    origin that made it), or 400 when only a stored copy could complete it."""
    kind = item.get("type", "message")
    content = item.get("encrypted_content")
    if kind == "item_reference" or (kind == "reasoning" and not content):
        raise InvalidInput(f"{param}: no stored item {item.get('id')!r} of yours.", param=param)
    if not isinstance(content, str):
        return msgspec.Raw(msgspec.json.encode(item)), None
    try:
        unsealed = ids.unseal(content)
    except ValueError:
        raise InvalidInput(
            f"{param}: the encrypted_content of item {item.get('id')!r} was altered.", param=param
        ) from None
    if unsealed is None:  # the provider's own, as a client may keep it
        return msgspec.Raw(msgspec.json.encode(item)), None
    made_by, original = unsealed
    block = opened(original)  # a provider's own item, sealed whole: back byte for byte
    if block is not None:
        return block, made_by
    return msgspec.Raw(msgspec.json.encode({**item, "encrypted_content": original})), made_by
