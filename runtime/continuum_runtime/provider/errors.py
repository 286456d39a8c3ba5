"""Failures of a model provider: one root type, one subclass per thing a caller can do about it.

Messages carry status numbers, error codes, request ids and attempt counts only: never prompts,
message bodies, response bodies or credentials, so they are safe to log and to return to callers.
"""

from __future__ import annotations

from .base import Usage

__all__ = [
    "ProviderAuthFailed",
    "ProviderBadResponse",
    "ProviderError",
    "ProviderInputTooLarge",
    "ProviderOutputTruncated",
    "ProviderQuotaExhausted",
    "ProviderRateLimited",
    "ProviderRequestRejected",
    "ProviderUnavailable",
]


class ProviderError(Exception):
    """A completion that failed. `reason` is a stable machine code; `retryable` says whether trying later may help."""

    reason: str = "PROVIDER_ERROR"
    retryable: bool = False

    def __init__(self, message: str, *, status: int | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The HTTP status of the last attempt, when there was a response.
        self.status = status
        # The provider's id of the last request (x-request-id), for its support, when it sent one.
        self.request_id = request_id


class ProviderRateLimited(ProviderError):
    """The provider kept answering 429 until the retries ran out."""

    reason = "RATE_LIMITED"
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        status: int | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, status=status, request_id=request_id)
        # Seconds the provider last asked to wait (Retry-After), or None when it did not say.
        self.retry_after = retry_after


class ProviderInputTooLarge(ProviderError):
    """The prompt does not fit the model's context window (HTTP 413, or a context-length 400). Send less."""

    reason = "INPUT_TOO_LARGE"


class ProviderOutputTruncated(ProviderError):
    """The answer hit the output-token limit (finish_reason ``length``); a cut-off answer must not be used."""

    reason = "OUTPUT_TRUNCATED"

    def __init__(
        self, message: str, *, usage: Usage | None = None, status: int | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message, status=status, request_id=request_id)
        # What the failed completion cost, so callers can still account for it.
        self.usage = usage if usage is not None else Usage()


class ProviderUnavailable(ProviderError):
    """No answer: 5xx responses, connection failures or timeouts until the retries ran out."""

    reason = "UNAVAILABLE"
    retryable = True


class ProviderBadResponse(ProviderError):
    """The provider answered something that is not a chat completion (not JSON, no choices, no content)."""

    reason = "BAD_RESPONSE"


class ProviderAuthFailed(ProviderError):
    """The provider refused the credentials (HTTP 401 or 403). Fix the configured API key."""

    reason = "AUTH_FAILED"


class ProviderRequestRejected(ProviderError):
    """The provider refused the request for another reason (another 4xx, e.g. an unknown model)."""

    reason = "REQUEST_REJECTED"


class ProviderQuotaExhausted(ProviderError):
    """The account's spending quota or billing refused the call (HTTP 402, or a 429 whose error code is
    ``insufficient_quota``): waiting does not help, raising the quota does. Never retried."""

    reason = "QUOTA_EXHAUSTED"
