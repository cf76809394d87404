"""Alembic migrations, shipped inside the package so `turnstore db` finds them anywhere
(service/platform/migrate.py drives them).

- env.py: Alembic's environment: connects, takes the runners' advisory lock, refuses a
  revision this release does not know, runs each migration in its own transaction.
- runner.py: how migrations run on a live database: bounded lock waits, retries with
  backoff, the advisory lock (``LOCK_ID``, which `turnstore db distribute` takes too).
- live.py: the helpers a migration calls to change a database while replicas serve
  (indexes built concurrently, constraints validated later, batched backfills, ``count``).
- revisions.py: what the schemas are at (`turnstore db current`) and what a downgrade would
  delete (each migration's ``losses``), refused unless allowed.
- commit_function.py: the schema's commit functions as the code calls them (their names and
  arguments, the shred's test, their SQLSTATEs): for store/postgres, never for a migration.
- versions/: the data's migrations (version table ``alembic_version``); keyring/: the
  keyring's (``keyring_version``); script.py.mako: the template of a new one.

A migration is frozen once written: it carries the SQL it runs as text of its own, and imports
nothing of this package but live.py (helpers that take everything they write as arguments).
So an edit of a module here never changes what an old migration does to a database, and the
database a fresh install migrates is the one an upgraded fleet has. A function's next version
is a new migration that copies the previous text and changes it; the code then reads its
name and arguments from commit_function.py (tests/unit/test_architecture.py holds migrations to
the imports, tests/system/test_placement.py the code to the functions the migrations made).
"""
