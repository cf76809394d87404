"""The import graph of service/: controllers -> use case -> ports -> adapters, nothing back up.

Read from the source with ast (no imports run). A module may import its own layer or lower
ones; concrete adapters are named only by the wiring (service/app.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"

# Lowest first. A module not listed belongs to the layer of its package's entry.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundation",
        {
            "service.errors", "service.model", "service.strictjson", "service.settings",
            "service.logs", "service.metrics", "service.shutdown", "service.migrate",
            "service.embedded", "service.db", "service.tracing", "service.crypto",
        },
    ),
    (
        "ports",
        {
            "service.store.base", "service.providers.base", "service.tools",
            "service.tools.registry", "service.tools.executor", "service.tools.gate",
        },
    ),
    (
        "adapters",
        {
            "service.store.postgres", "service.store.cache", "service.store.memory",
            "service.store.keys", "service.store.tables", "service.store.tx",
            "service.store.cursor", "service.store.idempotency", "service.store.pages",
            "service.store.listener", "service.store.runs", "service.store.keyring",
            "service.store.sealed", "service.store.encrypting", "service.store.placement",
            "service.providers.fake",
            "service.providers.responses", "service.tools.lookup",
        },
    ),
    (
        "use case",
        {
            "service.window", "service.plans", "service.exchange", "service.locks",
            "service.leases", "service.turns", "service.runs", "service.items", "service.relay",
        },
    ),
    ("http", {"service.auth", "service.http_server"}),
    ("wiring", {"service.app", "service.cli"}),
]  # fmt: skip
ADAPTER_INTERNALS = {
    "service.store.tables", "service.store.tx", "service.store.cursor",
    "service.store.idempotency", "service.store.pages",
}  # fmt: skip
ADAPTERS = LAYERS[2][1] - ADAPTER_INTERNALS
WIRING = LAYERS[-1][1]


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVICE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    if module.startswith("service.api"):
        return 4
    for number, (_, members) in enumerate(LAYERS):
        if module in members:
            return number
    raise AssertionError(f"{module} is in no layer: add it to tests/test_architecture.py")


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("service"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("service")}
    known = {module_name(p) for p in SERVICE.rglob("*.py")}
    return found & known - PACKAGES


PACKAGES = {"service", "service.store", "service.providers", "service.api"}  # empty __init__


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in SERVICE.rglob("*.py") if p.name != "__main__.py"}


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} ({LAYERS[layer(module)][0] if layer(module) != 4 else 'api'}) imports {target}"
        for module, targets in graph().items()
        if module not in PACKAGES
        for target in targets
        if layer(target) > layer(module)
    ]
    assert upward == []


def test_only_the_wiring_names_concrete_adapters() -> None:
    named = {
        (module, target)
        for module, targets in graph().items()
        for target in targets & ADAPTERS
        if module not in ADAPTERS and module not in WIRING
    }
    assert named == set()


def test_the_use_case_sees_ports_only() -> None:
    use_case = LAYERS[3][1]
    assert all(not (graph()[module] & LAYERS[2][1]) for module in use_case)
