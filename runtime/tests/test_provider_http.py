"""Tests of the OpenAI-compatible provider against a scripted HTTP server on loopback."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from model_server_testing import MODEL, FakeModelServer, Reply, completion, json_reply
from pydantic_settings import SettingsConfigDict

from continuum_runtime.provider import (
    ChatMessage,
    OpenAICompatibleProvider,
    ProviderAuthFailed,
    ProviderBadResponse,
    ProviderError,
    ProviderInputTooLarge,
    ProviderOutputTruncated,
    ProviderQuotaExhausted,
    ProviderRateLimited,
    ProviderRequestRejected,
    ProviderSettings,
    ProviderUnavailable,
    open_provider,
)
from continuum_runtime.provider.retry import backoff_delay, parse_retry_after
from continuum_runtime.settings import ServiceSettings

API_KEY = "sk-test-DO-NOT-LEAK-0123456789"
PROMPT = "PRIVATE-PROMPT: the user's secret plans"
MESSAGES = [ChatMessage("system", "Summarize."), ChatMessage("user", PROMPT)]


class SleepRecorder:
    """Stands in for asyncio.sleep: records each requested wait and returns at once."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


@pytest.fixture
async def server() -> AsyncIterator[FakeModelServer]:
    fake = FakeModelServer()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


Connect = Callable[..., OpenAICompatibleProvider]


@pytest.fixture
async def connect(server: FakeModelServer, sleeps: SleepRecorder) -> AsyncIterator[Connect]:
    """Makes providers for the fake server (settings overridable) and closes them after the test."""
    opened: list[OpenAICompatibleProvider] = []

    def make(**overrides: Any) -> OpenAICompatibleProvider:
        values: dict[str, Any] = {"kind": "openai", "base_url": server.url, "model": MODEL, "api_key": API_KEY}
        provider = OpenAICompatibleProvider(ProviderSettings(**(values | overrides)), sleep=sleeps)
        opened.append(provider)
        return provider

    yield make
    for provider in opened:
        await provider.aclose()


# ---- successes ----------------------------------------------------------------------------------


async def test_success_with_usage(server: FakeModelServer, connect: Connect, sleeps: SleepRecorder) -> None:
    server.script(completion("The summary.", usage={"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49}))
    result = await connect().complete(MESSAGES)
    assert result.text == "The summary."
    assert result.model == f"{MODEL}-2024"
    assert result.finish_reason == "stop"
    assert result.usage.reported
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (42, 7)
    assert len(server.requests) == 1
    assert sleeps.calls == []


async def test_success_without_usage_leaves_usage_unknown(server: FakeModelServer, connect: Connect) -> None:
    server.script(completion())
    result = await connect().complete(MESSAGES)
    assert not result.usage.reported
    assert result.usage.prompt_tokens is None
    assert result.usage.completion_tokens is None


async def test_request_carries_bearer_key_model_messages_and_max_tokens(
    server: FakeModelServer, connect: Connect
) -> None:
    server.script(completion())
    await connect().complete(MESSAGES, max_output_tokens=256)
    [request] = server.requests
    assert request.method == "POST"
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    assert request.headers["content-type"] == "application/json"
    assert request.json() == {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Summarize."}, {"role": "user", "content": PROMPT}],
        "max_tokens": 256,
    }


async def test_no_key_sends_no_authorization_and_no_limit_sends_no_max_tokens(
    server: FakeModelServer, connect: Connect
) -> None:
    server.script(completion())
    await connect(api_key="", base_url=server.url + "/").complete(MESSAGES)
    [request] = server.requests
    assert request.path == "/v1/chat/completions"
    assert "authorization" not in request.headers
    assert "max_tokens" not in request.json()


# ---- retries ------------------------------------------------------------------------------------


async def test_429_with_retry_after_then_success(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder
) -> None:
    server.script(json_reply({"error": {"code": "rate_limit_exceeded"}}, 429, (("Retry-After", "7"),)), completion())
    result = await connect().complete(MESSAGES)
    assert result.text == "A short summary."
    assert sleeps.calls == [7.0]
    assert len(server.requests) == 2


async def test_retry_after_as_http_date(server: FakeModelServer, connect: Connect, sleeps: SleepRecorder) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=20), usegmt=True)
    server.script(Reply(503, headers=(("Retry-After", when),)), completion())
    await connect(max_backoff_seconds=60).complete(MESSAGES)
    [delay] = sleeps.calls
    assert 15 < delay <= 20


async def test_retry_after_is_capped_by_max_backoff(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder
) -> None:
    server.script(Reply(429, headers=(("Retry-After", "3600"),)), completion())
    await connect(max_backoff_seconds=30).complete(MESSAGES)
    assert sleeps.calls == [30.0]


async def test_429_forever_raises_rate_limited(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder
) -> None:
    server.script(*[Reply(429, headers=(("Retry-After", "2"), ("x-request-id", "req-429")))] * 3)
    with pytest.raises(ProviderRateLimited) as caught:
        await connect(max_retries=2).complete(MESSAGES)
    assert len(server.requests) == 3
    assert sleeps.calls == [2.0, 2.0]
    error = caught.value
    assert error.retry_after == 2.0
    assert error.status == 429
    assert error.request_id == "req-429"
    assert error.reason == "RATE_LIMITED"
    assert error.retryable
    assert "3 attempts" in str(error)


async def test_500_then_success(server: FakeModelServer, connect: Connect, sleeps: SleepRecorder) -> None:
    server.script(Reply(500, b"oops"), completion())
    result = await connect().complete(MESSAGES)
    assert result.text == "A short summary."
    [delay] = sleeps.calls
    assert 0.25 <= delay <= 0.5  # the first backoff, jittered within its upper half


async def test_503_exhausted_raises_unavailable_after_backing_off(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder
) -> None:
    server.script(*[Reply(503)] * 4)
    with pytest.raises(ProviderUnavailable) as caught:
        await connect(max_retries=3, max_backoff_seconds=1.5).complete(MESSAGES)
    assert len(server.requests) == 4
    assert caught.value.status == 503
    assert caught.value.retryable
    ceilings = [0.5, 1.0, 1.5]  # doubling, capped by max_backoff_seconds
    assert len(sleeps.calls) == 3
    for delay, ceiling in zip(sleeps.calls, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling


async def test_read_timeout_is_retried_then_unavailable(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder
) -> None:
    server.script(*[Reply(delay_seconds=5.0)] * 2)
    with pytest.raises(ProviderUnavailable) as caught:
        await connect(read_timeout_seconds=0.2, max_retries=1).complete(MESSAGES)
    assert len(server.requests) == 2
    assert len(sleeps.calls) == 1
    assert caught.value.status is None
    assert "ReadTimeout" in str(caught.value)


async def test_connection_refused_is_retried_then_unavailable(sleeps: SleepRecorder) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = ProviderSettings(kind="openai", base_url=f"http://127.0.0.1:{port}/v1", model=MODEL, max_retries=2)
    provider = OpenAICompatibleProvider(settings, sleep=sleeps)
    try:
        with pytest.raises(ProviderUnavailable, match="ConnectError"):
            await provider.complete(MESSAGES)
    finally:
        await provider.aclose()
    assert len(sleeps.calls) == 2


# ---- failures that are not retried --------------------------------------------------------------


async def test_413_is_input_too_large_after_one_request(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder
) -> None:
    server.script(Reply(413, b"request entity too large"))
    with pytest.raises(ProviderInputTooLarge) as caught:
        await connect().complete(MESSAGES)
    assert len(server.requests) == 1
    assert sleeps.calls == []
    assert caught.value.status == 413
    assert not caught.value.retryable


@pytest.mark.parametrize(
    "error",
    [
        {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"},
        {"message": "the request exceeds the available context size", "type": "exceed_context_size_error"},
        {"message": "This model's maximum context length is 4096 tokens.", "code": 400},
    ],
)
async def test_context_length_400_is_input_too_large(
    server: FakeModelServer, connect: Connect, error: dict[str, object]
) -> None:
    server.script(json_reply({"error": error}, 400))
    with pytest.raises(ProviderInputTooLarge):
        await connect().complete(MESSAGES)
    assert len(server.requests) == 1


async def test_other_4xx_is_rejected_with_its_code(server: FakeModelServer, connect: Connect) -> None:
    server.script(
        json_reply({"error": {"message": f"unknown model; you said {PROMPT}", "code": "model_not_found"}}, 404)
    )
    with pytest.raises(ProviderRequestRejected) as caught:
        await connect().complete(MESSAGES)
    assert str(caught.value) == "provider rejected the request (HTTP 404, code model_not_found)"
    assert len(server.requests) == 1


@pytest.mark.parametrize("status", [401, 403])
async def test_auth_failure(server: FakeModelServer, connect: Connect, sleeps: SleepRecorder, status: int) -> None:
    server.script(json_reply({"error": {"code": "invalid_api_key", "message": f"bad key {API_KEY}"}}, status))
    with pytest.raises(ProviderAuthFailed) as caught:
        await connect().complete(MESSAGES)
    assert caught.value.status == status
    assert caught.value.reason == "AUTH_FAILED"
    assert len(server.requests) == 1
    assert sleeps.calls == []


async def test_finish_reason_length_is_output_truncated(server: FakeModelServer, connect: Connect) -> None:
    server.script(completion("A summary that stops mid-", finish_reason="length", usage={"prompt_tokens": 9}))
    with pytest.raises(ProviderOutputTruncated) as caught:
        await connect().complete(MESSAGES, max_output_tokens=8)
    assert caught.value.usage.prompt_tokens == 9
    assert caught.value.usage.completion_tokens is None
    assert "stops mid" not in str(caught.value)
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        (Reply(200, b"<html>not json</html>"), "not JSON"),
        (Reply(200, b"\xff\xfe\x00garbage"), "not JSON"),
        (json_reply({"id": "x", "object": "chat.completion"}), "no choices"),
        (json_reply({"choices": []}), "no choices"),
        (json_reply(["not", "an", "object"]), "no choices"),
        (json_reply({"choices": [{"message": {"role": "assistant", "content": None}}]}), "no message content"),
        (json_reply({"choices": [{"finish_reason": "stop"}]}), "no message content"),
    ],
)
async def test_malformed_success_is_bad_response(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder, reply: Reply, detail: str
) -> None:
    server.script(reply)
    with pytest.raises(ProviderBadResponse, match=detail):
        await connect().complete(MESSAGES)
    assert len(server.requests) == 1
    assert sleeps.calls == []


@pytest.mark.parametrize("status", [402, 429])
async def test_a_spent_quota_is_not_retried(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder, status: int
) -> None:
    server.script(json_reply({"error": {"code": "insufficient_quota", "message": "You exceeded your quota"}}, status))
    with pytest.raises(ProviderQuotaExhausted, match=f"HTTP {status}, code insufficient_quota"):
        await connect().complete(MESSAGES)
    assert len(server.requests) == 1
    assert sleeps.calls == []


async def test_a_response_over_the_byte_limit_is_refused_unread_and_not_retried(
    server: FakeModelServer, connect: Connect, sleeps: SleepRecorder
) -> None:
    # 4 MiB of answer against a 64 KiB limit: refused as soon as the limit is passed, never retried.
    server.script(completion("x" * (4 * 1024 * 1024)))
    with pytest.raises(ProviderBadResponse, match="over 65536 bytes"):
        await connect(max_response_bytes=64 * 1024).complete(MESSAGES)
    assert len(server.requests) == 1
    assert sleeps.calls == []


@pytest.mark.parametrize("limit", [0, -1])
async def test_an_output_limit_below_one_is_refused_before_any_request(
    server: FakeModelServer, connect: Connect, limit: int
) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        await connect().complete(MESSAGES, max_output_tokens=limit)
    assert server.requests == []


# ---- secrets ------------------------------------------------------------------------------------


async def test_errors_logs_and_reprs_never_carry_the_key_or_the_prompt(
    server: FakeModelServer, connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    echo = json.dumps({"error": {"message": f"{API_KEY} {PROMPT}", "code": "x"}}).encode()
    server.script(
        Reply(401, echo),
        Reply(400, echo),
        Reply(413, echo),
        Reply(500, echo),
        Reply(429, echo),
        Reply(200, echo),
        completion(PROMPT, finish_reason="length"),
    )
    provider = connect(max_retries=1)
    errors: list[ProviderError] = []
    with caplog.at_level(logging.DEBUG):
        for _ in range(5):
            with pytest.raises(ProviderError) as caught:
                await provider.complete(MESSAGES)
            errors.append(caught.value)
    assert [type(e) for e in errors] == [
        ProviderAuthFailed,
        ProviderRequestRejected,
        ProviderInputTooLarge,
        ProviderRateLimited,  # 500, then 429 on the one retry
        ProviderBadResponse,
    ]
    with pytest.raises(ProviderOutputTruncated) as truncated:
        await provider.complete(MESSAGES)
    errors.append(truncated.value)
    settings = ProviderSettings(kind="openai", base_url=server.url, model=MODEL, api_key=API_KEY)
    texts = [str(e) for e in errors] + [repr(e) for e in errors] + [repr(settings), str(settings), repr(provider)]
    texts += [repr(MESSAGES)] + [json.dumps(record.__dict__, default=str) for record in caplog.records]
    assert caplog.records  # the retry was logged
    for text in texts:
        assert API_KEY not in text
        assert "PRIVATE-PROMPT" not in text


# ---- settings, factory and retry arithmetic -----------------------------------------------------


async def test_open_provider_requires_base_url_and_model() -> None:
    with pytest.raises(ValueError, match="base_url and model"):
        open_provider(ProviderSettings(kind="openai"))
    with pytest.raises(ValueError, match="needs model"):
        open_provider(ProviderSettings(kind="openai", base_url="http://127.0.0.1:1/v1"))
    with pytest.raises(ValueError, match="http:// or https://"):
        open_provider(ProviderSettings(kind="openai", base_url="127.0.0.1:1/v1", model=MODEL))
    # The provider keeps the same checks when built directly.
    with pytest.raises(ValueError, match="needs base_url to be set"):
        OpenAICompatibleProvider(ProviderSettings(kind="openai", model=MODEL))
    provider = open_provider(ProviderSettings(kind="openai", base_url="http://127.0.0.1:1/v1", model=MODEL))
    assert isinstance(provider, OpenAICompatibleProvider)
    assert (provider.name, provider.model) == ("openai-compatible", MODEL)
    await provider.aclose()


def test_settings_nest_in_a_service_with_prefixed_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    class CompactionSettings(ServiceSettings):
        model_config = SettingsConfigDict(env_prefix="COMPACTION_", env_nested_delimiter="_", env_nested_max_split=1)
        provider: ProviderSettings = ProviderSettings()

    assert CompactionSettings().provider.kind == "offline"
    monkeypatch.setenv("COMPACTION_PROVIDER_KIND", "openai")
    monkeypatch.setenv("COMPACTION_PROVIDER_BASE_URL", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("COMPACTION_PROVIDER_API_KEY", API_KEY)
    monkeypatch.setenv("COMPACTION_PROVIDER_MAX_RETRIES", "5")
    monkeypatch.setenv("COMPACTION_PORT", "7000")
    settings = CompactionSettings()
    assert settings.port == 7000
    assert settings.provider.kind == "openai"
    assert settings.provider.base_url == "http://127.0.0.1:8000/v1"
    assert settings.provider.api_key.get_secret_value() == API_KEY
    assert settings.provider.max_retries == 5
    assert API_KEY not in repr(settings)


def test_parse_retry_after() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("120", now=now) == 120.0
    assert parse_retry_after(" 1.5 ", now=now) == 1.5
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:30 GMT", now=now) == 30.0
    assert parse_retry_after("Wed, 01 Jan 2025 11:00:00 GMT", now=now) == 0.0
    for unreadable in [None, "", "soon", "-5", "nan", "inf"]:
        assert parse_retry_after(unreadable, now=now) is None


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    assert backoff_delay(1, first_seconds=0.5, max_seconds=30, jitter=0.0) == 0.25
    assert backoff_delay(1, first_seconds=0.5, max_seconds=30, jitter=1.0) == 0.5
    assert backoff_delay(4, first_seconds=0.5, max_seconds=30, jitter=1.0) == 4.0
    assert backoff_delay(10_000, first_seconds=0.5, max_seconds=30, jitter=1.0) == 30.0
    assert backoff_delay(1, first_seconds=0.5, max_seconds=30, jitter=0.5, retry_after=12) == 12
    assert backoff_delay(1, first_seconds=0.5, max_seconds=30, jitter=0.5, retry_after=120) == 30
