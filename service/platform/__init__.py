"""What every layer above may use, and nothing of theirs: the process's settings, its database,
its keys and what it reports.

- settings.py: every environment variable, declared once (its default, range and the README's
  sentence; the README's table is generated from it).
- providers_file.py: PROVIDERS_FILE, several named providers and the models each serves.
- db.py: connecting: the engine and its pool, the URL as asyncpg takes it, the arguments of a
  connection outside the pool.
- startup.py: which database a process starts on (DATABASE_URL, or the embedded server, which
  is started and migrated there) and what stops it at shutdown.
- migrate.py: Alembic driven from code (`turnstore db ...`, the embedded default, the tests):
  the data's chain and the keyring's (migrations/).
- embedded.py: the embedded PostgreSQL of development and tests (never in production).
- crypto.py: encryption at rest: master keys, owners' data keys, sealed values.
- metrics.py, tracing.py, logs.py: Prometheus metrics, OpenTelemetry traces, JSON log lines.
- shutdown.py: the flag open streams watch once the process is told to stop.
- heap.py: the served process's heap, frozen out of the collector's scans once started.
"""
