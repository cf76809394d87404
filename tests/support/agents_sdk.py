"""What the OpenAI Agents SDK tests share: its tracing off (it would export to OpenAI), and a
client-side function tool that records each city it ran for."""

from __future__ import annotations

from agents import function_tool, set_tracing_disabled

set_tracing_disabled(True)
ran: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    ran.append(city)
    return f"sunny in {city}"
