"""What provider calls cost, in the provider's tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """What a provider call cost, in the provider's tokens (the Responses API's ``usage``);
    added up over the calls of one turn."""

    input_tokens: int = 0
    cached_tokens: int = 0  # of the input tokens, served from the provider's prompt cache
    output_tokens: int = 0
    reasoning_tokens: int = 0  # of the output tokens
    total_tokens: int = 0
    # of the input tokens, written to the provider's prompt cache (Anthropic reports them;
    # last, so usage stored before it decodes with 0)
    cache_write_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.cached_tokens + other.cached_tokens,
            self.output_tokens + other.output_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
            self.total_tokens + other.total_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
        )

    def as_openai(self) -> dict[str, object]:
        """The Responses API's shape (every field the SDKs' types require)."""
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": self.cache_write_tokens,
            },
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.total_tokens,
        }


def added(first: Usage | None, second: Usage | None) -> Usage | None:
    """Two calls' usage added up (None where neither reported any)."""
    if first is None or second is None:
        return first or second
    return first + second


@dataclass(frozen=True)
class UsageTotal:
    """What an owner's committed turns of one day, model or conversation (``key``) cost
    (GET /api/v1/usage)."""

    key: str
    turns: int
    usage: Usage
