"""turnstore: a persistent, multi-replica conversation backend for LLM chat."""
