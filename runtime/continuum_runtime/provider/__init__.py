"""The one model-provider interface: chat messages in, a completion out, failures as `ProviderError`.

`open_provider(ProviderSettings(...))` gives the offline extractive summarizer (the default, no key,
no network) or a client of any OpenAI-compatible chat-completions server.
"""

from __future__ import annotations

from .base import ChatMessage, Completion, ModelProvider, Usage
from .errors import (
    ProviderAuthFailed,
    ProviderBadResponse,
    ProviderError,
    ProviderInputTooLarge,
    ProviderOutputTruncated,
    ProviderQuotaExhausted,
    ProviderRateLimited,
    ProviderRequestRejected,
    ProviderUnavailable,
)
from .factory import open_provider
from .offline import OFFLINE_MODEL, OfflineProvider
from .openai_http import OpenAICompatibleProvider
from .settings import ProviderSettings
from .structured import HINT_KINDS, ITEMS_PROTOCOL, StructuredRequest, parse_structured_request, structured_header
from .tokens import estimate_message_tokens, estimate_tokens

__all__ = [
    "HINT_KINDS",
    "ITEMS_PROTOCOL",
    "OFFLINE_MODEL",
    "ChatMessage",
    "Completion",
    "ModelProvider",
    "OfflineProvider",
    "OpenAICompatibleProvider",
    "ProviderAuthFailed",
    "ProviderBadResponse",
    "ProviderError",
    "ProviderInputTooLarge",
    "ProviderOutputTruncated",
    "ProviderQuotaExhausted",
    "ProviderRateLimited",
    "ProviderRequestRejected",
    "ProviderSettings",
    "ProviderUnavailable",
    "StructuredRequest",
    "Usage",
    "estimate_message_tokens",
    "estimate_tokens",
    "open_provider",
    "parse_structured_request",
    "structured_header",
]
