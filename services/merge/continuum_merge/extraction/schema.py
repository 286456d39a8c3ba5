"""Item schema v2: six sections, nine statuses, and the program's check of what a model answered.

The model writes only section, status, content and evidence aliases (i1, i2, … or a1, a2, …) drawn
from its request; the program checks all of it, then maps aliases to part refs and assigns item ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

__all__ = [
    "OFFLINE_HINTS",
    "SCHEMA_VERSION",
    "SECTIONS",
    "STATUSES",
    "AnswerItem",
    "AnswerProblem",
    "parse_answer",
]

SCHEMA_VERSION = 2
SECTIONS = (
    "goals_constraints",
    "state_conclusions",
    "changes",
    "artifacts",
    "validation_failures",
    "conflicts_todos",
)
STATUSES = (
    "recorded",
    "completed",
    "in_progress",
    "pending",
    "failed",
    "unverified",
    "conflict",
    "inferred",
    "unknown",
)
# Where the offline provider files each kind of line it recognises (see continuum_runtime's structured
# requests). A command seen is not a test passed, so it is "unverified"; an error line is "failed".
OFFLINE_HINTS = {
    "error": ("validation_failures", "failed"),
    "command": ("validation_failures", "unverified"),
    "file": ("changes", "recorded"),
    "note": ("conflicts_todos", "pending"),
    "request": ("goals_constraints", "recorded"),
    "other": ("state_conclusions", "recorded"),
}
_ITEM_KEYS = frozenset({"section", "status", "content", "evidence"})

# What an input alias looks like (the program writes them: i1, i2, ...).
_ALIAS_SHAPE = re.compile(r"i[0-9]{1,6}")


class AnswerProblem(ValueError):
    """What is wrong with an answer, in words safe to send back to the model and to log (no content)."""


@dataclass(frozen=True)
class AnswerItem:
    """One checked item as the model wrote it (evidence still as aliases, deduplicated in order)."""

    section: str
    status: str
    content: str
    evidence: tuple[str, ...]


def parse_answer(text: str, aliases: Collection[str]) -> list[AnswerItem]:
    """The items of a complete schema-v2 answer whose evidence cites only `aliases`; AnswerProblem if not.

    One surrounding Markdown code fence is tolerated (models add it unasked); nothing else is repaired.
    """
    try:
        payload = json.loads(_without_fence(text))
    except ValueError:
        raise AnswerProblem("the answer is not one complete JSON object") from None
    if not isinstance(payload, dict) or payload.get("schemaVersion") != SCHEMA_VERSION:
        raise AnswerProblem(f'the answer must be an object with "schemaVersion": {SCHEMA_VERSION}')
    items = payload.get("items")
    if not isinstance(items, list):
        raise AnswerProblem('the answer must have an "items" array')
    return [_item(index, value, aliases) for index, value in enumerate(items)]


def _item(index: int, value: Any, aliases: Collection[str]) -> AnswerItem:
    where = f"items[{index}]"
    if not isinstance(value, dict) or set(value) != _ITEM_KEYS:
        raise AnswerProblem(f"{where} must have exactly the keys section, status, content and evidence")
    section, status, content, evidence = (value[key] for key in ("section", "status", "content", "evidence"))
    if section not in SECTIONS:
        raise AnswerProblem(f"{where}.section must be one of {', '.join(SECTIONS)}")
    if status not in STATUSES:
        raise AnswerProblem(f"{where}.status must be one of {', '.join(STATUSES)}")
    if not isinstance(content, str) or not content.strip():
        raise AnswerProblem(f"{where}.content must be non-empty text")
    if not isinstance(evidence, list) or not evidence or not all(isinstance(alias, str) for alias in evidence):
        raise AnswerProblem(f"{where}.evidence must be a non-empty array of input aliases")
    unknown = [alias for alias in evidence if alias not in aliases]
    if unknown:
        # The words go back to the model and into logs: only strings of the aliases' own shape (i1, i2, ...)
        # are quoted, never other text the model wrote there.
        shown = ", ".join(alias for alias in unknown[:3] if _ALIAS_SHAPE.fullmatch(alias))
        raise AnswerProblem(
            f"{where}.evidence cites {len(unknown)} alias(es) this request did not give"
            + (f": {shown}" if shown else "")
        )
    return AnswerItem(section, status, content.strip(), tuple(dict.fromkeys(evidence)))


def _without_fence(text: str) -> str:
    stripped = text.strip()
    if stripped.startswith("```") and stripped.endswith("```") and "\n" in stripped:
        return stripped[stripped.index("\n") + 1 : -3]
    return stripped
