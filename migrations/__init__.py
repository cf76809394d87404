"""Alembic migrations (shipped inside the package so `turnstore db` finds them anywhere)."""
