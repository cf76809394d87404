"""`python -m bench.seams`: issue 30's structural figures, read from the source with ast.

TurnPlan's fields; functions of service/ over 8 parameters (less self/cls); the text
`Callable` in service/core/; api/compat/responses.py's lines and its longest route handler;
`# fmt: skip` in service/; the largest store Protocol's methods; store classes whose base is a
class of another module; module basenames that repeat in service/; pytest fixtures defined in
more than one file of tests/; import circles over service/ and migrations/ (every import
outside TYPE_CHECKING, function-level ones too). `duplicates --repo service`, `make test-fast`
and `make coverage-unit` give the rest.
"""

from __future__ import annotations

import ast
import collections
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_BASES = {"Protocol", "object", "Exception", "RuntimeError", "ValueError", "NamedTuple"}


def _parse(paths: list[Path]) -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in paths}


def _classes(tree: ast.AST) -> list[ast.ClassDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    count += bool(args.vararg) + bool(args.kwarg)
    listed = [*args.posonlyargs, *args.args]
    return count - (1 if listed and listed[0].arg in ("self", "cls") else 0)


def _name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Name):
        return base.id
    return base.attr if isinstance(base, ast.Attribute) else None


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _circles(trees: dict[Path, ast.Module]) -> list[list[str]]:
    modules = {_module(path): path for path in trees}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        skipped = {
            id(inner)
            for node in ast.walk(trees[path])
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        for node in ast.walk(trees[path]):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([node.module] if node.module else []))
                named = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t for t in named if t in modules] or [base]
                if any(t not in modules for t in named):
                    targets.append(base)
            graph[name] |= {t for t in targets if t in modules and t != name}
    return _strongly_connected(list(modules), graph)


def _strongly_connected(nodes: list[str], graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(10_000)
    for node in nodes:
        if node not in index:
            visit(node)
    return found


def figures() -> Iterator[str]:
    service = sorted((REPO / "service").rglob("*.py"))
    trees = _parse(service + sorted((REPO / "migrations").glob("*.py")))
    for path in service:
        for cls in _classes(trees[path]):
            if cls.name == "TurnPlan":
                fields = sum(isinstance(line, ast.AnnAssign) for line in cls.body)
                yield f"TurnPlan fields: {fields}"
    wide = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
        for path in service
        for node in _functions(trees[path])
        if _parameters(node) > 8
    ]
    yield f"functions over 8 parameters: {len(wide)} {wide}"
    core = [p for p in service if p.is_relative_to(REPO / "service" / "core")]
    yield f"Callable in service/core/: {sum(p.read_text().count('Callable') for p in core)}"
    routes = REPO / "service" / "api" / "compat" / "responses.py"
    handlers = [n for n in _functions(trees[routes]) if n.decorator_list]
    longest = max((n.end_lineno or n.lineno) - n.lineno + 1 for n in handlers)
    lines = len(routes.read_text().splitlines())
    yield f"api/compat/responses.py: {lines} lines, longest route handler {longest} lines"
    yield f"# fmt: skip in service/: {sum(p.read_text().count('# fmt: skip') for p in service)}"
    protocols = [
        (sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in c.body), c.name)
        for path in service
        for c in _classes(trees[path])
        if any(_name(base) == "Protocol" for base in c.bases)
    ]
    yield f"largest Protocol: {max(protocols)}"
    inherited = []
    for path in service:
        if not path.is_relative_to(REPO / "service" / "store"):
            continue
        local = {c.name for c in _classes(trees[path])}
        for cls in _classes(trees[path]):
            names = {_name(base) for base in cls.bases} - local - _BASES - {None}
            inherited += [f"{path.relative_to(REPO)} {cls.name}({n})" for n in names]
    yield f"store classes subclassing another module's class: {len(inherited)} {inherited}"
    names = collections.Counter(p.name for p in service if p.name != "__init__.py")
    yield f"repeated module basenames: {sorted(n for n, c in names.items() if c > 1)}"
    fixtures: dict[str, set[str]] = collections.defaultdict(set)
    for path in (REPO / "tests").rglob("*.py"):
        for node in _functions(ast.parse(path.read_text())):
            if any("fixture" in ast.unparse(d) for d in node.decorator_list):
                fixtures[node.name].add(str(path.relative_to(REPO)))
    twice = sorted(name for name, files in fixtures.items() if len(files) > 1)
    yield f"fixtures defined in more than one file: {twice}"
    yield f"import circles: {_circles(trees)}"


if __name__ == "__main__":
    for line in figures():
        print(line)
