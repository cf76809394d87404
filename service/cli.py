"""The `turnstore` command: serve, and Alembic migrations for operators."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from service import migrate
from service.logs import configure as configure_logging
from service.settings import Settings

CURL_EXAMPLE = """\
turnstore is serving on http://{host}:{port} (provider: {provider}). Try:
  curl -s http://{host}:{port}/api/v1/chat -H 'Content-Type: application/json' \\
       -d '{{"message": "ping"}}'
  curl -N http://{host}:{port}/api/v1/chat/stream -H 'Content-Type: application/json' \\
       -d '{{"message": "ping"}}'
OpenAPI: http://{host}:{port}/schema   Stop: Ctrl-C
"""


@contextmanager
def _database(settings: Settings, *, migrate_embedded: bool) -> Iterator[str]:
    """DATABASE_URL, or the embedded server under the data dir (stopped on exit if we started
    it). Only the embedded database is migrated automatically."""
    if settings.database_url:
        yield settings.database_url
        return
    from service.embedded import ensure_embedded_postgres

    server = ensure_embedded_postgres(settings.data_dir)
    try:
        if migrate_embedded:
            migrate.upgrade(server.url)
        yield server.url
    finally:
        server.stop()


def _serve(args: argparse.Namespace, settings: Settings) -> None:
    import uvicorn

    with _database(settings, migrate_embedded=True) as url:
        os.environ["DATABASE_URL"] = url  # workers (other processes) share this server
        sys.stderr.write(
            CURL_EXAMPLE.format(host=args.host, port=args.port, provider=settings.llm_provider)
        )
        # uvicorn re-raises SIGTERM after its graceful shutdown; turn it into SystemExit so the
        # embedded database started above is stopped too instead of being orphaned.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        uvicorn.run(
            "service.app:app",
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_config=configure_logging(os.environ.get("LOG_FORMAT", "json")),
            timeout_graceful_shutdown=30,
        )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _db(action: Callable[[str], object]) -> Callable[[argparse.Namespace, Settings], None]:
    def run(args: argparse.Namespace, settings: Settings) -> None:
        with _database(settings, migrate_embedded=False) as url:
            result = action(url)
            if isinstance(result, str):
                print(result)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnstore", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1)
    serve.set_defaults(run=_serve)

    db = commands.add_parser("db", help="database migrations (Alembic)")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    db_commands.add_parser("upgrade", help="migrate to the newest schema").set_defaults(
        run=_db(migrate.upgrade)
    )
    down = db_commands.add_parser("downgrade", help="migrate back to REV (e.g. base)")
    down.add_argument("revision")
    down.set_defaults(run=lambda a, s: _db(lambda url: migrate.downgrade(url, a.revision))(a, s))
    db_commands.add_parser("current", help="print the schema's revision").set_defaults(
        run=_db(migrate.current)
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    configure_logging(os.environ.get("LOG_FORMAT", "json"))
    args = build_parser().parse_args(argv)
    args.run(args, Settings.from_env())


if __name__ == "__main__":
    main()
