"""One summarization batch: the provider call, the must-survive facts check and its single retry.

No database work happens here, so no transaction is ever held across a model call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from continuum_compaction.cuts import Unit
from continuum_compaction.facts import Fact, extract_facts, merge_facts, missing_facts, with_preserved_facts
from continuum_compaction.history import LoadedMessage, message_text
from continuum_runtime.provider import (
    ChatMessage,
    Completion,
    ModelProvider,
    ProviderBadResponse,
    ProviderError,
    estimate_tokens,
)

logger = logging.getLogger("continuum.compaction")

INSTRUCTIONS = (
    "You maintain the running summary of a coding-assistant session so the work can continue without "
    "the original messages. The conversation follows; if it starts with an assistant message, that is the "
    "summary so far. Merge it with the messages after it into one summary. "
    "Keep: the user's goals, constraints and decisions; files touched and why; commands run and their "
    "outcome; errors seen and whether they were fixed; open todos and the next step. Quote file paths, "
    "commands and error messages exactly. Write plain text, no preamble."
)
CLOSING = "Now write the updated summary of everything above, following the instructions."
CORRECTION = "The summary lost these facts. Rewrite the whole summary so it keeps every one of them exactly:"
SUMMARY_TITLE = "Summary of the earlier conversation (generated; the messages after it follow verbatim):"


def summary_message_text(summary: str) -> str:
    """The text of the single SYSTEM message that carries a summary into a model request."""
    return f"{SUMMARY_TITLE}\n\n{summary}"


@dataclass(frozen=True)
class BatchSummary:
    """The cumulative summary after one successful batch."""

    text: str
    model: str
    input_tokens: int
    output_tokens: int
    # Every fact this summary was checked against (carried forward to the next batch).
    facts: tuple[Fact, ...]
    facts_found: int
    facts_kept: int


def prompt_messages(previous_summary: str, messages: Sequence[LoadedMessage], max_chars: int) -> list[ChatMessage]:
    """The summarization request: instructions, the summary so far, the messages in their own roles
    (tool results as user-side text, since the call ids are not sent), and the closing request.

    Each message is clipped to `max_chars` and ends with its real id as `(#id)`, so a reader of the
    prompt (or of a model's answer) can tell exactly which messages it covered.
    """
    prompt = [ChatMessage("system", INSTRUCTIONS)]
    if previous_summary:
        prompt.append(ChatMessage("assistant", previous_summary))
    for loaded in messages:
        text = message_text(loaded.message)
        if len(text) > max_chars:
            text = f"{text[:max_chars]}\n[… {len(text) - max_chars} characters omitted]"
        if loaded.role == "tool":
            prompt.append(ChatMessage("user", f"Tool result:\n{text}\n(#{loaded.message_id})"))
        else:
            role = "assistant" if loaded.role == "assistant" else "user"
            prompt.append(ChatMessage(role, f"{text}\n(#{loaded.message_id})"))
    prompt.append(ChatMessage("system", CLOSING))
    return prompt


def _usage(completion: Completion, prompt: Sequence[ChatMessage]) -> tuple[int, int]:
    # Reported usage when the provider gives it; otherwise the same estimate shown everywhere else.
    prompt_tokens = completion.usage.prompt_tokens
    output_tokens = completion.usage.completion_tokens
    if prompt_tokens is None:
        prompt_tokens = sum(estimate_tokens(message.content) for message in prompt)
    if output_tokens is None:
        output_tokens = estimate_tokens(completion.text)
    return prompt_tokens, output_tokens


async def summarize_batch(
    provider: ModelProvider,
    previous_summary: str,
    units: Sequence[Unit],
    *,
    carried_facts: Sequence[Fact],
    max_output_tokens: int,
    max_message_chars: int,
) -> BatchSummary:
    """Fold `units` into `previous_summary`. Raises the provider's error when the batch fails.

    The summary is checked against the facts of these messages and `carried_facts` (what earlier
    batches and summaries had to keep): one corrective retry for the missing ones, then whatever is
    still missing is appended by the program. A failed retry keeps the first answer.
    """
    messages = [message for unit in units for message in unit.messages]
    prompt = prompt_messages(previous_summary, messages, max_message_chars)
    completion = await provider.complete(prompt, max_output_tokens=max_output_tokens)
    input_tokens, output_tokens = _usage(completion, prompt)
    text = completion.text.strip()
    if not text:
        raise ProviderBadResponse("the provider returned an empty summary")
    facts = merge_facts(carried_facts, extract_facts(messages))
    missing = missing_facts(facts, text)
    if missing:
        correction = "\n".join(fact.render() for fact in missing)
        retry_prompt = [*prompt, ChatMessage("assistant", text), ChatMessage("system", f"{CORRECTION}\n{correction}")]
        try:
            retried = await provider.complete(retry_prompt, max_output_tokens=max_output_tokens)
        except ProviderError as error:
            # The first answer is still a summary: keep it and let the program append what it lost.
            logger.warning("corrective summary retry failed", extra={"reason": error.reason})
        else:
            more_input, more_output = _usage(retried, retry_prompt)
            input_tokens += more_input
            output_tokens += more_output
            retried_text = retried.text.strip()
            retried_missing = missing_facts(facts, retried_text) if retried_text else missing
            if retried_text and len(retried_missing) < len(missing):
                text, missing = retried_text, retried_missing
    final = with_preserved_facts(text, missing)
    current = [unit for unit in units if unit.holds_current_request]
    if current:
        # Mid-loop: the running turn's request goes in verbatim, never paraphrased by the model.
        request = current[0].messages[0]
        label = f"User request #{request.message_id} (in progress when this summary was written; verbatim):"
        final = f"{final}\n\n{label}\n{message_text(request.message)}"
    return BatchSummary(
        final, completion.model, input_tokens, output_tokens, tuple(facts), len(facts), len(facts) - len(missing)
    )
