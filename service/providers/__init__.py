"""LLM providers: the port (``base``), the Responses API adapter and the offline fake."""
