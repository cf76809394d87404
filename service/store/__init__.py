"""The conversation store: the port (``base``) and its PostgreSQL adapter (``postgres``)."""
