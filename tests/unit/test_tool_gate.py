"""The tool gate, step by step, and the registry and example tool behind it.

Blocking tools wait on threading.Events the tests set; no test sleeps to let a race settle.
The only short timeouts are for calls whose tool is known to be blocked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.tools import (
    MAX_ARGUMENT_CHARS,
    MAX_RESULT_CHARS,
    ToolCallRecord,
    ToolExecutor,
    ToolGate,
    ToolRegistry,
    ToolStatus,
    cancel_requested,
)
from service.tools.lookup import LookupTool
from tests.support.tools_fixtures import SECRET, Cooperative, Echo, Explodes, Returns, Stubborn

S = ToolStatus
WAIT_S = 5.0  # bound for waits on events that are expected to happen promptly
BLOCKED_TIMEOUT_S = 0.05  # only for calls whose tool is blocked until the test releases it
MIXED_TIMEOUT_S = 1.0  # a gate that must time one call out and let quick ones finish, under load


@pytest.fixture
def executor() -> Iterator[ToolExecutor]:
    executor = ToolExecutor(workers=1)
    yield executor
    executor.shutdown()


def gate(
    tools: list[Any], executor: ToolExecutor, *, budget: int = 8, timeout_s: float = WAIT_S
) -> ToolGate:
    return ToolGate(ToolRegistry(tools), executor, budget=budget, timeout_s=timeout_s)


async def wait_for(event: Any) -> None:
    """A threading.Event set by a tool thread, awaited without blocking the loop."""
    assert await asyncio.to_thread(event.wait, WAIT_S)


async def idle(executor: ToolExecutor) -> None:
    assert await asyncio.to_thread(executor.wait_idle, WAIT_S)


@pytest.fixture
async def stubborn(executor: ToolExecutor) -> AsyncIterator[Stubborn]:
    tool = Stubborn()
    yield tool
    tool.release.set()  # never leave a worker blocked past the test
    await idle(executor)


# --- the record and what goes back to the model ---------------------------------------------


async def test_an_ok_call_returns_the_result_and_records_the_proposal(
    executor: ToolExecutor,
) -> None:
    echo = Echo()
    record = await gate([echo], executor).call(
        "call_1", "echo", '{"text": "hi", "options": {"upper": true}}'
    )
    assert record == ToolCallRecord(
        call_id="call_1",
        name="echo",
        arguments='{"text": "hi", "options": {"upper": true}}',
        accepted=True,
        status=S.OK,
        result="HI",
        duration_ms=record.duration_ms,
    )
    assert record.duration_ms >= 0
    assert json.loads(record.output()) == {"status": "OK", "result": "HI"}
    assert echo.runs == 1


@pytest.mark.parametrize("status", [s for s in ToolStatus if s is not S.OK])
def test_every_other_status_sends_a_null_result(status: ToolStatus) -> None:
    record = ToolCallRecord("c", "echo", "{}", True, status, None, 1.0)
    assert json.loads(record.output()) == {"status": str(status), "result": None}


# --- 1. argument size -------------------------------------------------------------------------


def padded(arguments: str, size: int) -> str:
    """Valid JSON of exactly ``size`` characters: the same object, padded with whitespace."""
    return arguments[:-1] + " " * (size - len(arguments)) + "}"


async def test_arguments_at_the_size_limit_pass(executor: ToolExecutor) -> None:
    record = await gate([Echo()], executor).call(
        "c", "echo", padded('{"text": "a"}', MAX_ARGUMENT_CHARS)
    )
    assert record.status is S.OK


async def test_arguments_over_the_size_limit_are_invalid_before_anything_else(
    executor: ToolExecutor,
) -> None:
    echo = Echo()
    arguments = padded('{"text": "a"}', MAX_ARGUMENT_CHARS + 1)  # otherwise a perfect call
    record = await gate([echo], executor).call("c", "echo", arguments)
    assert (record.status, record.accepted, echo.runs) == (S.INVALID, False, 0)
    # The record keeps a bounded prefix and says how long the original was.
    assert len(record.arguments) == MAX_ARGUMENT_CHARS
    assert record.arguments.endswith(f"…[{MAX_ARGUMENT_CHARS + 1} characters]")


async def test_a_proposed_name_is_clipped_in_the_record(executor: ToolExecutor) -> None:
    record = await gate([Echo()], executor).call("c", "x" * 10_000, "{}")
    assert record.status is S.UNKNOWN_TOOL
    assert len(record.name) == 200 and record.name.endswith("…[10000 characters]")


# --- 2. strict JSON ---------------------------------------------------------------------------

NOT_ONE_JSON_OBJECT = [
    "",
    "{",
    '{"text": "a", "text": "b"}',  # duplicate keys
    '{"text": "a"} {}',  # trailing content
    '{"text": "a"}x',
    '["text"]',
    '"text"',
    "null",
    "42",
    '{"text": "a", "n": NaN}',  # Python's extensions, not JSON
    '{"text": "a", "n": [1e999]}',
]


@pytest.mark.parametrize("arguments", NOT_ONE_JSON_OBJECT)
@pytest.mark.parametrize("name", ["echo", "no_such_tool"])
async def test_anything_but_one_strict_json_object_is_invalid(
    executor: ToolExecutor, name: str, arguments: str
) -> None:
    # For the unknown tool too: strict JSON is checked before the registry.
    record = await gate([Echo()], executor).call("c", name, arguments)
    assert (record.status, record.accepted, record.result) == (S.INVALID, False, None)


# --- 3. registry ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nope", "ECHO", "echo ", "../echo", ""])
async def test_a_name_not_registered_is_unknown_and_nothing_runs(
    executor: ToolExecutor, name: str
) -> None:
    echo = Echo()
    record = await gate([echo], executor).call("c", name, '{"text": "a"}')
    assert (record.status, record.accepted, echo.runs) == (S.UNKNOWN_TOOL, False, 0)
    assert json.loads(record.output()) == {"status": "UNKNOWN_TOOL", "result": None}


# --- 4. schema --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        "{}",  # required missing
        '{"text": 1}',  # wrong type
        '{"text": "' + "a" * 101 + '"}',  # over maxLength
        '{"text": "a", "path": "../secret"}',  # extra field at the top (schema is silent)
        '{"text": "a", "options": {"upper": true, "path": "../secret"}}',  # extra, nested
        '{"text": "a", "options": []}',
    ],
)
async def test_arguments_outside_the_schema_are_invalid_and_nothing_runs(
    executor: ToolExecutor, arguments: str
) -> None:
    echo = Echo()
    record = await gate([echo], executor).call("c", "echo", arguments)
    assert (record.status, record.accepted, echo.runs) == (S.INVALID, False, 0)


async def test_an_explicitly_closed_schema_refuses_a_path_too(
    executor: ToolExecutor, tmp_path: Path
) -> None:
    lookup = LookupTool(data_file=tmp_path / "never-read.json")
    record = await gate([lookup], executor).call("c", "lookup", '{"key": "a", "path": "../secret"}')
    assert record.status is S.INVALID


# --- 5. budget, 6. admission ------------------------------------------------------------------


async def test_admitted_calls_consume_the_budget_whatever_their_outcome(
    executor: ToolExecutor,
) -> None:
    cooperative = Cooperative()  # gives a TIMEOUT that frees its worker promptly
    tools = [Echo(), Returns("missing", None), Explodes(), cooperative]
    turn = gate(tools, executor, budget=4, timeout_s=MIXED_TIMEOUT_S)
    assert (await turn.call("1", "echo", '{"text": "a"}')).status is S.OK
    assert (await turn.call("2", "missing", "{}")).status is S.NOT_FOUND
    assert (await turn.call("3", "explode", "{}")).status is S.TOOL_ERROR
    assert (await turn.call("4", "cooperative", "{}")).status is S.TIMEOUT
    await wait_for(cooperative.stopped_early)
    await idle(executor)
    last = await turn.call("5", "echo", '{"text": "a"}')
    assert (last.status, last.accepted) == (S.BUDGET, True)
    assert json.loads(last.output()) == {"status": "BUDGET", "result": None}


async def test_refused_calls_do_not_consume_the_budget(
    executor: ToolExecutor, stubborn: Stubborn
) -> None:
    echo = Echo()
    turn = gate([echo], executor, budget=1)
    other_turn = gate([stubborn], executor)
    holder = asyncio.create_task(other_turn.call("h", "stubborn", "{}"))  # takes the only worker
    await wait_for(stubborn.started)
    assert (await turn.call("1", "echo", "{}")).status is S.INVALID
    assert (await turn.call("2", "nope", "{}")).status is S.UNKNOWN_TOOL
    assert (await turn.call("3", "echo", '{"text": "a"}')).status is S.BUSY
    stubborn.release.set()
    assert (await holder).status is S.OK
    assert (await turn.call("4", "echo", '{"text": "a"}')).status is S.OK  # the one admitted call
    assert (await turn.call("5", "echo", '{"text": "a"}')).status is S.BUDGET
    assert echo.runs == 1


async def test_budget_is_checked_after_the_schema_and_before_admission(
    executor: ToolExecutor, stubborn: Stubborn
) -> None:
    echo = Echo()
    spent = gate([echo], executor, budget=0)
    holder = asyncio.create_task(gate([stubborn], executor).call("h", "stubborn", "{}"))
    await wait_for(stubborn.started)  # no worker is free from here on
    assert (await spent.call("1", "echo", '{"text": 1}')).status is S.INVALID
    assert (await spent.call("2", "nope", '{"text": "a"}')).status is S.UNKNOWN_TOOL
    assert (await spent.call("3", "echo", '{"text": "a"}')).status is S.BUDGET  # not BUSY
    stubborn.release.set()
    await holder
    assert echo.runs == 0


async def test_admission_is_exact_with_no_queue() -> None:
    executor = ToolExecutor(workers=2)
    tools = [Stubborn(), Stubborn(), Stubborn()]
    calls = [gate([tool], executor).call(str(i), "stubborn", "{}") for i, tool in enumerate(tools)]
    tasks = [asyncio.create_task(call) for call in calls]
    for tool in tools[:2]:
        await wait_for(tool.started)
    third = await tasks[2]  # refused at once, while both workers are blocked
    assert third.status is S.BUSY and not tools[2].started.is_set()
    assert executor.busy == 2
    for tool in tools:
        tool.release.set()
    assert [r.status for r in await asyncio.gather(*tasks[:2])] == [S.OK, S.OK]
    await idle(executor)
    executor.shutdown()


async def test_a_shut_down_executor_admits_nothing_and_does_not_wait(stubborn: Stubborn) -> None:
    executor = ToolExecutor(workers=2)
    holder = asyncio.create_task(gate([stubborn], executor).call("h", "stubborn", "{}"))
    await wait_for(stubborn.started)
    executor.shutdown()  # returns although a tool is stuck
    assert (await gate([Echo()], executor).call("c", "echo", '{"text": "a"}')).status is S.BUSY
    stubborn.release.set()
    assert (await holder).status is S.OK


# --- 7. timeout -------------------------------------------------------------------------------


async def test_a_tool_that_ignores_cancellation_keeps_its_worker_until_it_returns(
    executor: ToolExecutor, stubborn: Stubborn
) -> None:
    echo = Echo()
    turn = gate([stubborn, echo], executor, budget=8, timeout_s=BLOCKED_TIMEOUT_S)
    timed_out = await turn.call("1", "stubborn", "{}")
    assert (timed_out.status, timed_out.accepted, timed_out.result) == (S.TIMEOUT, True, None)
    assert json.loads(timed_out.output()) == {"status": "TIMEOUT", "result": None}
    await wait_for(stubborn.started)  # admitted means it runs, even after the timeout
    assert stubborn.side_effects == 0

    busy = await turn.call("2", "echo", '{"text": "a"}')  # the stuck tool still holds the worker
    assert (busy.status, echo.runs) == (S.BUSY, 0)

    stubborn.release.set()
    await wait_for(stubborn.finished)
    await idle(executor)
    assert stubborn.side_effects == 1  # it did happen, once: TIMEOUT never meant "not done"
    assert stubborn.cancel_seen_at_end is True  # it was asked to stop; it just did not look

    after = await gate([echo], executor).call("3", "echo", '{"text": "a"}')
    assert (after.status, after.result) == (S.OK, "a")
    assert stubborn.side_effects == 1  # no retry


async def test_a_cooperative_tool_sees_the_cancellation_and_frees_its_worker(
    executor: ToolExecutor,
) -> None:
    cooperative = Cooperative()
    turn = gate([cooperative, Echo()], executor, timeout_s=BLOCKED_TIMEOUT_S)
    assert (await turn.call("1", "cooperative", "{}")).status is S.TIMEOUT
    await wait_for(cooperative.stopped_early)  # nobody released it: it stopped on its own
    await idle(executor)
    assert (await gate([Echo()], executor).call("2", "echo", '{"text": "a"}')).status is S.OK


async def test_a_cooperative_tool_that_finishes_in_time_is_ok(executor: ToolExecutor) -> None:
    cooperative = Cooperative()
    cooperative.release.set()
    record = await gate([cooperative], executor).call("1", "cooperative", "{}")
    assert (record.status, record.result) == (S.OK, "finished")
    assert not cooperative.stopped_early.is_set()


async def test_waiting_does_not_block_the_loop_and_an_abandoned_turn_cancels_the_tool(
    executor: ToolExecutor,
) -> None:
    cooperative = Cooperative()
    task = asyncio.create_task(gate([cooperative], executor).call("1", "cooperative", "{}"))
    await wait_for(cooperative.started)  # this coroutine runs while the call waits
    assert not task.done()
    task.cancel()  # e.g. the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(cooperative.stopped_early)
    await idle(executor)


def test_cancel_requested_is_false_outside_a_tool_call() -> None:
    assert cancel_requested() is False


# --- 8. results -------------------------------------------------------------------------------


async def test_none_is_not_found_and_no_result_is_invented(executor: ToolExecutor) -> None:
    record = await gate([Returns("missing", None)], executor).call("c", "missing", "{}")
    assert (record.status, record.accepted, record.result) == (S.NOT_FOUND, True, None)
    assert json.loads(record.output()) == {"status": "NOT_FOUND", "result": None}


async def test_a_result_at_the_cap_is_ok(executor: ToolExecutor) -> None:
    text = "é" * MAX_RESULT_CHARS  # characters, not bytes
    record = await gate([Returns("full", text)], executor).call("c", "full", "{}")
    assert (record.status, record.result) == (S.OK, text)
    assert json.loads(record.output())["result"] == text


async def test_a_result_over_the_cap_goes_to_the_model_truncated_and_says_so(
    executor: ToolExecutor,
) -> None:
    text = "é" * MAX_RESULT_CHARS + "TAIL"
    record = await gate([Returns("long", text)], executor).call("c", "long", "{}")
    assert (record.status, record.result, record.truncated) == (S.OK, text[:-4], True)
    assert json.loads(record.output()) == {"status": "OK", "result": text[:-4], "truncated": True}


async def test_arguments_with_lone_surrogates_never_reach_the_tool(executor: ToolExecutor) -> None:
    echo = Echo()
    record = await gate([echo], executor).call("c", "echo", '{"text": "\\ud800"}')
    assert (record.status, record.accepted, echo.runs) == (S.INVALID, False, 0)


@pytest.mark.parametrize(
    "value",
    [42, b"bytes", ["a"], "lone \ud800 surrogate"],
    ids=["int", "bytes", "list", "surrogate"],
)
async def test_an_unusable_result_is_a_tool_error(
    executor: ToolExecutor, caplog: pytest.LogCaptureFixture, value: Any
) -> None:
    record = await gate([Returns("odd", value)], executor).call("c", "odd", "{}")
    assert (record.status, record.accepted, record.result) == (S.TOOL_ERROR, True, None)
    assert json.loads(record.output()) == {"status": "TOOL_ERROR", "result": None}
    assert any(r.name == "turnstore.tools" and r.levelno == logging.WARNING for r in caplog.records)


async def test_an_exception_is_a_tool_error_and_its_text_stays_in_the_log(
    executor: ToolExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="turnstore.tools")
    arguments = '{"note": "ARGUMENT-MARKER"}'
    record = await gate([Explodes()], executor).call("c", "explode", arguments)
    assert (record.status, record.accepted, record.result) == (S.TOOL_ERROR, True, None)
    assert SECRET not in repr(record) and SECRET not in record.output()
    [logged] = [r for r in caplog.records if r.name == "turnstore.tools"]
    assert logged.levelno == logging.WARNING and logged.exc_info is not None
    assert SECRET in caplog.text  # the operator sees why
    assert "ARGUMENT-MARKER" not in caplog.text  # but not what the model sent


# --- the registry -----------------------------------------------------------------------------


def test_definitions_advertise_the_closed_schema_as_function_tools() -> None:
    echo = Echo()
    [definition] = ToolRegistry([echo]).definitions()
    assert definition == {
        "type": "function",
        "name": "echo",
        "description": "Echo a text.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string", "maxLength": 100},
                "options": {
                    "type": "object",
                    "properties": {"upper": {"type": "boolean"}},
                    "additionalProperties": False,
                },
            },
            "required": ["text"],
            "additionalProperties": False,
        },
        "strict": False,
    }
    assert "additionalProperties" not in echo.parameters  # the tool's own dict is untouched
    definition["parameters"]["additionalProperties"] = True  # nor can a caller reopen it
    assert ToolRegistry([echo]).definitions()[0]["parameters"]["additionalProperties"] is False


def test_closing_leaves_data_and_explicit_choices_alone() -> None:
    tool = Returns("maps", None)
    tool.parameters = {
        "type": "object",
        "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "choice": {"enum": [{"properties": {}}], "default": {"type": "object"}},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    [definition] = ToolRegistry([tool]).definitions()
    properties = definition["parameters"]["properties"]
    assert properties["labels"]["additionalProperties"] == {"type": "string"}
    assert properties["choice"] == {"enum": [{"properties": {}}], "default": {"type": "object"}}
    assert definition["parameters"]["$defs"]["point"]["additionalProperties"] is False


@pytest.mark.parametrize("spec", [None, "", "  "])
def test_an_empty_spec_is_an_empty_registry(spec: str | None) -> None:
    registry = ToolRegistry.from_spec(spec)
    assert len(registry) == 0 and registry.definitions() == []


def test_a_spec_imports_module_level_objects_by_path() -> None:
    registry = ToolRegistry.from_spec(
        "tests.support.tools_fixtures:echo, service.tools.lookup:lookup"
    )
    assert len(registry) == 2
    assert [d["name"] for d in registry.definitions()] == ["echo", "lookup"]
    assert registry.get("echo") is not None and registry.get("explode") is None


@pytest.mark.parametrize(
    ("spec", "entry", "reason"),
    [
        (
            "tests.support.tools_fixtures:bad_name",
            "tests.support.tools_fixtures:bad_name",
            "does not match",
        ),
        (
            "tests.support.tools_fixtures:echo,tests.support.tools_fixtures:echo",
            "tests.support.tools_fixtures:echo",
            "duplicate",
        ),
        ("tests.no_such_module:echo", "tests.no_such_module:echo", "cannot import"),
        (
            "tests.support.tools_fixtures:no_such_attr",
            "tests.support.tools_fixtures:no_such_attr",
            "has no",
        ),
        ("tests.support.tools_fixtures", "tests.support.tools_fixtures", "expected"),
        (
            "tests.support.tools_fixtures:echo:run",
            "tests.support.tools_fixtures:echo:run",
            "expected",
        ),
        ("tests/tools_fixtures.py:echo", "tests/tools_fixtures.py:echo", "expected"),
        ("tests.support.tools_fixtures:echo,", "", "expected"),
        (
            "tests.support.tools_fixtures:string_schema",
            "tests.support.tools_fixtures:string_schema",
            "type 'object'",
        ),
        (
            "tests.support.tools_fixtures:broken_schema",
            "tests.support.tools_fixtures:broken_schema",
            "not a valid JSON Schema",
        ),
        (
            "tests.support.tools_fixtures:not_a_tool",
            "tests.support.tools_fixtures:not_a_tool",
            "does not match",
        ),
        (
            "tests.support.tools_fixtures:Stubborn",
            "tests.support.tools_fixtures:Stubborn",
            "is a class",
        ),
    ],
)
def test_a_bad_spec_entry_is_named_in_the_error(spec: str, entry: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"TOOLS entry {entry!r}: ") + ".*" + reason):
        ToolRegistry.from_spec(spec)


@pytest.mark.parametrize(
    "name", ["", "Echo", "1echo", "echo\n", "e" * 65, "ech o", "écho", "\u0435cho"]
)
def test_the_registry_refuses_names_outside_the_pattern(name: str) -> None:
    tool = Echo()
    tool.name = name
    with pytest.raises(ValueError, match="does not match"):
        ToolRegistry([tool])


def test_the_longest_allowed_name_is_accepted() -> None:
    tool = Echo()
    tool.name = "e" + "-_9" * 21
    assert len(ToolRegistry([tool])) == 1


# --- the lookup tool --------------------------------------------------------------------------


def data_file(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "lookup.json"
    path.write_text(content, encoding="utf-8")
    return path


async def test_lookup_finds_a_key_and_reports_a_missing_one(
    executor: ToolExecutor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOKUP_DATA_FILE", str(data_file(tmp_path, '{"capital": "Paris"}')))
    turn = gate([LookupTool()], executor)
    found = await turn.call("1", "lookup", '{"key": "capital"}')
    assert json.loads(found.output()) == {"status": "OK", "result": "Paris"}
    assert (await turn.call("2", "lookup", '{"key": "nope"}')).status is S.NOT_FOUND
    assert (await turn.call("3", "lookup", '{"key": ""}')).status is S.INVALID


def test_lookup_reads_its_file_once(tmp_path: Path) -> None:
    path = data_file(tmp_path, '{"a": "1"}')
    lookup = LookupTool(data_file=path)
    assert lookup.run({"key": "a"}) == "1"
    path.write_text('{"a": "2"}', encoding="utf-8")
    assert lookup.run({"key": "a"}) == "1"


@pytest.mark.parametrize(
    "content",
    [None, "not json", '["a"]', '{"a": 1}', '{"a": "1", "a": "2"}', '{"a": "1"} x'],
    ids=["missing", "malformed", "not-object", "non-string", "duplicate", "trailing"],
)
async def test_a_bad_lookup_file_is_a_tool_error_and_a_log_line(
    executor: ToolExecutor, tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str | None
) -> None:
    path = tmp_path / "lookup.json" if content is None else data_file(tmp_path, content)
    record = await gate([LookupTool(data_file=path)], executor).call("c", "lookup", '{"key": "a"}')
    assert (record.status, record.result) == (S.TOOL_ERROR, None)
    assert str(path) in caplog.text and str(path) not in record.output()


def test_lookup_without_a_configured_file_fails_on_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOOKUP_DATA_FILE", raising=False)
    with pytest.raises(RuntimeError, match="LOOKUP_DATA_FILE is not set"):
        LookupTool().run({"key": "a"})


def test_a_fixed_lookup_file_is_read_again(tmp_path: Path) -> None:
    path = data_file(tmp_path, "not json")
    lookup = LookupTool(data_file=path)
    with pytest.raises(RuntimeError):
        lookup.run({"key": "a"})
    path.write_text('{"a": "1"}', encoding="utf-8")
    assert lookup.run({"key": "a"}) == "1"
