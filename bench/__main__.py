"""`python -m bench` (or `make bench`): every figure and ratio from one run, one PostgreSQL.

Options: --parts store,e2e,scale,holding,hostile,durable,fork,tracing,migrate,floors,responses,
compaction,citus,running,providers,finding,latency
--subjects ...
--rounds N  --flame, --realtime (floors: flame graphs into bench/flame/; servers under
SCHED_FIFO)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from bench import (
    citus,
    compaction,
    durable,
    e2e,
    finding,
    fork,
    holding,
    hostile,
    latency,
    migrate,
    plots,
    providers,
    report,
    responses,
    running,
    tracing,
)
from bench.database import REPO, fresh_database, server, server_version
from bench.floors import run as floors
from bench.store import StoreConfig, StoreResult, run_subject
from bench.stores import SUBJECTS
from bench.workload import describe


def _say(line: str = "") -> None:
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument(
        "--parts",
        default="store,e2e,scale,holding,hostile,durable,fork,tracing,migrate,floors,responses,"
        "compaction,citus,running,providers,finding,latency",
    )
    parser.add_argument("--subjects", default=",".join(SUBJECTS))
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (best counts)")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument(
        "--flame", action="store_true", help="floors: py-spy flame graphs into bench/flame/"
    )
    parser.add_argument(
        "--realtime", action="store_true", help="floors: measure the servers under SCHED_FIFO"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    # 1,000 client sockets here plus as many in the server (which inherits this limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    logs = Path(tempfile.mkdtemp(prefix="turnstore-bench-"))
    started = time.monotonic()
    with server() as server_url, fresh_database(server_url) as url:
        _say(
            f"turnstore bench: PostgreSQL {asyncio.run(server_version(url))}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, server logs in {logs}"
        )
        _say(f"workload per turn: {describe()}")
        results: dict[str, StoreResult] = {}
        if "store" in parts:
            config = StoreConfig(rounds=args.rounds)
            _say(
                f"\n1. Store: {config.conversations} conversations x {config.turns} turns at "
                f"concurrency {config.concurrency} (best of {config.rounds} rounds); latency: "
                f"{config.ladder_conversations} conversations grown one turn at a time to 205 "
                "turns, median over 5 turns per point; stored bytes from pg_total_relation_size"
            )
            for label in args.subjects.split(","):
                _say(f"   measuring {label} ...")
                results[label] = asyncio.run(run_subject(label, url, config))
            _say()
            for line in report.store_table(list(results.values())):
                _say(line)
            for path in plots.write(list(results.values())):
                _say(f"   plot: {path}")
        e2e_result = None
        if "e2e" in parts or "holding" in parts:
            _say(
                "\n2. End to end: `turnstore serve`, fake provider, 64 x 20 turns at concurrency 32"
            )
            e2e_result = e2e.run(url, logs, args.streams if "holding" in parts else 0)
            for line in report.e2e_lines(e2e_result, results):
                _say(line)
            if "scale" in parts:
                two = e2e.run(url, logs, 0, name="e2e-workers-2", workers=2)
                for line in report.e2e_lines(two, results):
                    _say(line)
                _say("\n   Scale-out, from the figures above")
                for line in report.scale_lines(e2e_result, two, os.cpu_count() or 1):
                    _say("   " + line)
        hold = None
        if "holding" in parts and e2e_result:
            _say(f"\n3. Holding power: {args.streams} concurrent streams, provider takes 2 s")
            hold = holding.run(url, logs, e2e_result.seeded)
            for line in report.holding_lines(hold):
                _say(line)
        refused = None
        if "hostile" in parts:
            _say("\n4. Hostile input: the worst 1 MiB bodies, each sent 20 times")
            refused = hostile.run(url, logs)
            for line in hostile.lines(refused):
                _say(line)
        if "durable" in parts:
            _say(
                f"\n5. Durable turns: background streams on replica A, followed from replica B; "
                f"the provider types {durable.DELTAS} deltas {durable.DRIP_S * 1000:g} ms apart"
            )
            for line in durable.lines(durable.run(url, logs)):
                _say("   " + line)
        if "fork" in parts:
            _say(
                f"\n6. Forks: a conversation forked at its last turn, {fork.FORKS} times per length"
            )
            for line in fork.lines(fork.run(url)):
                _say("   " + line)
        if "tracing" in parts:
            _say("\n7. Tracing: part 2 with tracing off, then on (OTLP/HTTP to a local sink)")
            for line in tracing.run(url, logs):
                _say("   " + line)
        if "migrate" in parts:
            _say(
                f"\n8. Migrations: `turnstore db upgrade` from the previous release on "
                f"{migrate.CONVERSATIONS:,} conversations, pg_locks sampled"
            )
            for line in migrate.lines(migrate.run(server_url, logs)):
                _say("   " + line)
        floor = None
        if "floors" in parts:
            _say(
                "\n9. Floors: server CPU per turn, turnstore against a bare ASGI app and a minimal "
                "Litestar app running the same statements (uvicorn, httptools, uvloop, 1 worker)"
            )
            flames = REPO / "bench" / "flame" if args.flame else None
            floor = floors.run(
                url, logs, args.rounds, realtime_servers=args.realtime, flames=flames
            )
            for line in floors.lines(floor):
                _say("   " + line)
        if "responses" in parts:
            _say(
                "\n10. /v1 responses: what storing one costs per call, and what a resumed "
                "stream costs the replica that replays it"
            )
            for line in responses.lines(responses.run(url, logs)):
                _say("   " + line)
        if "compaction" in parts:
            _say(
                f"\n11. Compaction: {compaction.CONVERSATIONS} conversations grown to "
                f"{compaction.TURNS} turns with each CONTEXT_STRATEGY (compact at "
                f"{compaction.THRESHOLD_TOKENS:,} tokens), fake provider"
            )
            for line in compaction.lines(compaction.run(url, logs)):
                _say("   " + line)
        if "citus" in parts:
            config = citus.CitusConfig(rounds=args.rounds)
            _say(
                f"\n12. Citus: the store's plain turns (lease + commit), {config.conversations}"
                f" conversations x {config.turns} turns at concurrency {config.concurrency}, on"
                " a coordinator with two workers (this machine) and on one plain server; best"
                f" of {config.rounds} rounds"
            )
            for line in citus.lines(citus.run(url, config)):
                _say(line)
        if "running" in parts:
            _say(
                "\n13. Running turns: what counting an owner's running turns fleet-wide"
                " (OWNER_MAX_RUNNING_TURNS) costs part 2's load, with the count and without"
            )
            for line in running.lines(running.run(url, logs)):
                _say("   " + line)
        if "providers" in parts:
            _say(
                f"\n14. Providers: a {providers.TURNS}-turn Claude conversation with thinking "
                "(the strict fake Anthropic API, over HTTP), its prompt cache, and a Claude turn's "
                "server CPU next to a fake-model turn's; a Gemini 3 conversation's implicit cache "
                "and an OpenAI Responses one's; what each cache saves at list prices"
            )
            for line in providers.lines(providers.run(url, logs)):
                _say("   " + line)
        if "finding" in parts:
            _say(
                f"\n15. Finding: a page of the listing with each filter, an owner of "
                f"{finding.SMALL} conversations and one of {finding.BIG:,}; an export's memory"
            )
            for line in finding.lines(finding.run(server_url, logs)):
                _say(line)
        if "latency" in parts:
            _say(
                f"\n16. Latency added: what turnstore adds before the provider's request starts "
                f"and to each streamed delta ({latency.SAMPLES} turns each, the fake Responses API "
                f"over HTTP streaming {latency.DELTAS} deltas {latency.DRIP_S * 1000:.0f} ms apart)"
            )
            for line in latency.lines(latency.run(url, logs)):
                _say("   " + line)
        _say("\nTargets (ratios from this run)")
        if floor is not None:
            for line in report.floor_targets(floors.ratios(floor)):
                _say(line)
        for line in report.targets(results, e2e_result, hold, refused):
            _say(line)
    _say(f"\nbench finished in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
