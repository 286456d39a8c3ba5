"""Tests for the offline extractive provider (`continuum_runtime.provider.offline`)."""

from __future__ import annotations

import pytest

from continuum_runtime.provider import (
    OFFLINE_MODEL,
    ChatMessage,
    OfflineProvider,
    ProviderOutputTruncated,
    ProviderSettings,
    estimate_tokens,
    open_provider,
)

INSTRUCTION = ChatMessage("system", "Summarize the conversation below. Keep decisions and open work.")
CONVERSATION = [
    INSTRUCTION,
    ChatMessage("user", "Fix the failing settings test. It broke after the rename.\nDetails follow."),
    ChatMessage(
        "assistant",
        "I'll look at runtime/continuum_runtime/settings.py:12 first, not https://example.com/a.py.\n"
        "$ .venv/bin/pytest runtime/tests -q\n"
        "Then I will run `make test` once more.",
    ),
    ChatMessage(
        "tool",
        "collected 12 items\n"
        "E   AssertionError: expected port 0\n"
        "FAILED runtime/tests/test_settings.py::test_port - AssertionError\n"
        "\x1b[31m1 failed\x1b[0m, 11 passed",
    ),
    ChatMessage("user", "You must never commit the .env file.\nTODO: document PORT in README.md"),
    ChatMessage("critic", "Opinion without any matching line"),
    ChatMessage("assistant", "Done: the port default is back to 0. See ./deploy/compose.yaml and /etc/hosts."),
]


async def summarize(messages: list[ChatMessage], **kwargs: int) -> str:
    provider = OfflineProvider()
    try:
        completion = await provider.complete(messages, **kwargs)
    finally:
        await provider.aclose()
    assert completion.model == OFFLINE_MODEL
    assert completion.finish_reason == "stop"
    return completion.text


async def test_says_it_is_an_extractive_offline_summary() -> None:
    text = await summarize(CONVERSATION)
    first_line = text.splitlines()[0]
    assert "Extractive summary" in first_line
    assert "offline provider" in first_line
    assert "not an LLM" in first_line


async def test_keeps_requests_paths_commands_errors_and_constraints() -> None:
    text = await summarize(CONVERSATION)
    lines = text.splitlines()
    # The first sentence of each user message.
    assert "- Fix the failing settings test." in lines
    assert "- You must never commit the .env file." in lines
    for path in [
        "runtime/continuum_runtime/settings.py",
        "runtime/tests/test_settings.py",
        "README.md",
        "./deploy/compose.yaml",
        "/etc/hosts",
    ]:
        assert f"- {path}" in lines, path
    assert not any("example.com" in line for line in lines)
    assert "- .venv/bin/pytest runtime/tests -q" in lines
    assert "- make test" in lines
    assert "- E   AssertionError: expected port 0" in lines
    assert "- 1 failed, 11 passed" in lines  # terminal colours stripped
    assert "- TODO: document PORT in README.md" in lines
    assert lines[-1] == "- Done: the port default is back to 0. See ./deploy/compose.yaml and /etc/hosts."


async def test_copies_nothing_from_system_messages_or_unmatched_prose() -> None:
    text = await summarize(CONVERSATION)
    assert "Summarize the conversation" not in text
    assert "Opinion without" not in text
    assert "Details follow" not in text


async def test_same_input_same_output() -> None:
    first = await summarize(CONVERSATION)
    second = await summarize(list(CONVERSATION))
    assert first == second


async def test_usage_is_estimated() -> None:
    provider = OfflineProvider()
    completion = await provider.complete(CONVERSATION)
    assert completion.usage.reported
    assert completion.usage.completion_tokens == estimate_tokens(completion.text)
    assert completion.usage.prompt_tokens is not None
    assert completion.usage.prompt_tokens > sum(estimate_tokens(m.content) for m in CONVERSATION)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [INSTRUCTION],
        [ChatMessage("user", "")],
        [ChatMessage("assistant", "  \n\n  ")],
        [ChatMessage("", "plain words"), ChatMessage("developer", "more plain words")],
    ],
)
async def test_empty_or_unmatched_input_still_gives_a_summary(messages: list[ChatMessage]) -> None:
    text = await summarize(messages)
    lines = text.splitlines()
    assert lines[0].startswith("Extractive summary")
    assert len(lines) == 2
    assert "nothing to extract" in lines[1]


async def test_output_is_bounded_by_the_limit_and_cut_at_a_line() -> None:
    noisy = [
        ChatMessage("user", f"Step {i}: edit src/module_{i}.py and never skip the tests.\nerror {i}: boom")
        for i in range(400)
    ]
    unbounded = await summarize(noisy)
    # Each section keeps its first item and the most recent ones.
    assert "- src/module_0.py" in unbounded
    assert "- src/module_399.py" in unbounded
    assert "- src/module_200.py" not in unbounded
    assert estimate_tokens(unbounded) <= 1024

    bounded = await summarize(noisy, max_output_tokens=120)
    assert estimate_tokens(bounded) <= 120
    lines = bounded.splitlines()
    assert lines[0].startswith("Extractive summary")
    assert lines[-1] == "[more lines omitted to fit the output limit]"
    assert set(lines[1:-1]) <= set(unbounded.splitlines())


async def test_long_lines_are_clipped() -> None:
    text = await summarize([ChatMessage("user", "x" * 100_000 + " error")])
    assert max(len(line) for line in text.splitlines()) <= 202


async def test_a_limit_too_small_for_the_header_raises_truncated() -> None:
    provider = OfflineProvider()
    with pytest.raises(ProviderOutputTruncated) as caught:
        await provider.complete(CONVERSATION, max_output_tokens=10)
    assert caught.value.reason == "OUTPUT_TRUNCATED"
    assert not caught.value.retryable


@pytest.mark.parametrize("limit", [0, -1])
async def test_an_output_limit_below_one_is_refused(limit: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        await OfflineProvider().complete(CONVERSATION, max_output_tokens=limit)


async def test_open_provider_defaults_to_offline() -> None:
    provider = open_provider(ProviderSettings())
    assert isinstance(provider, OfflineProvider)
    assert provider.name == "offline"
    assert provider.model == OFFLINE_MODEL
    await provider.aclose()


async def test_an_earlier_offline_summary_is_folded_forward() -> None:
    provider = OfflineProvider()
    first = await provider.complete(
        [ChatMessage("user", "Fix src/a.py please."), ChatMessage("assistant", "Fixed it.")]
    )
    second = await provider.complete(
        [
            ChatMessage("assistant", first.text),
            ChatMessage("user", "Now update docs/b.md."),
            ChatMessage("assistant", "Done."),
        ]
    )

    assert second.text.count("Extractive summary by the offline provider") == 1
    for kept in ("Fix src/a.py please.", "src/a.py", "Now update docs/b.md.", "docs/b.md"):
        assert kept in second.text
    assert second.text.endswith("- Done.")
