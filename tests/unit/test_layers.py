"""The test layers themselves, as tests/unit/test_architecture.py checks service/'s:

    tests/unit          no database, no processes: `make test-fast` runs exactly this folder
    tests/integration   real PostgreSQL (apps in-process, over real HTTP on loopback)
    tests/system        processes, browsers, the SDKs under Node, Citus, the previous release
    tests/contracts     suites that more than one layer runs (each module names its BACKENDS)
    tests/support       helpers and fakes, imported as tests.support.X

Each fixture is defined once (read from the source with ast), and a unit test that needs a
database fails (tests/conftest.py refuses the fixture).
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import DATABASE_FIXTURES, UNIT

TESTS = Path(__file__).resolve().parents[1]
LAYERS = ("unit", "integration", "system", "contracts", "support", "js", "browser")


def _fixture_name(node: ast.AST) -> str | None:
    """The name a function defines a fixture under (``@pytest.fixture``, with or without
    arguments, ``name=`` included), or None."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    for decorator in node.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        target = call.func if call else decorator
        if ast.unparse(target) in ("pytest.fixture", "fixture"):
            named = [k.value for k in (call.keywords if call else []) if k.arg == "name"]
            return str(ast.literal_eval(named[0])) if named else node.name
    return None


@functools.cache
def fixtures_by_name() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(TESTS.rglob("*.py")):
        text = path.read_text()
        # A module that never says "fixture" defines none (the decorator is pytest.fixture or
        # fixture): only the others are parsed.
        if "node_modules" in path.parts or "fixture" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (name := _fixture_name(node)) is not None:
                found[name].append(f"{path.relative_to(TESTS)}:{node.lineno}")
    return found


def test_no_fixture_is_defined_twice() -> None:
    twice = {name: places for name, places in fixtures_by_name().items() if len(places) > 1}
    assert twice == {}, "one definition each: share it from the conftest.py of the layers using it"


def test_the_check_sees_fixtures_however_they_are_written() -> None:
    source = (
        "import pytest\n"
        "@pytest.fixture\ndef a(): ...\n"
        "@pytest.fixture(scope='module')\nasync def b(): ...\n"
        "@pytest.fixture(name='c')\ndef c_fixture(): ...\n"
        "def not_one(): ...\n"
    )
    names = [_fixture_name(node) for node in ast.parse(source).body]
    assert [n for n in names if n] == ["a", "b", "c"]


def test_the_database_fixtures_are_the_conftests_for_every_layer() -> None:
    defined = fixtures_by_name()
    assert set(defined) >= DATABASE_FIXTURES, DATABASE_FIXTURES - set(defined)
    assert {name: [p.split(":")[0] for p in defined[name]] for name in DATABASE_FIXTURES} == {
        name: ["conftest.py"] for name in DATABASE_FIXTURES
    }


def test_the_tests_folder_holds_only_the_layers() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= set(LAYERS), folders - set(LAYERS)
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], "a test module belongs in the folder of its layer"


def test_no_unit_test_needs_the_database(request: pytest.FixtureRequest) -> None:
    """Every unit test collected with this one asks for no database fixture, directly or
    through another fixture (a fixture asked for at run time is refused by tests/conftest.py)."""
    units = [item for item in request.session.items if UNIT in Path(item.path).parents]
    assert len(units) > 1
    needing = {
        item.nodeid: sorted(DATABASE_FIXTURES & set(getattr(item, "fixturenames", ())))
        for item in units
    }
    assert {k: v for k, v in needing.items() if v} == {}


@pytest.mark.parametrize("fixture", ["database", "target"])
def test_a_unit_test_asking_for_the_database_at_run_time_fails(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    """Refused before the fixture runs. (A session-scoped one, ``server_url`` and the like, is
    refused when a unit test is the first to ask, as in `make test-fast`; asked for by name,
    any is caught by the test above.)"""
    if fixture == "target":  # in tests/unit, in memory: no database
        assert request.getfixturevalue("target").database_url is None
        return
    with pytest.raises(pytest.fail.Exception, match="is a unit test but needs `"):
        request.getfixturevalue(fixture)
