from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from service.platform.embedded import EmbeddedPostgres, ensure_embedded_postgres


@pytest.fixture
def root() -> Iterator[Path]:
    # Not tmp_path: /tmp/pytest-of-root may be mode 700, which the PostgreSQL user can't traverse.
    base = Path(tempfile.mkdtemp(prefix="turnstore-embedded-")).resolve()
    base.chmod(0o755)
    root = base / ".turnstore"
    try:
        yield root
    finally:
        # Whatever happened in the test, stop any server still running on this data dir.
        if (root / "pgdata" / "postmaster.pid").exists():
            EmbeddedPostgres(url="", data_dir=root / "pgdata", started_here=True).stop()
        shutil.rmtree(base)


async def _connect(pg: EmbeddedPostgres) -> asyncpg.Connection:
    port = urlsplit(pg.url).port
    return await asyncpg.connect(host="127.0.0.1", port=port, user="postgres", database="postgres")


async def _fetchval(pg: EmbeddedPostgres, query: str) -> object:
    conn = await _connect(pg)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def test_start_reuse_restart(root: Path) -> None:
    first = ensure_embedded_postgres(root)
    assert first.started_here
    assert first.data_dir == root / "pgdata"
    assert first.url.startswith("postgresql+asyncpg://postgres@127.0.0.1:")
    assert first.url_for("other") == first.url.removesuffix("/postgres") + "/other"
    assert await _fetchval(first, "select 1") == 1
    assert await _fetchval(first, "show server_encoding") == "UTF8"
    conn = await _connect(first)
    try:
        await conn.execute("create table survivor (id int); insert into survivor values (42)")
    finally:
        await conn.close()

    second = ensure_embedded_postgres(root)
    assert second.url == first.url
    assert not second.started_here
    second.stop()  # not ours to stop: a no-op
    assert await _fetchval(first, "select 1") == 1

    first.stop()
    first.stop()  # idempotent
    with pytest.raises(OSError):
        await _fetchval(first, "select 1")

    third = ensure_embedded_postgres(root)
    assert third.started_here
    assert await _fetchval(third, "select id from survivor") == 42
    third.stop()
