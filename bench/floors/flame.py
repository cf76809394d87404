"""Read a py-spy flame graph (SVG, recorded with ``--function``) back into numbers: each
function's share of the samples, inclusive (it or anything it called was running) and self
(it was), and self time by package. The samples are of busy threads only (py-spy leaves idle
ones out), so a share is a share of the process's CPU.

    python -m bench.floors.flame bench/flame-plain.svg [--top 40] [--under FUNCTION]

Only the event loop's thread counts (``--threads`` counts the others too): py-spy's default
(blocking) sampling counts a waiting thread-pool thread as busy. Litestar starts such a pool
for its Server-Sent Events (each stream hands its first step to a thread) and the threads wait
there ever after, seen as busy by py-spy."""

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


def read(path: Path) -> tuple[list[Frame], int]:
    """The root frames and the number of samples."""
    text = path.read_text()
    frames = []
    for m in _FRAME.finditer(text):
        name = re.sub(r" \([\d,]+ samples?, [\d.]+%\)$", "", html.unescape(m["title"]))
        frames.append(Frame(name, int(m["x"]), int(m["w"]), int(float(m["y"]))))
    total = int(_TOTAL.search(text).group(1))  # type: ignore[union-attr]
    depths = sorted({f.depth for f in frames})
    level = {d: i for i, d in enumerate(depths)}  # py-spy draws it upside down (icicles)
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
    roots = [f for f in frames if f.depth == 0]
    return roots, total


def loop_thread(roots: list[Frame]) -> tuple[list[Frame], int]:
    """The samples of the event loop's thread: without other threads' stacks (they start in
    Thread._bootstrap)."""
    kept = []
    for root in roots:  # py-spy's one root, "all"
        others = [f for f in root.children if f.function.startswith("Thread._bootstrap")]
        root.children = [f for f in root.children if f not in others]
        root.w -= sum(f.w for f in others)
        kept.append(root)
    return kept, sum(f.w for f in kept)


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


def find(frames: list[Frame], function: str) -> list[Frame]:
    """The outermost frames whose function's name starts with ``function``."""
    found = []
    for f in frames:
        if f.function.startswith(function):
            found.append(f)
        else:
            found.extend(find(f.children, function))
    return found


def share(frames: list[Frame], names: list[str]) -> int:
    """Samples under any function whose name starts with one of ``names`` (each once)."""
    total = 0
    for f in frames:
        if any(f.function.startswith(name) for name in names):
            total += f.w
        else:
            total += share(f.children, names)
    return total


def package(file: str) -> str:
    parts = file.split("/")
    if parts[0] == "service" and len(parts) > 1:
        return "/".join(parts[:2]).removesuffix(".py")
    return parts[0].removesuffix(".py")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floors.flame")
    parser.add_argument("svg", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--under", help="only the samples under this function (name prefix)")
    parser.add_argument("--threads", action="store_true", help="count every thread's samples")
    parser.add_argument(
        "--share", action="append", default=[], metavar="F1,F2,...",
        help="the samples under any of these functions (name prefixes), each sample once",
    )  # fmt: skip
    args = parser.parse_args()
    roots, total = read(args.svg)
    if not args.threads:
        roots, total = loop_thread(roots)
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
