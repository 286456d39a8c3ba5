"""Tool results the tool itself truncated: flagged once, when the TOOL message is stored.

Tools that cut their output short say so with a top-level `"truncated": true` in their JSON
result. Transcript records that fact as `{"resultTruncated": true}` in the message metadata, so
history reads and Follow frames can show it without parsing results again on every read.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

RESULT_TRUNCATED = "resultTruncated"
_JSON_WHITESPACE = " \t\n\r"


def reports_truncation(content: list[dict[str, Any]]) -> bool:
    """Whether the content's text parses as a JSON object whose top-level `truncated` is true."""
    text = "".join(part["text"] for part in content if "text" in part)
    if not text.lstrip(_JSON_WHITESPACE).startswith("{"):
        return False
    # Results can be megabytes: parse only when the key can be there at all. Written plainly it
    # contains `"truncated"`; only a \u escape could spell it otherwise.
    if '"truncated"' not in text and "\\u" not in text:
        return False
    try:
        parsed = json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and parsed.get("truncated") is True


def _not_json(constant: str) -> NoReturn:
    # Python accepts NaN and Infinity; JSON does not.
    raise ValueError(constant)
