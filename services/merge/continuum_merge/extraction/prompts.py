"""The two requests merge sends a model: extraction of history parts, and condensing of items.

Both are structured-item requests (`continuum_runtime.provider.structured`): the first system line is
the machine-readable header, the rest instructs a real model, and the user message is JSON data only.
The model is asked for content, status and evidence aliases; never offsets, paths, hashes or coverage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from continuum_merge.extraction.schema import OFFLINE_HINTS, SCHEMA_VERSION, SECTIONS, STATUSES
from continuum_runtime.provider import ChatMessage, estimate_message_tokens, structured_header

__all__ = ["CONDENSE_INSTRUCTIONS", "EXTRACT_INSTRUCTIONS", "condense_request", "extract_request", "instruction_tokens"]

_ANSWER_FORMAT = (
    f'Answer with one JSON object only: {{"schemaVersion": {SCHEMA_VERSION}, "items": [{{"section": …, '
    '"status": …, "content": …, "evidence": [alias, …]}]}. '
    f"Sections: {', '.join(SECTIONS)}. Statuses: {', '.join(STATUSES)}. "
    "Every item needs non-empty content and at least one evidence alias from this request's inputs; "
    "cite no other alias. An empty items array is a valid answer when the inputs record nothing of use."
)

EXTRACT_INSTRUCTIONS = (
    "You turn pieces of earlier coding-assistant sessions into a handoff, so a new session can continue "
    "the development without reading them. Each input has an alias, the role that wrote it and its source "
    "session; inputs marked context were handled by the previous request and are shown for continuity. "
    "Record, each in its section: goals_constraints: each source's goals, the user's constraints, approaches "
    "accepted or dropped and why. state_conclusions: each source's scope, what is done and not done, key "
    "decisions with their grounds. changes: files changed and why, interfaces, request/response fields, data "
    "structures and callers' agreements. artifacts: plans, design notes, attachments and outputs to reuse. "
    "validation_failures: validation commands run, their scope and results with times or versions; "
    "unverified claims, failures, environment limits. conflicts_todos: open work of each source, "
    "inconsistencies between sources with both sides' evidence, integration and retest items. "
    "Nothing is invented; what is unknown stays unknown. A tool result is not a claim and an action "
    "completed is not a test passed: say which one the evidence is. No side wins by being the primary "
    "source or the latest. Write the content in the language of the inputs. " + _ANSWER_FORMAT
)

CONDENSE_INSTRUCTIONS = (
    "You condense handoff items of several coding-assistant sessions into fewer, shorter items for a "
    "bounded brief. Each input is an item with an alias. Keep each source's goals and progress, the key "
    "constraints, interface agreements and main open items; keep conflicts with both sides; merge items "
    "that say the same; keep statuses honest (never turn failed, pending, unverified or conflict into "
    "completed). Cite as evidence the aliases of the items each new item stands for. Write fewer items "
    "than you were given, each shorter. " + _ANSWER_FORMAT
)


def extract_request(inputs: Sequence[Mapping[str, Any]], *, rejected: str | None = None) -> list[ChatMessage]:
    """The extraction request for `inputs` ({alias, role, source, text[, context]}).

    `rejected` is the problem found in the previous answer to the same inputs (the one repair request).
    """
    return _request("extract", EXTRACT_INSTRUCTIONS, inputs, rejected)


def condense_request(inputs: Sequence[Mapping[str, Any]], *, rejected: str | None = None) -> list[ChatMessage]:
    """The condensing request for `inputs` ({alias, section, status, content})."""
    return _request("condense", CONDENSE_INSTRUCTIONS, inputs, rejected)


def _request(
    mode: Literal["extract", "condense"],
    instructions: str,
    inputs: Sequence[Mapping[str, Any]],
    rejected: str | None,
) -> list[ChatMessage]:
    header = structured_header(mode, sections=SECTIONS, statuses=STATUSES, hints=OFFLINE_HINTS)
    payload: dict[str, Any] = {"inputs": list(inputs)}
    if rejected is not None:
        payload["previousAnswerRejected"] = rejected + " Answer again, following the format exactly."
    return [
        ChatMessage("system", f"{header}\n{instructions}"),
        ChatMessage("user", json.dumps(payload, ensure_ascii=False)),
    ]


def instruction_tokens(instructions: str) -> int:
    """Estimated tokens of the system message a request with `instructions` carries (header included)."""
    header = structured_header("extract", sections=SECTIONS, statuses=STATUSES, hints=OFFLINE_HINTS)
    return estimate_message_tokens("system", f"{header}\n{instructions}")
