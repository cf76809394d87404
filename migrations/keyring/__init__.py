"""The keyring's own migrations (version table keyring_version), beside the data's."""
