"""Fixtures of the system layer: separate processes (replicas, nginx, PgBouncer, PostgreSQL
servers of the tests' own), browsers, the real SDKs under Node, Citus, the previous release."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.support.replication import ReplicatedPostgres, pg_bin_dir, replicated_postgres


@pytest.fixture(autouse=True)
def _print_report(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> Iterator[None]:
    """What a module appends to its ``REPORT`` list during a test is printed after it, past
    pytest's capture (the load tests' figures)."""
    report: list[str] | None = getattr(request.module, "REPORT", None)
    if report is None:
        yield
        return
    report.clear()
    yield
    with capsys.disabled():
        for line in report:
            print(f"\n{line}")


@pytest.fixture
def pair() -> Iterator[ReplicatedPostgres]:
    """A primary and a synchronous standby of the tests' own (tests/support/replication.py);
    skipped where PostgreSQL's server programs are missing, except in CI."""
    try:
        pg_bin_dir()
    except RuntimeError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
    started = time.monotonic()
    with replicated_postgres() as pair:
        print(f"pair set up in {time.monotonic() - started:.2f} s")
        yield pair
