"""A provider for any server that speaks the OpenAI chat-completions API over HTTP.

Retries 408, 409, 429, 5xx, connection failures and timeouts with exponential backoff and jitter,
or after the server's Retry-After, up to `max_retries` times; everything else fails at once.
Logs carry statuses, attempt numbers and delays only: never prompts, answers or the API key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from .base import ChatMessage, Completion, Usage
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
from .retry import backoff_delay, parse_retry_after
from .settings import ProviderSettings

__all__ = ["ChatAnswer", "OpenAICompatibleProvider", "Sleep", "post_chat_completion"]

logger = logging.getLogger("continuum.provider")

Sleep = Callable[[float], Awaitable[None]]

_FIRST_BACKOFF_SECONDS = 0.5
_RETRIED_STATUSES = frozenset({408, 409, 429})
# The error code OpenAI-compatible servers answer (with 429) when the account's quota is spent.
_QUOTA_CODE = "insufficient_quota"
# How servers say "the prompt does not fit": OpenAI's error code, llama.cpp's error type, vLLM's message.
_CONTEXT_MARKERS = ("context_length_exceeded", "exceed_context_size", "maximum context length")


class OpenAICompatibleProvider:
    """POSTs `{base_url}/chat/completions` with httpx; one connection pool per provider, closed by `aclose`.

    `sleep` waits between attempts (tests pass a recorder); `transport` replaces httpx's network transport.
    """

    name = "openai-compatible"

    def __init__(
        self,
        settings: ProviderSettings,
        *,
        sleep: Sleep = asyncio.sleep,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        missing = [name for name in ("base_url", "model") if not getattr(settings, name)]
        if missing:
            raise ValueError(f"provider kind 'openai' needs {' and '.join(missing)} to be set")
        if not settings.base_url.startswith(("http://", "https://")):
            raise ValueError("the openai provider needs a base_url starting with http:// or https://")
        self._settings = settings
        self._url = settings.base_url.rstrip("/") + "/chat/completions"
        self._sleep = sleep
        headers = {"Accept": "application/json"}
        if api_key := settings.api_key.get_secret_value():
            headers["Authorization"] = f"Bearer {api_key}"
        timeout = httpx.Timeout(settings.read_timeout_seconds, connect=settings.connect_timeout_seconds)
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport)

    @property
    def model(self) -> str:
        """The model named in every request."""
        return self._settings.model

    def __repr__(self) -> str:
        return f"OpenAICompatibleProvider(model={self.model!r})"

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def complete(self, messages: Sequence[ChatMessage], *, max_output_tokens: int | None = None) -> Completion:
        """The model's answer to `messages`; see `ModelProvider.complete`. Raises `ProviderError` subclasses."""
        if max_output_tokens is not None and max_output_tokens < 1:
            raise ValueError("max_output_tokens must be at least 1")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": message.role, "content": message.content} for message in messages],
        }
        if max_output_tokens is not None:
            body["max_tokens"] = max_output_tokens
        answer = await post_chat_completion(
            self._client, self._url, body, self._settings, sleep=self._sleep, provider=self.name
        )
        return _completion(answer, self.model)


@dataclass(frozen=True)
class ChatAnswer:
    """A successful chat-completions response: its status, the server's request id and the parsed JSON."""

    status: int
    request_id: str | None
    payload: Any = field(repr=False)


async def post_chat_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    settings: ProviderSettings,
    *,
    sleep: Sleep,
    provider: str,
) -> ChatAnswer:
    """POST `body` to `url` under the retry policy of `settings`; the parsed answer of the first success.

    Every client of a chat-completions server (the provider here, the reference agent's tool-calling
    model) goes through this one loop. A response body is read as a stream and refused past
    `settings.max_response_bytes`, so a misbehaving server cannot grow the caller's memory.
    """
    attempts = settings.max_retries + 1
    for attempt in range(1, attempts + 1):
        status: int | None = None
        error: httpx.TransportError | None = None
        try:
            async with client.stream("POST", url, json=body) as response:
                status, headers = response.status_code, response.headers
                content = await _read_bounded(response, settings.max_response_bytes)
        except httpx.TransportError as exc:  # connection failures and every kind of timeout, body included
            status, error = None, exc
        except httpx.DecodingError as exc:
            raise ProviderBadResponse("chat completion response could not be decoded") from exc
        retry_after = None
        if status is not None:
            request_id = headers.get("x-request-id")
            if 200 <= status < 300:
                return ChatAnswer(status, request_id, _json(content, status, request_id))
            if not _retried(status) or _quota_exhausted(status, content):
                raise _refusal(status, request_id, content)
            retry_after = parse_retry_after(headers.get("retry-after"))
        if attempt == attempts:
            raise _exhausted(status, headers if status is not None else None, error, attempts, retry_after) from error
        delay = backoff_delay(
            attempt,
            first_seconds=_FIRST_BACKOFF_SECONDS,
            max_seconds=settings.max_backoff_seconds,
            jitter=random.random(),
            retry_after=retry_after,
        )
        logger.warning(
            "chat completion attempt failed, retrying",
            extra={
                "provider": provider,
                "attempt": attempt,
                "status": status,
                "error": type(error).__name__ if error is not None else None,
                "delay_seconds": round(delay, 3),
            },
        )
        await sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _read_bounded(response: httpx.Response, limit: int) -> bytes:
    """The whole body, or ProviderBadResponse as soon as it passes `limit` bytes."""
    received = bytearray()
    async for piece in response.aiter_bytes():
        received += piece
        if len(received) > limit:
            raise ProviderBadResponse(
                f"chat completion response is over {limit} bytes; it was not read further",
                status=response.status_code,
                request_id=response.headers.get("x-request-id"),
            )
    return bytes(received)


def _json(content: bytes, status: int, request_id: str | None) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        raise ProviderBadResponse(
            f"chat completion response is not JSON (HTTP {status})", status=status, request_id=request_id
        ) from None


def _retried(status: int) -> bool:
    return status in _RETRIED_STATUSES or status >= 500


def _quota_exhausted(status: int, content: bytes) -> bool:
    """A 429 that is not a rate limit: OpenAI's out-of-quota answer, which no wait cures."""
    return status == 429 and _error_fields(content)[0] == _QUOTA_CODE


def _exhausted(
    status: int | None,
    headers: httpx.Headers | None,
    error: httpx.TransportError | None,
    attempts: int,
    retry_after: float | None,
) -> ProviderError:
    if status is None or headers is None:
        return ProviderUnavailable(f"chat completion failed after {attempts} attempts: {type(error).__name__}")
    request_id = headers.get("x-request-id")
    if status == 429:
        return ProviderRateLimited(
            f"chat completion rate limited (HTTP 429) after {attempts} attempts",
            retry_after=retry_after,
            status=status,
            request_id=request_id,
        )
    return ProviderUnavailable(
        f"chat completion failed with HTTP {status} after {attempts} attempts", status=status, request_id=request_id
    )


def _refusal(status: int, request_id: str | None, content: bytes) -> ProviderError:
    """The error for a status that trying again will not fix."""
    code, detail = _error_fields(content)
    described = f"HTTP {status}" + (f", code {code}" if code else "")
    if status == 402 or (status == 429 and code == _QUOTA_CODE):
        return ProviderQuotaExhausted(
            f"the provider refused for billing or quota ({described})", status=status, request_id=request_id
        )
    if status in (401, 403):
        return ProviderAuthFailed(
            f"provider refused the credentials ({described})", status=status, request_id=request_id
        )
    if status == 413 or (status == 400 and any(marker in detail for marker in _CONTEXT_MARKERS)):
        return ProviderInputTooLarge(
            f"prompt does not fit the model's context ({described})", status=status, request_id=request_id
        )
    if 400 <= status < 500:
        return ProviderRequestRejected(
            f"provider rejected the request ({described})", status=status, request_id=request_id
        )
    return ProviderBadResponse(f"unexpected HTTP {status} from the provider", status=status, request_id=request_id)


def _error_fields(content: bytes) -> tuple[str, str]:
    """The error code safe to quote (or ""), and the lowercased code, type and message to classify by."""
    try:
        payload = json.loads(content)
    except ValueError:
        return "", ""
    error = payload.get("error", payload) if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return "", ""
    raw_code = error.get("code")
    code = raw_code if isinstance(raw_code, str) and raw_code.isidentifier() and len(raw_code) <= 64 else ""
    detail = " ".join(str(error.get(key, "")) for key in ("code", "type", "message"))
    return code, detail.lower()


def _completion(answer: ChatAnswer, requested_model: str) -> Completion:
    status, request_id, payload = answer.status, answer.request_id, answer.payload
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ProviderBadResponse("chat completion response has no choices", status=status, request_id=request_id)
    choice: dict[str, Any] = choices[0]
    usage = _usage(payload.get("usage"))
    finish_reason = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None
    if finish_reason == "length":
        raise ProviderOutputTruncated(
            "chat completion hit the output token limit (finish_reason length)",
            usage=usage,
            status=status,
            request_id=request_id,
        )
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise ProviderBadResponse(
            "chat completion response has no message content", status=status, request_id=request_id
        )
    model = payload.get("model")
    return Completion(
        text=content,
        model=model if isinstance(model, str) and model else requested_model,
        usage=usage,
        finish_reason=finish_reason,
    )


def _usage(value: object) -> Usage:
    """The usage the server reported; a missing or malformed count stays unknown."""
    if not isinstance(value, dict):
        return Usage()
    return Usage(
        prompt_tokens=_count(value.get("prompt_tokens")), completion_tokens=_count(value.get("completion_tokens"))
    )


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
