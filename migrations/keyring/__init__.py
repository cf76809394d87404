"""The keyring's own migrations (version table keyring_version), beside the data's: a chain
of its own so that the keyring can live in a database of its own (KEYRING_DATABASE_URL).

- 2026_11_30_k001_owner_keys.py: owner_keys: each owner's data key, wrapped by a master key
"""
