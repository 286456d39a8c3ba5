"""Token counts estimated without a tokenizer: the runtime ships none, and providers differ anyway.

Four UTF-8 bytes per token is close for English prose and code on common BPE tokenizers and
overestimates for most other scripts, which is the safe side when budgeting a context window.
"""

from __future__ import annotations

__all__ = [
    "BYTES_PER_TOKEN",
    "MESSAGE_OVERHEAD_TOKENS",
    "estimate_message_tokens",
    "estimate_tokens",
    "estimate_tokens_of_bytes",
]

BYTES_PER_TOKEN = 4
# Chat APIs wrap every message in a few framing tokens (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 4


def estimate_tokens(text: str) -> int:
    """An estimate, not a count: ceil(UTF-8 bytes of `text` / 4). The empty string is 0 tokens."""
    return estimate_tokens_of_bytes(len(text.encode("utf-8")))


def estimate_tokens_of_bytes(size: int) -> int:
    """An estimate of the tokens in `size` bytes of UTF-8 text, for callers that add up sizes as they go."""
    return -(-size // BYTES_PER_TOKEN)


def estimate_message_tokens(role: str, text: str) -> int:
    """An estimate of what one chat message costs in a prompt: its role, its text and a fixed framing overhead."""
    return MESSAGE_OVERHEAD_TOKENS + estimate_tokens(role) + estimate_tokens(text)
