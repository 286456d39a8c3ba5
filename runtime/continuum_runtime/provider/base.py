"""The contract every model provider keeps: messages in, one completion out, usage only as reported."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["ChatMessage", "Completion", "ModelProvider", "Usage"]


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat-completion request. `role` is passed through as given (e.g. ``user``)."""

    role: str
    # repr=False: a logged or asserted message must not print what the user wrote.
    content: str = field(repr=False)


@dataclass(frozen=True)
class Usage:
    """Tokens a completion cost, as the provider reported them. None means unknown, never zero."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def reported(self) -> bool:
        """Whether the provider reported any usage at all; callers must not invent the missing numbers."""
        return self.prompt_tokens is not None or self.completion_tokens is not None


@dataclass(frozen=True)
class Completion:
    """A finished completion: the whole text the model wrote, never a truncated one."""

    text: str = field(repr=False)
    # The model that answered, as the provider named it (it may differ from the one requested).
    model: str
    usage: Usage
    # As the provider said it, e.g. "stop"; None when it did not say.
    finish_reason: str | None


class ModelProvider(Protocol):
    """A source of chat completions. Failures are raised as `ProviderError` subclasses."""

    @property
    def name(self) -> str:
        """Which implementation this is, e.g. ``offline`` or ``openai-compatible`` (safe to log)."""
        ...

    @property
    def model(self) -> str:
        """The model requests are sent to."""
        ...

    async def complete(self, messages: Sequence[ChatMessage], *, max_output_tokens: int | None = None) -> Completion:
        """The model's answer to `messages`, at most `max_output_tokens` long (None: the provider's limit).

        Raises `ProviderOutputTruncated` rather than return an answer cut off by that limit.
        """
        ...

    async def aclose(self) -> None:
        """Release connections. The provider must not be used afterwards."""
        ...
