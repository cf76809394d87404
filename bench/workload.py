"""The issue's per-turn workload: a ~200 B user message, a ~600 B assistant reply, and as
replay items the user input item, a reasoning item with ~3 KB of encrypted_content and the
assistant message item. Deterministic, so every implementation stores the same bytes."""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any

import msgspec

# Ordinary words: transcript text compresses like real text does.
_SAMPLE = """the of and to in is that for it as with was on be by this are from at or an have not
which but all were when we there can more if no out so what up about into than them history
replay reasoning conversation database revision commit provider stream"""
WORDS = _SAMPLE.split()


def _text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


@dataclass(frozen=True)
class Payload:
    """One turn's content in the shapes the implementations take: JSON bytes and dicts."""

    user_text: str
    assistant_text: str
    user_item: dict[str, Any]
    reasoning_item: dict[str, Any]
    message_item: dict[str, Any]

    raw_items: list[bytes]  # the same three items as the provider's JSON bytes

    @property
    def items(self) -> list[dict[str, Any]]:
        return [self.user_item, self.reasoning_item, self.message_item]


def payload(conversation: int, turn: int) -> Payload:
    rng = random.Random(conversation * 100_003 + turn)
    user_text = _text(rng, 200)
    assistant_text = _text(rng, 600)
    key = f"{rng.getrandbits(96):024x}"
    # Sealed reasoning is ciphertext: incompressible, base64 (2,304 random bytes -> 3,072).
    sealed = base64.b64encode(rng.randbytes(2304)).decode()
    user = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": user_text}],
    }
    reasoning = {"type": "reasoning", "id": f"rs_{key}", "summary": [], "encrypted_content": sealed}
    message = {
        "type": "message",
        "id": f"msg_{key}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": assistant_text, "annotations": []}],
    }
    raw = [msgspec.json.encode(item) for item in (user, reasoning, message)]
    return Payload(user_text, assistant_text, user, reasoning, message, raw)


def describe() -> str:
    sample = payload(0, 0)
    sizes = ", ".join(str(len(raw)) for raw in sample.raw_items)
    return (
        f"user {len(sample.user_text)} B, assistant {len(sample.assistant_text)} B, "
        f"replay items {sizes} B (user input, reasoning, assistant message)"
    )
