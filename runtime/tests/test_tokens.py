"""Tests for the token estimates (`continuum_runtime.provider.tokens`)."""

from __future__ import annotations

import pytest

from continuum_runtime.provider.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    estimate_message_tokens,
    estimate_tokens,
    estimate_tokens_of_bytes,
)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("abcde", 2),
        ("hello world!", 3),
        ("x" * 4000, 1000),
    ],
)
def test_ascii_is_a_quarter_of_its_length_rounded_up(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens


def test_multibyte_text_counts_utf8_bytes_not_characters() -> None:
    chinese = "你好世界"  # 4 characters, 3 bytes each
    assert len(chinese.encode("utf-8")) == 12
    assert estimate_tokens(chinese) == 3
    assert estimate_tokens("你") == 1
    assert estimate_tokens("你好") == 2  # 6 bytes
    assert estimate_tokens("naïve") == 2  # 6 bytes: ï takes two
    assert estimate_tokens("🙂") == 1  # 4 bytes


def test_message_adds_a_fixed_overhead_and_its_role() -> None:
    assert estimate_message_tokens("user", "") == MESSAGE_OVERHEAD_TOKENS + 1
    assert estimate_message_tokens("user", "abcdefgh") == MESSAGE_OVERHEAD_TOKENS + 1 + 2
    assert estimate_message_tokens("assistant", "你好世界") == MESSAGE_OVERHEAD_TOKENS + 3 + 3


def test_estimates_of_bytes_and_of_text_agree() -> None:
    for text in ["", "a", "abcd", "abcde", "你好世界!", "x" * 999]:
        assert estimate_tokens_of_bytes(len(text.encode())) == estimate_tokens(text)
