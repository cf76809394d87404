"""Configuration from environment variables (see the README's configuration table)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name, "").strip()
    return Path(raw) if raw else None


@dataclass(frozen=True)
class Settings:
    database_url: str | None = None
    llm_provider: str = "fake"
    openai_base_url: str = "https://api.openai.com/v1"
    openai_api_key: str | None = field(default=None, repr=False)
    openai_model: str | None = None
    azure_endpoint: str | None = None
    azure_api_key: str | None = field(default=None, repr=False)
    azure_deployment: str | None = None
    upstream_connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float = 90.0
    upstream_max_body_bytes: int = 262_144
    max_body_bytes: int = 1_048_576
    max_message_chars: int = 100_000
    system_prompt_file: Path | None = None
    context_max_turns: int | None = None
    tools: str | None = None
    retention_days: float | None = None
    idempotency_ttl_s: float = 86_400.0
    tool_max_rounds: int = 4
    tool_timeout_s: float = 5.0
    tool_workers: int = 1
    tool_call_budget: int = 8
    context_max_request_bytes: int = 1_048_576
    data_dir: Path = Path(".turnstore")
    db_pool_size: int = 10
    db_statement_cache_size: int = 100
    sse_keepalive_s: float = 15.0
    shutdown_grace_s: float = 30.0  # SIGTERM: how long open requests may still run
    history_cache_bytes: int = 64 * 1024 * 1024  # per process; 0 switches the cache off
    # Authentication (service/auth.py). Secrets stay out of repr, so out of any log line.
    auth_mode: str = "none"
    jwt_secret: str | None = field(default=None, repr=False)
    jwt_secret_file: Path | None = None
    jwt_public_key_file: Path | None = None
    jwt_issuer: str | None = None
    jwt_audience: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        provider = env.get("LLM_PROVIDER", "fake").strip().lower() or "fake"
        if provider not in {"fake", "openai", "azure"}:
            raise ValueError(f"LLM_PROVIDER must be fake, openai or azure, got {provider!r}")
        prompt = env.get("SYSTEM_PROMPT_FILE", "").strip()
        auth_mode = env.get("AUTH_MODE", "none").strip().lower() or "none"
        if auth_mode not in {"none", "api_key", "jwt"}:
            raise ValueError(f"AUTH_MODE must be none, api_key or jwt, got {auth_mode!r}")
        return cls(
            database_url=env.get("DATABASE_URL") or None,
            llm_provider=provider,
            openai_base_url=env.get("OPENAI_BASE_URL") or cls.openai_base_url,
            openai_api_key=env.get("OPENAI_API_KEY") or None,
            openai_model=env.get("OPENAI_MODEL") or None,
            azure_endpoint=env.get("AZURE_OPENAI_ENDPOINT") or None,
            azure_api_key=env.get("AZURE_OPENAI_API_KEY") or None,
            azure_deployment=env.get("AZURE_OPENAI_DEPLOYMENT") or None,
            upstream_connect_timeout_s=_float(env, "UPSTREAM_CONNECT_TIMEOUT_S", 10.0),
            upstream_read_timeout_s=_float(env, "UPSTREAM_READ_TIMEOUT_S", 90.0),
            upstream_max_body_bytes=_int(env, "UPSTREAM_MAX_BODY_BYTES", 262_144) or 262_144,
            max_body_bytes=_int(env, "MAX_BODY_BYTES", 1_048_576) or 1_048_576,
            max_message_chars=_int(env, "MAX_MESSAGE_CHARS", 100_000) or 100_000,
            system_prompt_file=Path(prompt) if prompt else None,
            context_max_turns=_int(env, "CONTEXT_MAX_TURNS", None),
            tools=env.get("TOOLS") or None,
            retention_days=_float(env, "RETENTION_DAYS", 0.0) or None,
            idempotency_ttl_s=_float(env, "IDEMPOTENCY_TTL_S", 86_400.0),
            tool_max_rounds=_int(env, "TOOL_MAX_ROUNDS", 4) or 4,
            tool_timeout_s=_float(env, "TOOL_TIMEOUT_S", 5.0),
            tool_workers=_int(env, "TOOL_WORKERS", 1) or 1,
            tool_call_budget=_int(env, "TOOL_CALL_BUDGET", 8) or 0,
            context_max_request_bytes=_int(env, "CONTEXT_MAX_REQUEST_BYTES", 1_048_576)
            or 1_048_576,
            data_dir=Path(env.get("TURNSTORE_DATA_DIR") or ".turnstore"),
            db_pool_size=_int(env, "DB_POOL_SIZE", 10) or 10,
            db_statement_cache_size=_int(env, "DB_STATEMENT_CACHE_SIZE", 100) or 0,
            sse_keepalive_s=_float(env, "SSE_KEEPALIVE_S", 15.0),
            shutdown_grace_s=_float(env, "SHUTDOWN_GRACE_S", 30.0),
            history_cache_bytes=_int(env, "HISTORY_CACHE_BYTES", 64 * 1024 * 1024) or 0,
            auth_mode=auth_mode,
            jwt_secret=env.get("JWT_SECRET") or None,
            jwt_secret_file=_path(env, "JWT_SECRET_FILE"),
            jwt_public_key_file=_path(env, "JWT_PUBLIC_KEY_FILE"),
            jwt_issuer=env.get("JWT_ISSUER") or None,
            jwt_audience=env.get("JWT_AUDIENCE") or None,
        )
