"""The `turnstore` command: serve, Alembic migrations, API keys and encryption keys for
operators."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NoReturn, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from service.api.auth import check_serving
from service.api.http_server import uvicorn_options
from service.app import check_provider, postgres_store, run_with_api_keys
from service.core.errors import StorageError
from service.core.model import key_id
from service.platform import migrate
from service.platform.crypto import MasterKeys
from service.platform.db import create_engine
from service.platform.logs import configure as configure_logging
from service.platform.settings import Settings, SettingsError
from service.platform.startup import resolve_database
from service.store.postgres import (
    KEY_CACHE_S,
    ApiKeyStore,
    ClearRows,
    Keyring,
    destroy_key,
    live_keys,
    owner_digests,
    placement,
)
from service.store.postgres.placement import DEFAULT_SHARD_COUNT, distribute
from service.store.postgres.tx import FAILURES, sqlstate
from service.usecases.exporting import owner_export

T = TypeVar("T")

SHRED_WRITERS_WAIT_S = 30.0  # how long a shred waits for transactions older than its tombstone
SHRED_PASSES = 3  # deletions of an owner's rows, while a request of theirs leaves some behind
SHRED_PASS_WAIT_S = 1.0

CURL_EXAMPLE = """\
turnstore is serving on http://{host}:{port} (provider: {provider}). Try:
  curl -s http://{host}:{port}/api/v1/chat -H 'Content-Type: application/json' \\
       -d '{{"message": "ping"}}'
  curl -N http://{host}:{port}/api/v1/chat/stream -H 'Content-Type: application/json' \\
       -d '{{"message": "ping"}}'
OpenAPI: http://{host}:{port}/schema (browse: /schema/swagger)   Stop: Ctrl-C
"""


@contextmanager
def _database(settings: Settings, *, migrate_embedded: bool) -> Iterator[str]:
    """The database for a command (see ``resolve_database``), released on exit."""
    url, stop = resolve_database(settings, migrate=migrate_embedded)
    try:
        yield url
    finally:
        stop()


def _serve(args: argparse.Namespace, settings: Settings) -> None:
    import uvicorn

    try:
        explicit = os.environ.get("AUTH_MODE", "").strip().lower() == "none"
        check_serving(settings, args.host, none_is_explicit=explicit)
        check_provider(settings)
    except (ValueError, OSError) as exc:
        sys.exit(f"turnstore serve: {exc}")
    with _database(settings, migrate_embedded=True) as url:
        os.environ["DATABASE_URL"] = url  # workers (other processes) share this server
        sys.stderr.write(
            CURL_EXAMPLE.format(host=args.host, port=args.port, provider=settings.llm_provider)
        )
        # uvicorn re-raises SIGTERM after its graceful shutdown; turn it into SystemExit so the
        # embedded database started above is stopped too instead of being orphaned. A drained
        # shutdown is a clean exit (status 0), as with --workers, whose supervisor handles
        # SIGTERM itself. uvicorn stops accepting and waits up to the grace period for open
        # requests; open streams end at once with an `error` event (service/shutdown.py).
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        uvicorn.run(
            "service.app:app",
            host=args.host,
            port=args.port,
            workers=args.workers,
            **uvicorn_options(settings),
            log_config=configure_logging(settings.log_format, settings.log_level.upper()),
            timeout_graceful_shutdown=max(1, math.ceil(settings.shutdown_grace_s)),
        )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


DbAction = Callable[[str, argparse.Namespace, Settings], object]


def _db(action: DbAction) -> Callable[[argparse.Namespace, Settings], None]:
    """A ``db`` command: ``action`` on the database's URL; a string it returns is printed."""

    def run(args: argparse.Namespace, settings: Settings) -> None:
        with _database(settings, migrate_embedded=False) as url:
            try:
                result = action(url, args, settings)
            except RuntimeError as exc:  # a migration or the placement refuses (it says why)
                _fail("db", str(exc))
            except FAILURES as exc:  # unreachable, refused, restarting: one line, no traceback
                _fail("db", f"the database failed: {_cause(exc)}; run it again once it answers")
            if isinstance(result, str):
                print(result)

    return run


def _upgrade(url: str, args: argparse.Namespace, settings: Settings) -> None:
    group = asyncio.run(placement.worker_group(url))
    if group is not None:  # its migrations fail on the first table Citus owns
        raise migrate.Refused(
            f"this is a Citus worker (group {group}), not the coordinator: run `turnstore db"
            " upgrade` with DATABASE_URL naming the coordinator"
        )
    migrate.upgrade(
        url,
        keyring_url=settings.keyring_database_url,
        lock_timeout_s=settings.migration_lock_timeout_s,
    )


def _downgrade(url: str, args: argparse.Namespace, settings: Settings) -> None:
    migrate.downgrade(
        url,
        args.revision,
        allow_data_loss=args.allow_data_loss,
        lock_timeout_s=settings.migration_lock_timeout_s,
    )


def _current(url: str, args: argparse.Namespace, settings: Settings) -> object:
    return migrate.current(url, settings.keyring_database_url)


def _distribute(url: str, args: argparse.Namespace, settings: Settings) -> object:
    return asyncio.run(
        distribute(url, shard_count=args.shard_count, progress=print, owner_rows=args.owner_rows)
    )


def _status(url: str, args: argparse.Namespace, settings: Settings) -> None:
    """The schemas against this release's heads, and the placement on Citus; exit 1 unless
    all is as it should be."""
    schemas = migrate.status(url, settings.keyring_database_url)
    citus = asyncio.run(placement.status(url))
    ok = citus.ok and all(each.ok for each in schemas.values())
    if args.json:
        print(json.dumps(_status_json(schemas, citus, ok), indent=2))
    else:
        for name, each in schemas.items():
            print(f"{name}: {each.words}")
        print(_citus_line(citus))
        for what, should in (citus.misplaced or {}).items():
            print(f"  {what}: not placed as it should be ({should})")
        for what, when in (citus.pending or {}).items():
            print(f"  {what}: placed as the release before placed it ({when})")
        print("all is as it should be" if ok else "NOT as it should be: see above")
    if not ok:
        sys.exit(1)


def _citus_line(citus: placement.CitusStatus) -> str:
    if citus.version is None:
        return "citus: not installed (plain PostgreSQL: nothing to place)"
    if not citus.coordinator:
        return f"citus {citus.version}: NOT a coordinator (no worker added, or a worker itself)"
    where = f"citus {citus.version}: coordinator with {citus.workers} active workers"
    if citus.misplaced:
        return f"{where}; {len(citus.misplaced)} not placed: run `turnstore db distribute`"
    return f"{where}; every table and function placed"


def _status_json(schemas: dict[str, Any], citus: placement.CitusStatus, ok: bool) -> dict[str, Any]:
    return {
        "ok": ok,
        **{
            name.replace(" ", "_"): {"at": each.at, "head": each.head, "ok": each.ok}
            for name, each in schemas.items()
        },
        "citus": None
        if citus.version is None
        else {
            "version": citus.version,
            "coordinator": citus.coordinator,
            "workers": citus.workers,
            "misplaced": citus.misplaced or {},
            "pending": citus.pending or {},
            "ok": citus.ok,
        },
    }


def _purge(args: argparse.Namespace, settings: Settings) -> None:
    """Delete what has expired: Idempotency-Key records past their TTL, and conversations
    idle past RETENTION_DAYS in small batches (safe from cron on any replica, concurrently
    too)."""

    async def purge(url: str) -> int:
        engine = create_engine(
            url, pool_size=1, statement_cache_size=settings.db_statement_cache_size
        )
        try:
            return await postgres_store(engine, settings).ops.purge(args.batch)
        finally:
            await engine.dispose()

    with _database(settings, migrate_embedded=False) as url:
        purged = asyncio.run(purge(url))
    kept = "" if settings.retention_days else " (RETENTION_DAYS is not set: none expire)"
    print(f"purged {purged} conversations{kept} and the expired Idempotency-Key records")


@asynccontextmanager
async def _engines(settings: Settings, url: str) -> AsyncIterator[tuple[AsyncEngine, AsyncEngine]]:
    """Small pools on the data's database and on the keyring's (the same one by default)."""
    engine = create_engine(url, pool_size=2)
    keyring = settings.keyring_database_url
    keyring_engine = create_engine(keyring, pool_size=2) if keyring else engine
    try:
        yield engine, keyring_engine
    finally:
        for each in {engine, keyring_engine}:
            await each.dispose()


def _master_keys(settings: Settings, command: str) -> MasterKeys:
    masters = settings.master_keys()
    if masters is None:
        sys.stderr.write(f"turnstore {command}: ENCRYPTION_KEYS_FILE is not set\n")
        sys.exit(2)
    return masters


def _owners_shred(args: argparse.Namespace, settings: Settings) -> None:
    """Stop the owner first: their tombstone (named by a keyed digest, never their name) makes
    every write of theirs fail inside its own statement, on every replica; their API keys are
    revoked, and their data key is replaced by the keyring's tombstone, so no replica makes
    them a new one (with encryption at rest, their rows here and in every backup taken before
    cannot be decrypted). Then, once no replica can still hold the old key in memory and every
    write of theirs that began before the tombstone has ended, their rows; and a check that
    nothing of theirs is left (a straggler's row is deleted again, a few times at most)."""

    async def shred(url: str) -> tuple[bool, int, int]:
        async with _engines(settings, url) as (engine, keyring_engine):
            owners = postgres_store(engine, settings).owners
            sealed = await owners.owner_has_sealed_rows(args.owner)
            made = await owners.tombstone(args.owner)
            await ApiKeyStore(engine).revoke(owner=args.owner)
            digest = await owner_digests(engine)(args.owner)
            had_key = await destroy_key(keyring_engine, args.owner, digest)
            if sealed and not had_key:
                _fail(
                    "owners shred",
                    f"{args.owner!r} has encrypted rows but no data key in this keyring: is "
                    "KEYRING_DATABASE_URL the service's? They can write nothing more; nothing "
                    "was deleted.",
                )
            if args.wait_s > 0:
                sys.stderr.write(
                    f"Stopped {args.owner!r} (they can commit nothing more), revoked their API "
                    f"keys and destroyed their data key; deleting their data in {args.wait_s:g}"
                    " s, once no replica holds the key.\n"
                )
                await asyncio.sleep(args.wait_s)
            if writing := await owners.writers_before(made, SHRED_WRITERS_WAIT_S):
                _fail(
                    "owners shred",
                    f"{args.owner!r} can commit nothing more, but {writing} transactions that "
                    "began before the shred are still open: run it again.",
                )
            deleted, left = 0, 1
            for attempt in range(SHRED_PASSES):
                if attempt:
                    await asyncio.sleep(SHRED_PASS_WAIT_S)  # a request of theirs still ending
                deleted += await owners.delete_owner(args.owner)
                left = await owners.owner_rows(args.owner)
                left += await live_keys(keyring_engine, args.owner)
                if not left:
                    break
            return had_key, deleted, left

    with _database(settings, migrate_embedded=True) as url:
        had_key, deleted, left = _storage(lambda: asyncio.run(shred(url)), "owners shred")
    key = "destroyed the data key" if had_key else "found no data key"
    if left:
        _fail(
            "owners shred",
            f"{args.owner!r}: {key} and deleted {deleted} conversations, but {left} of their "
            "rows or keys are still there: run it again.",
        )
    print(
        f"{args.owner!r}: stopped (nothing of theirs can commit), revoked their API keys, {key}"
        f" and deleted {deleted} conversations"
    )


def _owners_export(args: argparse.Namespace, settings: Settings) -> None:
    """Every conversation of the owner as ndjson on standard output (service/core/export_lines.py),
    one after another: an owner's right of access. With encryption at rest, opened with
    their data key."""

    async def export(url: str) -> int:
        async with _engines(settings, url) as (engine, keyring_engine):
            masters = settings.master_keys()
            keyring = Keyring(keyring_engine, masters) if masters is not None else None
            reads, count = postgres_store(engine, settings, keyring).reads, 0
            async for line in owner_export(reads, args.owner):
                sys.stdout.buffer.write(line)
                count += line.startswith(b'{"id":')
            sys.stdout.flush()
            return count

    with _database(settings, migrate_embedded=True) as url:
        count = _storage(lambda: asyncio.run(export(url)), "owners export")
    sys.stderr.write(f"{args.owner!r}: exported {count} conversations\n")


def _cause(exc: BaseException) -> str:
    """A database failure in a few words for an operator: the driver's class, SQLSTATE and
    first line (SQLAlchemy's wrapper adds the statement and a link)."""
    driver = getattr(exc, "orig", None) or exc
    driver = driver.__cause__ or driver  # the dialect's PEP 249 error: asyncpg's, under it
    state = sqlstate(exc)
    line = (str(driver).splitlines() or [""])[0]
    return f"{type(driver).__name__}{f' ({state})' if state else ''}: {line}"


def _fail(command: str, message: str) -> NoReturn:
    sys.stderr.write(f"turnstore {command}: {message}\n")
    sys.exit(1)


def _storage(action: Callable[[], T], command: str) -> T:
    """``action``, a database failure (unreachable, a master key missing) as one line."""
    try:
        return action()
    except StorageError as exc:
        cause = f" ({type(exc.__cause__).__name__})" if exc.__cause__ is not None else ""
        _fail(command, exc.message + cause)


def _encrypt_existing(args: argparse.Namespace, settings: Settings) -> None:
    """Rewrite rows written in clear (before ENCRYPTION_KEYS_FILE was set), while serving."""
    masters = _master_keys(settings, "encrypt-existing")
    terminal = sys.stderr.isatty()

    async def encrypt(url: str) -> tuple[int, int]:
        async with _engines(settings, url) as (engine, keyring_engine):
            rows = ClearRows(engine, Keyring(keyring_engine, masters))
            total, done = await rows.count(), 0
            while sealed := await rows.encrypt_batch(args.batch):
                done += sealed
                if terminal:
                    sys.stderr.write(f"\rencrypted {done} of {max(total, done)} rows")
                    sys.stderr.flush()
            if terminal:
                sys.stderr.write("\n")
            return done, await rows.count()

    with _database(settings, migrate_embedded=True) as url:
        done, left = _storage(lambda: asyncio.run(encrypt(url)), "encrypt-existing")
    print(f"encrypted {done} rows written in clear; {left} left in clear")
    if left:  # written meanwhile by a replica without ENCRYPTION_KEYS_FILE
        _fail("encrypt-existing", f"{left} rows are in clear: does every replica have the keys?")


def _rewrap_keys(args: argparse.Namespace, settings: Settings) -> None:
    """Wrap every owner's data key with the first master key, so older ones can be removed."""
    masters = _master_keys(settings, "rewrap-keys")

    async def rewrap(url: str) -> tuple[int, int]:
        async with _engines(settings, url) as (_, keyring_engine):
            keyring, done = Keyring(keyring_engine, masters), 0
            while rewrapped := await keyring.rewrap(args.batch):
                done += rewrapped
            return done, await keyring.stale()

    with _database(settings, migrate_embedded=True) as url:
        done, left = _storage(lambda: asyncio.run(rewrap(url)), "rewrap-keys")
    print(f"rewrapped {done} data keys with master key {masters.current!r}; {left} left")
    if left:
        _fail("rewrap-keys", f"{left} data keys are still wrapped by an older master key")


def _keys_create(args: argparse.Namespace, settings: Settings) -> None:
    with _database(settings, migrate_embedded=True) as url:
        try:
            key = run_with_api_keys(url, lambda keys: keys.create(args.owner))
        except ValueError as exc:
            sys.exit(f"turnstore keys create: {exc}")
    sys.stderr.write(
        f"New API key of {args.owner!r} (id {key_id(key)}), shown only now (only its hash is "
        "kept):\n"
    )
    print(key)  # alone on the last line of stdout, for scripts


def _keys_revoke(args: argparse.Namespace, settings: Settings) -> None:
    """By id, by owner, or the key itself from standard input ("-"): a key on the command line
    lands in shell histories and process listings, so that form is only kept for scripts."""
    key = sys.stdin.readline().strip() if args.key == "-" else args.key
    which = {"key": key, "key_id": args.id, "owner": args.owner}
    if sum(value is not None for value in which.values()) != 1:
        sys.exit("turnstore keys revoke: name exactly one of KEY (or - for stdin), --id, --owner")
    with _database(settings, migrate_embedded=True) as url:
        revoked = run_with_api_keys(url, lambda keys: keys.revoke(**which))
    if not revoked:
        sys.exit("turnstore keys revoke: no such key")
    sys.stderr.write(
        f"Revoked {', '.join(revoked)}: every replica refuses them from its next request on.\n"
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnstore", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1)
    serve.set_defaults(run=_serve)
    _db_commands(commands.add_parser("db", help="database migrations (Alembic)"))
    _data_commands(commands)
    _key_commands(commands.add_parser("keys", help="API keys for AUTH_MODE=api_key"))
    return parser


def _db_commands(db: argparse.ArgumentParser) -> None:
    commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = commands.add_parser(
        "upgrade", help="migrate to the newest schema (and the keyring's)"
    )
    upgrade.set_defaults(run=_db(_upgrade))
    down = commands.add_parser(
        "downgrade",
        help="migrate back to REV (e.g. base); prints what that deletes first, and refuses to "
        "delete anything without --allow-data-loss",
    )
    down.add_argument("revision")
    down.add_argument("--allow-data-loss", action="store_true", help="delete what it lists")
    down.set_defaults(run=_db(_downgrade))
    current = commands.add_parser(
        "current", help="print the data schema's revision and the keyring's"
    )
    current.set_defaults(run=_db(_current))
    place = commands.add_parser(
        "distribute", help="place the tables on a Citus coordinator (after upgrade; rerunnable)"
    )
    place.add_argument(
        "--shard-count",
        type=_positive,
        default=DEFAULT_SHARD_COUNT,
        help="shards of a new co-location group",
    )
    place.add_argument(
        "--owner-rows",
        action="store_true",
        help="make each owner's rows placed by a release before the coordinator's (once every"
        " replica runs this release: deploy/CITUS-RUNBOOK.md)",
    )
    place.set_defaults(run=_db(_distribute))
    status = commands.add_parser(
        "status",
        help="the schemas against this release's heads and the placement on Citus (exit 1"
        " unless all is as it should be)",
    )
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(run=_db(_status))


def _data_commands(commands: Any) -> None:
    """What removes or rewrites stored data: purge, shred, encrypt, rewrap."""
    purge = commands.add_parser("purge", help="delete conversations past RETENTION_DAYS")
    purge.add_argument("--batch", type=int, default=500, help="rows per short transaction")
    purge.set_defaults(run=_purge)
    owners = commands.add_parser("owners", help="what belongs to an owner")
    owned = owners.add_subparsers(dest="owners_command", required=True)
    shred = owned.add_parser(
        "shred", help="destroy the owner's data key and delete their conversations"
    )
    shred.add_argument("owner", metavar="NAME")
    shred.add_argument(
        "--wait-s",
        type=float,
        default=KEY_CACHE_S + 5,
        help="how long replicas may still hold the key in memory (their cache time, and then "
        "some); the rows are deleted after it",
    )
    shred.set_defaults(run=_owners_shred)
    export = owned.add_parser(
        "export", help="write every conversation of the owner as ndjson to standard output"
    )
    export.add_argument("owner", metavar="NAME")
    export.set_defaults(run=_owners_export)
    existing = commands.add_parser(
        "encrypt-existing", help="encrypt rows written in clear (safe while serving)"
    )
    existing.add_argument("--batch", type=_positive, default=100, help="rows per short transaction")
    existing.set_defaults(run=_encrypt_existing)
    rewrap = commands.add_parser(
        "rewrap-keys", help="wrap every data key with the first master key (key rotation)"
    )
    rewrap.add_argument("--batch", type=_positive, default=100, help="keys per batch")
    rewrap.set_defaults(run=_rewrap_keys)


def _key_commands(keys: argparse.ArgumentParser) -> None:
    commands = keys.add_subparsers(dest="keys_command", required=True)
    create = commands.add_parser("create", help="print a new key (only its hash is kept)")
    create.add_argument("--owner", required=True, help="whose conversations the key reaches")
    create.set_defaults(run=_keys_create)
    revoke = commands.add_parser(
        "revoke", help="refuse a key (or all of an owner's) from now on, on every replica"
    )
    revoke.add_argument("key", metavar="KEY", nargs="?", help="the key, or - to read it from stdin")
    revoke.add_argument("--id", help="the key's id (printed by keys create)")
    revoke.add_argument("--owner", help="revoke every key of this owner")
    revoke.set_defaults(run=_keys_revoke)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        sys.stderr.write(f"turnstore: {exc}\n")
        sys.exit(2)
    configure_logging(settings.log_format, settings.log_level.upper())
    args.run(args, settings)


if __name__ == "__main__":
    main()
