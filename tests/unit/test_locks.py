from __future__ import annotations

import asyncio

from service.usecases.locks import KeyedLocks


async def test_holders_of_one_key_are_serialised_and_the_registry_empties() -> None:
    locks = KeyedLocks()
    inside: list[str] = []
    order: list[str] = []
    release = asyncio.Event()

    async def hold(key: str, name: str) -> None:
        async with locks.hold(key):
            inside.append(name)
            assert inside.count(name) == 1 and len([n for n in inside if n[0] == key]) == 1
            order.append(name)
            if name == "a1":
                await release.wait()
            inside.remove(name)

    first = asyncio.create_task(hold("a", "a1"))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(hold("a", f"a{n}")) for n in (2, 3)]
    other = asyncio.create_task(hold("b", "b1"))
    await other  # a different key never waits for "a"
    assert order == ["a1", "b1"]
    assert len(locks) == 1  # "a" is held and waited for; "b" is already gone
    release.set()
    await asyncio.gather(first, *waiters)
    assert order == ["a1", "b1", "a2", "a3"]
    assert len(locks) == 0


async def test_a_cancelled_waiter_does_not_leak_its_entry() -> None:
    locks = KeyedLocks()
    release = asyncio.Event()

    async def holder() -> None:
        async with locks.hold("k"):
            await release.wait()

    task = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiter.cancel()
    release.set()
    await task
    await asyncio.gather(waiter, return_exceptions=True)
    assert len(locks) == 0
