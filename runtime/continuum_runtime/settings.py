"""Base settings every service reads once at start from its own prefixed environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    """Common settings of a gRPC service. Subclasses set `env_prefix` (e.g. ``TRANSCRIPT_``)."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", hide_input_in_errors=True)

    # Where the embedded default keeps its SQLite files, attachments and run files.
    data_dir: Path = Path(".continuum")
    # Empty: the embedded SQLite file `<data_dir>/<service>.db`.
    database_url: str = ""
    host: str = "127.0.0.1"
    # 0 binds a free port; the bound port is written to `<data_dir>/run/<service>.port`.
    port: int = Field(default=0, ge=0, le=65535)
    # Bearer token every caller must present. Empty refuses every call.
    service_token: SecretStr = SecretStr("")
    # Key of the HMAC that authenticates page tokens; shared by every replica of the service. Empty:
    # a random key per process (tokens then do not survive a restart; a warning says so).
    page_token_secret: SecretStr = SecretStr("")
    migrate_on_start: bool = True
    log_level: str = "INFO"
    grpc_max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    shutdown_grace_seconds: float = Field(default=5.0, ge=0)
    db_pool_size: int = Field(default=10, ge=1)
    # Where RPC spans go: "none" makes no spans at all, "console" prints them.
    trace_exporter: Literal["none", "console"] = "none"

    def resolved_database_url(self, service: str) -> str:
        """The configured database URL, or the embedded SQLite file of `service`."""
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / f'{service}.db').resolve()}"
