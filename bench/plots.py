"""The PNG plots of a bench run (linked from bench/README.md): ms per turn against history
length for every subject, and turns/s beside database CPU per turn."""

from __future__ import annotations

from pathlib import Path

from bench.store import HISTORY_POINTS, StoreResult

PLOTS = Path(__file__).resolve().parent / "plots"


def write(results: list[StoreResult], directory: Path = PLOTS) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    measured = [r for r in results if not r.error]
    if not measured:
        return []
    directory.mkdir(exist_ok=True)
    latency = directory / "latency.png"
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for result in measured:
        values = [result.latency_ms[h] for h in HISTORY_POINTS]
        axis.plot(HISTORY_POINTS, values, marker="o", label=result.name)
    axis.set(xlabel="earlier turns in the conversation", ylabel="ms per turn (median)")
    axis.set_title("Store: latency of a turn against history length")
    axis.set_yscale("log")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(latency, dpi=100)
    plt.close(figure)

    work = directory / "throughput-and-db-cpu.png"
    names = [r.name for r in measured]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    left.barh(names, [r.best_turns_per_s for r in measured], color="tab:blue")
    left.set(xlabel="turns/s (best round, concurrency 32)", title="Store throughput")
    right.barh(names, [min(r.db_cpu_us) for r in measured], color="tab:orange")
    right.set(xlabel="PostgreSQL CPU per turn (us)", title="Database work per turn")
    for axis in (left, right):
        axis.grid(True, axis="x", alpha=0.3)
    left.invert_yaxis()
    figure.tight_layout()
    figure.savefig(work, dpi=100)
    plt.close(figure)
    return [latency, work]
