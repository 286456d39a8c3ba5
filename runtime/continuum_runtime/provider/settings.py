"""Which model provider a service talks to, and how patiently. Services nest this in their own settings."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["ProviderSettings"]


class ProviderSettings(BaseModel):
    """Settings of one model provider. The default, ``offline``, needs no key and no network.

    A service nests it as a field, e.g. ``provider: ProviderSettings = ProviderSettings()``; with
    ``env_nested_delimiter="__"`` in the service's settings config it reads
    ``COMPACTION_PROVIDER__KIND``, ``COMPACTION_PROVIDER__BASE_URL`` and so on.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", hide_input_in_errors=True)

    # "openai": any server that speaks the OpenAI chat-completions API (OpenAI, vLLM, llama.cpp, Ollama...).
    kind: Literal["offline", "openai"] = "offline"
    # The API root that `/chat/completions` is appended to, e.g. ``https://api.openai.com/v1``.
    base_url: str = ""
    # Sent as a bearer token when set; local servers often need none.
    api_key: SecretStr = SecretStr("")
    # Empty: the provider's default (only the offline provider has one).
    model: str = ""
    connect_timeout_seconds: float = Field(default=10.0, gt=0)
    # Long: a large prompt can take minutes before the first byte of the answer.
    read_timeout_seconds: float = Field(default=300.0, gt=0)
    # Retries after the first attempt, on 429, 5xx, connection failures and timeouts.
    max_retries: int = Field(default=3, ge=0)
    # Caps every wait between attempts, including what a server asks for in Retry-After.
    max_backoff_seconds: float = Field(default=30.0, ge=0)
    # A response body past this is refused unread (ProviderBadResponse): answers are text, not archives.
    max_response_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
