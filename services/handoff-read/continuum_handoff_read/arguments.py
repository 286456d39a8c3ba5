"""The HandoffRead tool's arguments: the model's JSON, checked field by field into one frozen value.

``action`` is list | search | read | asset; ``search`` needs ``query``, ``read`` and ``asset`` need
``ref``. ``source_id`` and ``section`` only narrow what this package holds. A field that does not
apply to the action, an unknown field, a wrong type or a value over its byte limit is a BadRequest
naming the field: nothing is guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from continuum_handoff_read.errors import BadRequest

# ExecuteHandoffReadRequest.arguments_json: at most 8 KiB.
MAX_ARGUMENTS_BYTES = 8 * 1024
MAX_REF_BYTES = 512
# The tool's schema allows 1024 characters: up to 4 bytes each.
MAX_QUERY_BYTES = 4096
MAX_SOURCE_ID_BYTES = 256
MAX_CURSOR_BYTES = 1024
MAX_LIMIT = 200
ACTIONS = ("list", "search", "read", "asset")
# The sections of merge's item schema v2 (the handoff's details files carry these names).
SECTIONS = (
    "goals_constraints",
    "state_conclusions",
    "changes",
    "artifacts",
    "validation_failures",
    "conflicts_todos",
)
_FIELDS = ("action", "ref", "query", "source_id", "section", "cursor", "limit")
# Which optional fields each action takes.
_ALLOWED = {
    "list": {"source_id", "section", "cursor", "limit"},
    "search": {"query", "source_id", "section", "cursor", "limit"},
    "read": {"ref", "cursor"},
    "asset": {"ref", "cursor"},
}
_SOURCE_ID = re.compile(r"[A-Za-z0-9_.:-]+")


@dataclass(frozen=True)
class Arguments:
    """One call's validated arguments; absent optional text is empty, an absent limit is 0 (default)."""

    action: str
    ref: str = ""
    query: str = ""
    source_id: str = ""
    section: str = ""
    cursor: str = ""
    limit: int = 0

    def bound(self, package_version: str) -> dict[str, str | int]:
        """What a cursor of this call is bound to: the package version and every parameter but the
        cursor itself."""
        return {
            "package": package_version,
            "action": self.action,
            "ref": self.ref,
            "query": self.query,
            "source_id": self.source_id,
            "section": self.section,
            "limit": self.limit,
        }


def parse_arguments(arguments_json: str) -> Arguments:
    """`arguments_json` as Arguments; BadRequest naming the first field that is wrong."""
    if len(arguments_json.encode()) > MAX_ARGUMENTS_BYTES:
        raise BadRequest("arguments_json", f"is longer than {MAX_ARGUMENTS_BYTES} bytes")
    try:
        value = orjson.loads(arguments_json)
    except orjson.JSONDecodeError:
        raise BadRequest("arguments_json", "is not JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("arguments_json", "is not a JSON object")
    for name in value:
        if name not in _FIELDS:
            raise BadRequest(str(name)[:64], f"is not an argument of HandoffRead (known: {', '.join(_FIELDS)})")
    action = value.get("action")
    if action not in ACTIONS:
        raise BadRequest("action", f"must be one of {', '.join(ACTIONS)}")
    present = {name for name, given in value.items() if name != "action" and given not in (None, "")}
    misplaced = sorted(present - _ALLOWED[action])
    if misplaced:
        raise BadRequest(misplaced[0], f"does not apply to action {action}")
    texts = {
        name: _text(value, name, limit)
        for name, limit in (
            ("ref", MAX_REF_BYTES),
            ("query", MAX_QUERY_BYTES),
            ("source_id", MAX_SOURCE_ID_BYTES),
            ("section", 64),
            ("cursor", MAX_CURSOR_BYTES),
        )
    }
    if texts["source_id"] and not _SOURCE_ID.fullmatch(texts["source_id"]):
        raise BadRequest("source_id", "is not a session id")
    if texts["section"] and texts["section"] not in SECTIONS:
        raise BadRequest("section", f"must be one of {', '.join(SECTIONS)}")
    if action == "search" and not texts["query"]:
        raise BadRequest("query", "is required by action search")
    if action in ("read", "asset") and not texts["ref"]:
        raise BadRequest("ref", f"is required by action {action}")
    return Arguments(action=action, limit=_limit(value.get("limit")), **texts)


def _text(value: dict[str, Any], name: str, limit: int) -> str:
    given = value.get(name)
    if given is None:
        return ""
    if not isinstance(given, str):
        raise BadRequest(name, "must be a string")
    if len(given.encode()) > limit:
        raise BadRequest(name, f"is longer than {limit} bytes")
    if any(ord(character) < 0x20 for character in given) and name != "query":
        raise BadRequest(name, "holds control characters")
    return given


def _limit(given: Any) -> int:
    if given is None:
        return 0
    if isinstance(given, bool) or not isinstance(given, int):
        raise BadRequest("limit", "must be an integer")
    if not 1 <= given <= MAX_LIMIT:
        raise BadRequest("limit", f"must be between 1 and {MAX_LIMIT}")
    return given
