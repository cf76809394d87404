"""Flame graphs of the floors part, and the numbers in them.

py-spy records each server (``--format raw --threads``: one line per distinct stack, with its
thread); ``write_svg`` draws the event loop's thread of it as an SVG flame graph (root at the
top, every frame kept, its samples in its tooltip), and the rest reads such an SVG (or a raw
record) back into numbers: each function's share of the samples, inclusive (it or anything it
called was running) and self (it was), self time by package, and with ``--costs`` where the
CPU goes by part of the server, in ms per turn.

    python -m bench.floors.flame bench/flame/turnstore-plain.svg [--top 40] [--under F]
    python -m bench.floors.flame bench/flame/turnstore-plain.svg --share F1,F2 [--share ...]
    python -m bench.floors.flame --costs 0.70,2.52 bench/flame/litestar-plain.svg \
        bench/flame/turnstore-plain.svg      # the ms: each server's CPU per turn, measured

Only the event loop's thread counts: py-spy's default (blocking) sampling counts a thread
waiting on a lock as busy, and Litestar starts a thread pool for its Server-Sent Events (each
stream hands one step to a thread), whose threads then wait there for good."""

from __future__ import annotations

import argparse
import html
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_FRAME = re.compile(
    r'<g><title>(?P<title>[^<]*)</title><rect x="[^"]*" y="(?P<y>[\d.]+)"[^>]*'
    r'fg:x="(?P<x>\d+)" fg:w="(?P<w>\d+)"'
)
_TOTAL = re.compile(r'total_samples="(\d+)"')
_RAW = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


@dataclass
class Frame:
    function: str  # "name (package/file.py:line)"
    x: int
    w: int
    depth: int
    children: list[Frame] = field(default_factory=list)

    @property
    def file(self) -> str:
        found = re.search(r"\(([^():]+):\d+\)$", self.function)
        return found.group(1) if found else ""

    @property
    def self_samples(self) -> int:
        return self.w - sum(child.w for child in self.children)


def from_raw(path: Path) -> tuple[list[Frame], int]:
    """The event loop's thread (py-spy's MainThread) of a ``--format raw --threads`` record,
    as a tree under one root, "all"."""
    root = Frame("all", 0, 0, 0)
    for line in path.read_text().splitlines():
        found = _RAW.match(line)
        if found is None:
            continue
        thread, *stack = found["stack"].split(";")
        if not thread.endswith(": MainThread"):
            continue
        count = int(found["count"])
        node = root
        node.w += count
        for depth, function in enumerate(stack, start=1):
            child = next((c for c in node.children if c.function == function), None)
            if child is None:
                child = Frame(function, 0, 0, depth)
                node.children.append(child)
            child.w += count
            node = child
    _place(root, 0)
    return [root], root.w


def _place(frame: Frame, x: int) -> None:
    frame.x = x
    frame.children.sort(key=lambda f: f.function)
    for child in frame.children:
        _place(child, x)
        x += child.w


_ROW, _TOP, _WIDTH = 16, 40, 1200.0


def write_svg(roots: list[Frame], total: int, out: Path, title: str) -> None:
    """An SVG flame graph of ``roots``: every frame, a label where it fits, the samples in
    each frame's tooltip. Warm colours by file."""
    frames: list[str] = []
    depth = 0

    def draw(frame: Frame) -> None:
        nonlocal depth
        depth = max(depth, frame.depth)
        x, w = frame.x / total * _WIDTH, frame.w / total * _WIDTH
        y = frame.depth * _ROW + _TOP
        hue = sum(frame.file.encode()) % 50
        fits = int(w / 7)  # characters of 7 px
        name = frame.function
        label = name if len(name) <= fits else name[: fits - 2] + ".."
        text = f'<text x="{x + 3:.1f}" y="{y + 11}">{html.escape(label)}</text>' if fits > 3 else ""
        frames.append(
            f"<g><title>{html.escape(name)} ({frame.w:,} samples, {frame.w / total:.2%})</title>"
            f'<rect x="{x / _WIDTH:.4%}" y="{y}" width="{w:.2f}" height="{_ROW - 1}" '
            f'fill="hsl({hue},85%,62%)" fg:x="{frame.x}" fg:w="{frame.w}"/>{text}</g>'
        )
        for child in frame.children:
            draw(child)

    for root in roots:
        draw(root)
    height = (depth + 1) * _ROW + _TOP + 10
    out.write_text(
        f'<?xml version="1.0" standalone="no"?>\n<svg version="1.1" width="{_WIDTH:.0f}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg" xmlns:fg="urn:x-flame" '
        f'fg:total_samples="{total}" total_samples="{total}">\n'
        "<style>text { font-family: monospace; font-size: 11px } "
        "rect { stroke: white; stroke-width: 0.3 }</style>\n"
        f'<text x="{_WIDTH / 2:.0f}" y="24" text-anchor="middle" style="font-size:14px">'
        f"{html.escape(title)}</text>\n" + "\n".join(frames) + "\n</svg>\n"
    )


def read(path: Path) -> tuple[list[Frame], int]:
    """The frames of a flame graph (this module's or py-spy's) and its number of samples."""
    text = path.read_text()
    frames = []
    for m in _FRAME.finditer(text):
        name = re.sub(r" \([\d,]+ samples?, [\d.]+%\)$", "", html.unescape(m["title"]))
        frames.append(Frame(name, int(m["x"]), int(m["w"]), int(float(m["y"]))))
    total = int(_TOTAL.search(text).group(1))  # type: ignore[union-attr]
    depths = sorted({f.depth for f in frames})
    level = {d: i for i, d in enumerate(depths)}
    by_level: dict[int, list[Frame]] = {}
    for f in frames:
        f.depth = level[f.depth]
        by_level.setdefault(f.depth, []).append(f)
    for depth, here in by_level.items():
        parents = sorted(by_level.get(depth - 1, []), key=lambda p: p.x)
        for f in here:
            for parent in parents:
                if parent.x <= f.x < parent.x + parent.w:
                    parent.children.append(f)
                    break
    return [f for f in frames if f.depth == 0], total


def load(path: Path) -> tuple[list[Frame], int]:
    """The event loop's thread of a py-spy raw record, or of a flame graph."""
    if path.suffix == ".svg":
        return loop_thread(read(path)[0])
    return from_raw(path)


def loop_thread(roots: list[Frame]) -> tuple[list[Frame], int]:
    """Without other threads' stacks (they start in Thread._bootstrap)."""
    for root in roots:  # one root, "all"
        others = [f for f in root.children if f.function.startswith("Thread._bootstrap")]
        root.children = [f for f in root.children if f not in others]
        root.w -= sum(f.w for f in others)
    return roots, sum(f.w for f in roots)


def walk(frames: list[Frame], ancestors: tuple[str, ...] = ()) -> tuple[Counter[str], Counter[str]]:
    """Inclusive and self samples per function (a recursive call counted once)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for f in frames:
        if f.function not in ancestors:
            inclusive[f.function] += f.w
        own[f.function] += f.self_samples
        inner, inner_own = walk(f.children, (*ancestors, f.function))
        inclusive.update(inner)
        own.update(inner_own)
    return inclusive, own


def _named(function: str, names: list[str]) -> bool:
    """``function`` ("Class.name (file:line)") is one of ``names`` (prefixes of it, or of
    its name without the class)."""
    bare = function.split(" (")[0].rsplit(".", 1)[-1]
    return any(function.startswith(n) or bare.startswith(n) for n in names)


def find(frames: list[Frame], function: str) -> list[Frame]:
    """The outermost frames of ``function``."""
    found = []
    for f in frames:
        if _named(f.function, [function]):
            found.append(f)
        else:
            found.extend(find(f.children, function))
    return found


def share(frames: list[Frame], names: list[str]) -> int:
    """Samples under any of the functions ``names`` (each sample once)."""
    total = 0
    for f in frames:
        total += f.w if _named(f.function, names) else share(f.children, names)
    return total


# --costs: each sample goes to one part of the server. First the parts named by a function
# anywhere on the sample's stack (in this order: the access log inside uvicorn's send is the
# access log), then by the nearest frame of one of the files of NEAREST.
ANCESTOR = (
    ("uvicorn access log (logging, JSON formatter)", ("Logger.info",)),
    ("fake provider (the reply, decoding the input)", ("FakeProvider.respond", "Reply.of")),
    ("asyncpg: statements on a connection", ("(asyncpg/connection.py", "(asyncpg/prepared")),
    ("SQLAlchemy parameters (Compiled.args)", ("Compiled.args",)),
    (
        "database pool, and SQLAlchemy Core execution",
        (
            "(asyncpg/pool.py",
            "(sqlalchemy/",
            "(service/db.py",
            "(service/platform/db.py",
            "_checked_out",
            "driver (service/store/tx.py",
            "driver (service/store/postgres/tx.py",
            "_Borrowed.",  # since issue 31's second round: driver, and the connections
            "_Lent.",  # lent to the event loop (service/store/postgres/tx.py)
            "greenlet",
        ),
    ),
    ("Litestar: dependency injection", ("resolve_dependencies",)),
    ("Litestar: guard (authorize_connection)", ("authorize_connection",)),
    (
        "before_request body check (decode, dup keys)",
        ("strict_chat_request", "strict.<locals>.check"),
    ),
    ("Litestar: body into the handler's struct", ("KwargsModel.to_kwargs",)),
    ("Litestar: handler result to ASGI response", ("to_response",)),
    ("uvicorn: send (headers, socket write)", ("RequestResponseCycle.send",)),
    ("uvicorn: receive and parse", ("data_received",)),
    ("prometheus_client", ("(prometheus_client/",)),
    (
        "per-send wrappers (timeout, metrics, hook)",
        (
            "bounded_send",
            "observed",
            "capture_response_started",
            "wrapped_send",
            "add_correlation_header",
            "edge_send",
            "_Sends.",
        ),
    ),
    (
        "Server-Sent Events (Litestar's and turnstore's)",
        (
            "sse_events",
            "with_keepalive",
            "(litestar/response/sse.py",
            "(litestar/response/streaming.py",
            "closed_with_response",
            "close_streams",
            "_encoded (service/api/sse.py",
            "EventStream",
        ),
    ),
    (
        "runs (durable turns: task, events, end)",
        (
            "(service/runs.py",
            "(service/store/runs.py",
            "(service/api/turns.py",
            "(service/usecases/runs.py",
            "(service/usecases/run.py",
            "(service/store/postgres/run_store.py",
        ),
    ),
    ("/v1: output items view", ("output_items", "_shown_items")),
    ("/v1: plan_of, check_fields", ("plan_of",)),
)
NEAREST = (
    (
        "turnstore middlewares (since issue 31: the edge)",
        (
            "(service/api/edge.py",
            "(service/api/correlation.py",
            "(service/api/observe.py",
            "(service/api/limits.py",
        ),
    ),
    ("turn code (use case, handler; the floors' turn.py)", ("(service/", "(bench/floors/")),
    ("Litestar: app, router, route, exceptions", ("(litestar/",)),
    ("uvicorn and the event loop (C)", ("(uvicorn/",)),
)


def part(path: tuple[str, ...]) -> str:
    if path == ("all",):  # seen in SQLAlchemy's greenlet switches: no Python frame there
        return "no Python frame (greenlet switches, it seems)"
    for name, keys in ANCESTOR:
        if any(key in frame for frame in path for key in keys):
            return name
    for frame in reversed(path):
        for name, keys in NEAREST:
            if any(key in frame for key in keys):
                return name
    return "other"


def parts(frames: list[Frame], path: tuple[str, ...] = ()) -> Counter[str]:
    """Self samples by part of the server."""
    found: Counter[str] = Counter()
    for f in frames:
        here = (*path, f.function)
        if f.self_samples:
            found[part(here)] += f.self_samples
        found.update(parts(f.children, here))
    return found


def costs(files: list[Path], ms: list[float]) -> None:
    """Each part's share of each profile, and in ms per turn (the share of ``ms``, the CPU
    per turn measured apart); the last column: the last profile's ms less the one before."""
    found = []
    for path in files:
        roots, total = load(path)
        found.append((parts(roots), total))
    last, before = found[-1], found[-2] if len(found) > 1 else found[-1]

    def ms_of(which: tuple[Counter[str], int], m: float, name: str) -> float:
        return which[0][name] / which[1] * m

    names = sorted(
        {n for c, _ in found for n in c},
        key=lambda n: -(ms_of(last, ms[-1], n) - ms_of(before, ms[-2 if len(ms) > 1 else -1], n)),
    )
    head = "".join(f"{p.stem[:19]:>20}" for p in files)
    print(f"{'part (% of samples, ms per turn)':46}{head}{'last - before':>15}")
    for name in names:
        cells = "".join(
            f"{c[name] / t:7.1%} {c[name] / t * m:6.3f} ms"
            for (c, t), m in zip(found, ms, strict=True)
        )
        above = ms_of(last, ms[-1], name) - ms_of(before, ms[-2 if len(ms) > 1 else -1], name)
        print(f"{name[:46]:46}{cells}{above:+12.3f} ms")
    totals = "".join(f"{t:9d} {m:6.3f} ms" for (_, t), m in zip(found, ms, strict=True))
    print(f"{'all (samples, ms)':46}{totals}{ms[-1] - ms[-2 if len(ms) > 1 else -1]:+12.3f} ms")


def package(file: str) -> str:
    parts = file.split("/")
    if parts[0] == "service" and len(parts) > 1:
        return "/".join(parts[:2]).removesuffix(".py")
    return parts[0].removesuffix(".py")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floors.flame")
    parser.add_argument("svg", type=Path, nargs="+", help="flame graphs, or py-spy raw records")
    parser.add_argument("--costs", metavar="MS,MS,...", help="ms of CPU per turn of each")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--under", help="only the samples under this function")
    parser.add_argument(
        "--share", action="append", default=[], metavar="F1,F2,...",
        help="the samples under any of these functions, each sample once",
    )  # fmt: skip
    args = parser.parse_args()
    if args.costs:
        costs(args.svg, [float(m) for m in args.costs.split(",")])
        return
    roots, total = load(args.svg[0])
    if args.under:
        roots = find(roots, args.under)
        print(f"under {args.under}: {sum(f.w for f in roots)} of {total} samples")
    for names in args.share:
        found = share(roots, names.split(","))
        print(f"{found / total:6.1%}  ({found} of {total} samples) under {names}")
    if args.share:
        return
    inclusive, own = walk(roots)
    packages: Counter[str] = Counter()
    for function, samples in own.items():
        packages[package(Frame(function, 0, 0, 0).file or function)] += samples
    print(f"{total} samples")
    print("\nself, by package:")
    for name, samples in packages.most_common(args.top):
        print(f"  {samples / total:6.1%}  {name}")
    print("\ninclusive:")
    for name, samples in inclusive.most_common(args.top):
        print(f"  {samples / total:6.1%}  {name}")
    print("\nself:")
    for name, samples in own.most_common(args.top):
        print(f"  {samples / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
