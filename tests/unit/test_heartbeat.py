"""The background loop that renews leases, places and run heartbeats and gives back leases
(service/usecases/heartbeat.py) never dies of what it calls raises (issue 28): a lease whose
renewals stopped would expire under its running turn."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import pytest

from service.usecases.heartbeat import Heartbeat
from tests.support.cluster import wait_until


@pytest.mark.parametrize("failing", ["beat", "between"])
async def test_the_loop_goes_on_after_a_call_raises(
    failing: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls = {"beat": 0, "between": 0}

    def counted(name: str) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            calls[name] += 1
            if name == failing and calls[name] <= 2:
                raise RuntimeError("unforeseen")

        return call

    heartbeat = Heartbeat(
        0.01, counted("beat"), lambda: True, between=counted("between"), poll_s=lambda: 0.01
    )
    heartbeat.start()
    try:

        async def going_on() -> bool:
            return min(calls.values()) >= 5

        await wait_until(going_on, "five calls of each", timeout_s=10)
    finally:
        await heartbeat.close()
    logged = [r for r in caplog.records if r.name == "turnstore.heartbeat"]
    assert len(logged) == 2 and all(r.levelno == logging.ERROR and r.exc_info for r in logged)
