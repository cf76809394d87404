"""The stateless call (``POST /v1/responses`` without a conversation): a client that keeps its
own history (the Agents SDK's ``OpenAIConversationsSession``) uses turnstore as its model
endpoint. Nothing is committed. The history it sends back is what it listed from turnstore,
so some items come back without what only the stored copy holds: reasoning without its
``encrypted_content`` (listed without ``include``), ``item_reference``s, items with the
view-only ids turnstore gave them. Those are replaced by the stored items, byte for byte.

An id is looked up in the conversations the request's own view-only ids name (each names its
conversation): a session's history always holds such an item (its user messages). An id
found nowhere there, or another owner's, is 400 (``param: input``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

import msgspec

from service.core.errors import InvalidInput, ProviderRefused
from service.core.ids import view_item_conversation, view_item_id
from service.core.items import check_history
from service.core.plans import Asked, PlanRules
from service.core.window import SystemPrompt, instructions_for
from service.platform import metrics
from service.providers.base import Provider, ProviderRequest, Reply, replied
from service.store.ports import ConversationStore
from service.usecases.exchange import advertised


class _Head(msgspec.Struct):
    id: str | None = None


class Relay:
    def __init__(
        self,
        store: ConversationStore,
        provider: Provider,
        prompt: SystemPrompt | None,
        rules: PlanRules,
    ) -> None:
        self._store, self._provider, self._prompt, self._rules = store, provider, prompt, rules

    async def resolve(self, owner: str, items: Sequence[dict[str, Any]]) -> list[msgspec.Raw]:
        """The input to send: the items as they came, except those only the stored copy
        completes, which are replaced by it."""
        check_history(items)
        stored = await self._stored(owner, items)
        resolved = []
        for item in items:
            item_id = item.get("id")
            kind = item.get("type", "message")
            needs_store = (
                kind == "item_reference"
                or (kind == "reasoning" and not item.get("encrypted_content"))
                or (isinstance(item_id, str) and view_item_conversation(item_id) is not None)
            )
            if not needs_store:
                resolved.append(msgspec.Raw(msgspec.json.encode(item)))
                continue
            if not isinstance(item_id, str) or item_id not in stored:
                raise InvalidInput(f"input: no stored item {item_id!r} of yours.", param="input")
            resolved.append(stored[item_id])
        return resolved

    async def _stored(self, owner: str, items: Sequence[dict[str, Any]]) -> dict[str, msgspec.Raw]:
        """The stored items of the conversations the request's view-only ids name, by id."""
        named = {
            cid
            for item in items
            if isinstance(item.get("id"), str) and (cid := view_item_conversation(item["id"]))
        }
        found: dict[str, msgspec.Raw] = {}
        for cid in named:
            conversation = await self._store.load(cid, owner)
            if conversation is None:
                continue
            for revision, turn in enumerate(conversation.turns, start=1):
                for index, raw in enumerate(turn.replay_items):
                    head = msgspec.json.decode(raw, type=_Head)
                    found[head.id or view_item_id(cid, revision, index)] = raw
        return found

    async def respond(
        self, items: list[msgspec.Raw], tools: tuple[msgspec.Raw, ...], asked: Asked
    ) -> Reply:
        """One provider call on ``items``, offering the client's ``tools`` and asking what the
        client asked; nothing is kept. A refusal of the request is the client's (400)."""
        prompt = instructions_for(
            self._prompt, asked.instructions,
            server_first=self._rules.server_prompt_first(asked.instructions),
        )  # fmt: skip
        request = ProviderRequest(
            items, prompt.text if prompt else None, advertised(None, tools), asked.model,
            asked.fields, asked.include,
        )  # fmt: skip
        reply = None
        try:
            async with aclosing(replied(self._provider.respond(request, stream=False))) as events:
                async for event in events:
                    reply = event if isinstance(event, Reply) else reply
        except ProviderRefused as refused:
            raise refused.client_error() from refused
        assert reply is not None  # ``replied`` raises without one
        if reply.usage is not None:
            metrics.tokens_used(asked.model or self._provider.origin.model, reply.usage)
        return reply
