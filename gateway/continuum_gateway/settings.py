"""Gateway settings, read once at start from `GATEWAY_*` environment variables and passed in."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from continuum_runtime.auth import USER_ID_PATTERN

# The user the optional development token stands for.
DEV_USER = "dev"


class GatewaySettings(BaseSettings):
    """Everything the gateway process needs. Secrets are `SecretStr` so they never reach a log or repr.

    Not derived from `continuum_runtime.settings.ServiceSettings`: that describes a gRPC service with
    a database, which the gateway is not.
    """

    # hide_input_in_errors: a validation error would otherwise quote the raw input, tokens included.
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", frozen=True, extra="ignore", hide_input_in_errors=True)

    host: str = "127.0.0.1"
    # 0 binds a free port; the bound port is written to `<data_dir>/run/gateway.port`.
    port: int = Field(default=8080, ge=0, le=65535)
    # Where the run files (the port file) live.
    data_dir: Path = Path(".continuum")
    # host:port of the transcript gRPC service.
    transcript_address: str = "127.0.0.1:50151"
    # host:port of the compaction gRPC service.
    compaction_address: str = "127.0.0.1:50152"
    # host:port of the merge gRPC service; empty when this deployment runs no merge (merge-v2 is then
    # not advertised).
    merge_address: str = ""
    # The credential the gateway presents to the services.
    service_token: SecretStr = SecretStr("")
    # Browser bearer token -> user id, given as a JSON object. Keys are secrets; the ids are not.
    users: dict[SecretStr, str] = Field(default_factory=dict)
    # A development convenience: when set, this bearer token acts as the user "dev".
    dev_token: SecretStr | None = None
    log_level: str = "INFO"
    # Deadline of every upstream call made for a browser request.
    upstream_timeout_seconds: float = Field(default=30.0, gt=0)
    # /readyz must answer quickly even when an upstream hangs.
    readiness_timeout_seconds: float = Field(default=1.0, gt=0)
    # Largest request body accepted; above transcript's 48 MiB append batch with room for JSON overhead.
    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # How long the gateway waits for the next piece of a request body before answering 408.
    body_timeout_seconds: float = Field(default=30.0, gt=0)
    # Browser origins allowed to call the API from their pages (CORS), e.g.
    # GATEWAY_ALLOWED_ORIGINS=https://console.example.com,http://localhost:5173 (or a JSON list).
    # None by default: only same-origin pages and non-browser clients.
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Largest gRPC message exchanged with a service (a message page can reach about 16 MiB).
    grpc_max_message_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    # How long requests in flight may take to finish after SIGINT or SIGTERM.
    shutdown_grace_seconds: int = Field(default=5, ge=0)

    # WebSocket keepalive: uvicorn pings every follower this often and drops one that does not answer
    # within the timeout, so a vanished browser (and its upstream Follow stream) does not linger.
    ws_ping_interval_seconds: float = Field(default=20.0, gt=0)
    ws_ping_timeout_seconds: float = Field(default=20.0, gt=0)
    # Largest WebSocket message a browser may send (it only ever sends the small hello).
    ws_max_message_bytes: int = Field(default=64 * 1024, ge=1024)
    # Follow: frames, and characters of them, buffered for one browser before it counts as too slow
    # (resync OVERFLOW, close). A single frame larger than the character bound still goes through.
    follow_buffer_frames: int = Field(default=1024, ge=1)
    follow_buffer_chars: int = Field(default=32 * 1024 * 1024, ge=1024)
    # Follow: how long the browser may take to send its hello after the handshake.
    follow_hello_timeout_seconds: float = Field(default=10.0, gt=0)
    # Follow: how long the last frames (an error, a resync) and the close may take to reach a browser
    # that stopped reading before the gateway gives up on it.
    follow_close_timeout_seconds: float = Field(default=5.0, gt=0)
    # Follow: browsers of one user following one session share one upstream Follow stream, and each
    # frame is converted to JSON once for all of them (see `continuum_gateway.follow_hub`). Off: one
    # upstream stream per browser, as resuming browsers always have.
    follow_share_upstreams: bool = True

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [o.strip() for o in text.split(",") if o.strip()]
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _check_origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            # CORS compares origins exactly: a path or trailing slash would never match a browser's.
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"GATEWAY_ALLOWED_ORIGINS: {origin!r} is not an origin such as https://host:port")
        return origins

    @model_validator(mode="after")
    def _check_users(self) -> GatewaySettings:
        if self.dev_token is not None:
            dev = self.dev_token.get_secret_value()
            if not dev:
                raise ValueError("GATEWAY_DEV_TOKEN must not be empty when set")
            if any(token.get_secret_value() == dev and user != DEV_USER for token, user in self.users.items()):
                raise ValueError("GATEWAY_DEV_TOKEN is also the GATEWAY_USERS token of another user")
        for token, user in self.users.items():
            if not token.get_secret_value():
                raise ValueError("GATEWAY_USERS: a bearer token must not be empty")
            # Services accept only acting users of this shape (see `continuum_runtime.auth`): checking it
            # here turns a misconfigured user into a start-up failure instead of a 500 on every call.
            if not USER_ID_PATTERN.match(user):
                raise ValueError(f"GATEWAY_USERS: user id {user!r} must match {USER_ID_PATTERN.pattern}")
        return self

    def user_tokens(self) -> dict[str, str]:
        """Every accepted bearer token (in clear) and the user it stands for, dev token included."""
        tokens = {token.get_secret_value(): user for token, user in self.users.items()}
        if self.dev_token is not None:
            tokens[self.dev_token.get_secret_value()] = DEV_USER
        return tokens
