"""One place that turns `ProviderSettings` into a provider, so services never pick implementations themselves."""

from __future__ import annotations

from .base import ModelProvider
from .offline import OfflineProvider
from .openai_http import OpenAICompatibleProvider
from .settings import ProviderSettings

__all__ = ["open_provider"]


def open_provider(settings: ProviderSettings) -> ModelProvider:
    """The provider `settings` describe; close it with `aclose`.

    Raises ValueError when the settings are incomplete: the ``openai`` kind needs `base_url` and `model`.
    The ``offline`` kind ignores every other setting.
    """
    if settings.kind == "offline":
        return OfflineProvider()
    return OpenAICompatibleProvider(settings)
