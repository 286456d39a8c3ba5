"""Extraction budgets (kept apart, configurable through MERGE_EXTRACTION__*) and the call policy."""

from __future__ import annotations

import pytest

from continuum_merge.extraction import CallPolicy, ExtractionSettings
from continuum_merge.extraction.prompts import EXTRACT_INSTRUCTIONS, instruction_tokens
from continuum_merge.settings import MergeSettings


def test_the_defaults_are_issue_10s() -> None:
    settings = ExtractionSettings()
    budget = settings.unit_budget()
    # 16,384 estimated tokens minus instructions and wrapping, the visible target and max(1024, 5% of 128,000).
    assert budget.request_tokens == 16_384
    assert budget.output_tokens == 2_048 and settings.brief_tokens == 2_048
    assert budget.safety_tokens == 6_400
    assert budget.instruction_tokens >= instruction_tokens(EXTRACT_INSTRUCTIONS)
    assert budget.material_tokens == 16_384 - 2_048 - 6_400 - budget.instruction_tokens
    # No thinking reserve for a model that does not think: max_tokens is the visible target.
    assert budget.generation_tokens == 2_048
    assert (budget.request_bytes, budget.response_bytes) == (1024 * 1024, 256 * 1024)
    assert budget.floor_tokens == 256
    policy = settings.call_policy(clock=None)  # type: ignore[arg-type]
    assert (policy.attempts, policy.backoff_seconds, policy.timeout_seconds) == (3, (2.0, 5.0), 300.0)


def test_a_small_window_keeps_a_1024_token_margin_and_a_thinking_model_gets_its_reserve() -> None:
    small = ExtractionSettings(context_window_tokens=16_384).unit_budget()
    assert small.safety_tokens == 1_024
    thinking = ExtractionSettings(supports_thinking=True, max_output_tokens=64_000)
    # min(32,768, window / 4), beside the visible target within the max output.
    assert thinking.thinking_tokens == 32_000
    assert thinking.unit_budget().generation_tokens == 2_048 + 32_000
    capped = ExtractionSettings(supports_thinking=True, max_output_tokens=8_192)
    assert capped.thinking_tokens == 8_192 - 2_048
    # The thinking reserve comes out of the window, not out of the request target, unless the window is short.
    assert thinking.unit_budget().material_tokens == ExtractionSettings().unit_budget().material_tokens
    tight = ExtractionSettings(context_window_tokens=20_000, supports_thinking=True, max_output_tokens=64_000)
    budget = tight.unit_budget()
    assert budget.request_tokens == 20_000 - 5_000
    total = budget.material_tokens + budget.instruction_tokens + budget.generation_tokens + budget.safety_tokens
    assert total <= 20_000


def test_settings_that_leave_no_material_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="less than 256"):
        ExtractionSettings(request_tokens=4_096, visible_output_tokens=2_048)
    with pytest.raises(ValueError, match="backoff"):
        ExtractionSettings(backoff_seconds=())


def test_every_figure_is_a_merge_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERGE_EXTRACTION__REQUEST_TOKENS", "32768")
    monkeypatch.setenv("MERGE_EXTRACTION__CALL_TIMEOUT_SECONDS", "60")
    monkeypatch.setenv("MERGE_EXTRACTION__BACKOFF_SECONDS", "[1, 3]")
    monkeypatch.setenv("MERGE_EXTRACTION__SHRINK_FLOOR_TOKENS", "512")
    extraction = MergeSettings().extraction
    assert extraction.unit_budget().request_tokens == 32_768
    assert extraction.call_timeout_seconds == 60
    assert extraction.backoff_seconds == (1.0, 3.0)
    assert extraction.unit_budget().floor_tokens == 512


def test_backoff_is_2_then_5_seconds_unless_the_server_says_otherwise() -> None:
    policy = CallPolicy()
    assert [policy.delay(retry, None) for retry in (1, 2, 3)] == [2.0, 5.0, 5.0]
    assert policy.delay(1, 7.5) == 7.5
    assert policy.delay(1, 10_000) == 120.0
