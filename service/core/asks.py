"""What a client of the OpenAI surface asks for one turn, as one value built once from its
request (service/api/compat/responses.py), and what its Response echoes of that request.

``Asked`` travels down unchanged: the use case plans the turn with it (service/core/plans.py),
the provider request is made of it, and the turn keeps its ``Echo`` as the Response's record
(``Asked.record``, encoded where the turn is committed, never by the HTTP layer).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

# What a Response echoes of its request besides the fields turnstore interprets, with OpenAI's
# answer where the request was silent.
ECHO_DEFAULTS: dict[str, Any] = {
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_output_tokens": None,
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": None, "summary": None},
    "metadata": {},
    "user": None,
    "safety_identifier": None,
    "service_tier": "auto",
    "prompt_cache_key": None,
}


class _Record(msgspec.Struct):
    created_at: float
    tools: list[Any]
    truncation: str | None
    previous_response_id: str | None
    store: bool
    background: bool
    fields: dict[str, msgspec.Raw]
    stored: bool = False  # absent from records written before stored responses


_JSON = msgspec.json.Encoder()


@dataclass(frozen=True)
class Echo:
    """What a Response repeats of the request that made it."""

    model: str
    instructions: str | None = None
    tools: Sequence[Any] = ()
    truncation: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    fields: Mapping[str, msgspec.Raw] = field(default_factory=dict)  # the passed-through ones
    stored: bool = False  # a stored response: its own conversation is not shown (none on OpenAI)
    created_at: float | None = None  # when its response was created (None: not known, now)

    def record(self) -> msgspec.Raw:
        """What is kept with the turn, for a retrieve to echo the same (never the
        instructions: a turn keeps their digest only)."""
        kept = {name: self.fields[name] for name in ECHO_DEFAULTS if name in self.fields}
        created_at = self.created_at if self.created_at is not None else time.time()
        return msgspec.Raw(
            _JSON.encode(
                _Record(
                    created_at,
                    list(self.tools),
                    self.truncation,
                    self.previous_response_id,
                    self.store,
                    self.background,
                    kept,
                    self.stored,
                )
            )
        )

    @classmethod
    def of_record(cls, record: msgspec.Raw | None, model: str) -> Echo:
        """The echo kept with a turn (none for an /api/v1 turn: its created_at is not known)."""
        if record is None:
            return cls(model=model)
        kept = msgspec.json.decode(record, type=_Record)
        echo = cls(
            model=model,
            tools=kept.tools,
            truncation=kept.truncation,
            previous_response_id=kept.previous_response_id,
            store=kept.store,
            background=kept.background,
            fields=kept.fields,
            stored=kept.stored,
            created_at=kept.created_at,
        )
        return echo

    def body(self) -> dict[str, Any]:
        echoed = {name: self.fields.get(name, value) for name, value in ECHO_DEFAULTS.items()}
        return {
            **echoed,
            "model": self.model,
            "instructions": self.instructions,
            "tools": list(self.tools),
            "truncation": self.truncation or "auto",
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "background": self.background,
        }


@dataclass(frozen=True)
class Asked:
    """What a client of the OpenAI surface asks of the provider for one turn besides its
    input: the model (None: the configured one), its instructions, its other fields as they
    came, what to include, the function tools it runs itself, whether the window may leave
    earlier turns out (``truncation``), the compaction threshold its ``context_management``
    asks (None: the server's), whether it runs in the background, and what its Response
    echoes (``echo``). A request asked by the client (not built
    by the server, as on /api/v1): a refusal of it by the provider is the client's 400."""

    model: str | None = None
    instructions: str | None = None
    fields: Mapping[str, msgspec.Raw] = field(default_factory=dict)
    include: tuple[str, ...] = ()
    tools: tuple[msgspec.Raw, ...] = ()
    truncate: bool = True
    compact: int | None = None
    background: bool = False
    echo: Echo | None = None

    def record(self, stored: bool) -> msgspec.Raw | None:
        """What the turn keeps of its Response (see Turn.response), given whether it is a
        stored response's (known once planned: a chained one is if its source is)."""
        if self.echo is None:
            return None
        return replace(self.echo, stored=stored).record()
