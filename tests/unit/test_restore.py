"""Restoring the items a client shows back (service/usecases/restore.py): the turns they name are read in runs."""

from __future__ import annotations

import uuid

from service.usecases.restore import _runs


def test_the_turns_named_are_read_in_runs_of_consecutive_revisions() -> None:
    a, b = uuid.UUID(int=1), uuid.UUID(int=2)
    named = sorted([(a, n) for n in (*range(1, 21), 30)] + [(b, 5)])
    assert _runs(named) == [(a, 1, 16), (a, 17, 20), (a, 30, 30), (b, 5, 5)]
