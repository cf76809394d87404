"""`make bench`: turnstore against a plain-asyncpg baseline and three peers, one PostgreSQL."""
