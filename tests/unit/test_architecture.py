"""The import graph of service/, by folder: each folder is a layer, and a module may import its
own layer or lower ones, never a higher one.

    core/        values, rules and errors: imports nothing of service/ but core/
    platform/    settings, database engine, crypto, metrics, tracing, logs, shutdown, migrations
    ports        store/ports.py, providers/base.py, tools/ (the gate): what use cases see
    adapters     the rest of store/ and providers/, tools/lookup.py: named only by the wiring
    usecases/    turns, runs, leases, the exchange, the relay, item edits, responses
    api/         HTTP: controllers, rendering (api/compat/), errors -> responses, auth
    wiring       app.py and cli.py, the only modules that build adapters

And no import circle, among service/ and migrations/ both, counting the imports inside
functions too.

Read from the source with ast (no imports run).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service"

# Lowest first: (layer, the paths under service/ that belong to it). The longest matching
# path decides, so a port inside an adapter's folder is named on its own.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("core",)),
    ("platform", ("platform",)),
    ("ports", ("store/ports.py", "providers/base.py", "tools")),
    ("adapters", ("store", "providers", "tools/lookup.py")),
    ("usecases", ("usecases",)),
    ("api", ("api",)),
    ("wiring", ("app.py", "cli.py", "__init__.py")),
]
ADAPTERS = "adapters"


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVICE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(path: Path) -> int:
    relative = path.relative_to(SERVICE).as_posix()
    best: tuple[int, int] | None = None  # (length of the matching path, layer)
    for number, (_, places) in enumerate(LAYERS):
        for place in places:
            if relative == place or relative.startswith(place.removesuffix(".py") + "/"):
                best = max(best or (0, 0), (len(place), number))
    assert best is not None, f"service/{relative} is in no layer: add its folder to LAYERS"
    return best[1]


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A module's syntax tree, read once for all the checks of this module (they only read it)."""
    return ast.parse(path.read_text())


def imports(path: Path, known: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("service"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("service")}
    return {name for name in found if name in known and not _is_package(name)}


def _is_package(name: str) -> bool:
    return (SERVICE.parent / name.replace(".", "/") / "__init__.py").exists()


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in SERVICE.rglob("*.py")}


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, set(known)) for name, path in known.items()}


@functools.cache
def layer(module: str) -> int:
    return layer_of(modules()[module])


def test_every_module_is_in_a_layer() -> None:
    for path in SERVICE.rglob("*.py"):
        layer_of(path)


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} ({LAYERS[layer(module)][0]}) imports {target} ({LAYERS[layer(target)][0]})"
        for module, targets in graph().items()
        for target in targets
        if layer(target) > layer(module)
    ]
    assert upward == []


def test_only_the_wiring_names_concrete_adapters() -> None:
    adapters = LAYERS.index(next(entry for entry in LAYERS if entry[0] == ADAPTERS))
    wiring = len(LAYERS) - 1
    named = {
        (module, target)
        for module, targets in graph().items()
        for target in targets
        if layer(target) == adapters and layer(module) not in (adapters, wiring)
    }
    assert named == set()


def test_the_core_imports_only_the_core() -> None:
    outside = {
        (module, target)
        for module, targets in graph().items()
        if module.startswith("service.core")
        for target in targets
        if not target.startswith("service.core")
    }
    assert outside == set()


def test_nothing_in_service_imports_the_tests() -> None:
    for path in SERVICE.rglob("*.py"):
        tree = parsed(path)
        names = {
            node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert not any(name.split(".")[0] == "tests" for name in names), path


# The packages the product ships: the service and its migrations (platform/migrate.py drives
# migrations/, whose environment connects through platform/db.py).
SHIPPED = (SERVICE, SERVICE.parent / "migrations")


@functools.cache
def every_import() -> dict[str, set[str]]:
    """Module -> the shipped modules it imports, at module level or inside a function (a
    deferred import is a dependency all the same). ``from a import b`` names ``a.b`` when that
    is a module, else ``a``; the package ``__init__`` a submodule's import runs is not counted."""
    known = {module_name(p): p for root in SHIPPED for p in sorted(root.rglob("*.py"))}
    found: dict[str, set[str]] = {}
    for name, path in known.items():
        targets: set[str] = set()
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{name}: a relative import"
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in known else node.module)
        found[name] = {target for target in targets if target in known and target != name}
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_no_import_circle() -> None:
    """No module of service/ or migrations/ reaches itself through its imports: each circle
    found is listed once, as the modules on it."""
    graph = every_import()
    reach = {module: reachable(graph, module) for module in graph}
    circles = sorted(
        {
            tuple(sorted(other for other in reach[module] if module in reach[other]))
            for module in graph
            if module in reach[module]
        }
    )
    assert circles == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert {m for m in graph if m in reachable(graph, m)} == {"a", "b", "c"}


MIGRATIONS = SERVICE.parent / "migrations"


def test_a_migration_imports_nothing_live_but_the_helpers() -> None:
    """A migration carries the SQL it runs (migrations/__init__.py): of the shipped modules it
    imports migrations/live.py only, so no later edit changes what an old migration does."""
    allowed = {"migrations.live"}
    imported = {
        module: sorted(targets - allowed)
        for module, targets in every_import().items()
        if module.startswith(("migrations.versions.", "migrations.keyring."))
    }
    assert imported and {module: t for module, t in imported.items() if t} == {}


def test_each_package_of_the_platform_and_the_migrations_names_its_modules() -> None:
    """The docstring of each package's __init__.py names every module and folder in it."""
    unnamed = {}
    for init in [SERVICE / "platform" / "__init__.py", *sorted(MIGRATIONS.rglob("__init__.py"))]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        inside = [p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        inside += [f"{p.name}/" for p in init.parent.iterdir() if (p / "__init__.py").exists()]
        unnamed[init.parent.name] = sorted(name for name in inside if name not in doc)
    assert unnamed == {name: [] for name in unnamed}
