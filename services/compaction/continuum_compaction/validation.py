"""Input checks of every compaction RPC: bad input is refused before anything is read or written."""

from __future__ import annotations

import re

from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum_compaction.errors import BadRequest

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
SECTION_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MEMORY_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_SECTIONS = 32
MAX_LABEL_CHARS = 80
MAX_SYSTEM_PROMPT_BYTES = 1024 * 1024
MAX_MEMORY_ENTRIES = 64
MAX_MEMORY_BYTES = 16 * 1024
MIN_WINDOW_TOKENS = 1024
MAX_WINDOW_TOKENS = 10_000_000
MAX_EVENTS_PAGE = 100
MAX_TOOL_NAMES = 64
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def session_id(value: str) -> str:
    """A session id as transcript spells them."""
    if not SESSION_ID.match(value):
        raise BadRequest("session_id", "must be 1-64 characters of letters, digits, '-' or '_'")
    return value


def window(value: int, field: str = "context_window_tokens") -> int:
    """0 (use the configured window) or a plausible model window."""
    if value != 0 and not MIN_WINDOW_TOKENS <= value <= MAX_WINDOW_TOKENS:
        raise BadRequest(field, f"must be 0 or between {MIN_WINDOW_TOKENS} and {MAX_WINDOW_TOKENS}")
    return value


def build_context(request: api.BuildContextRequest) -> None:
    """Checks of BuildContext; raises BadRequest naming the first bad field."""
    session_id(request.session_id)
    if not RUN_ID.match(request.run_id):
        raise BadRequest("run_id", "must be 1-128 characters of letters, digits, '_', '.', ':' or '-'")
    window(request.context_window_tokens)
    if request.trigger_point == api.TRIGGER_POINT_UNSPECIFIED or request.trigger_point not in api.TriggerPoint.values():
        raise BadRequest("trigger_point", "must be REQUEST_START or MID_LOOP")
    if len(request.system_prompt_sections) > MAX_SECTIONS:
        raise BadRequest("system_prompt_sections", f"must be at most {MAX_SECTIONS}")
    keys: set[str] = set()
    total = 0
    for index, section in enumerate(request.system_prompt_sections):
        field = f"system_prompt_sections[{index}]"
        if not SECTION_KEY.match(section.key):
            raise BadRequest(f"{field}.key", "must be 1-64 characters of letters, digits, '_', '.' or '-'")
        if section.key in keys:
            raise BadRequest(f"{field}.key", "must be unique")
        keys.add(section.key)
        if not section.label or len(section.label) > MAX_LABEL_CHARS:
            raise BadRequest(f"{field}.label", f"must be 1-{MAX_LABEL_CHARS} characters")
        total += len(section.text.encode())
    if total > MAX_SYSTEM_PROMPT_BYTES:
        raise BadRequest("system_prompt_sections", f"must total at most {MAX_SYSTEM_PROMPT_BYTES} bytes")
    for field in ("allowed_tools", "denied_tools"):
        names = getattr(request, field)
        if len(names) > MAX_TOOL_NAMES:
            raise BadRequest(field, f"must be at most {MAX_TOOL_NAMES}")
        for index, name in enumerate(names):
            if not TOOL_NAME.match(name):
                raise BadRequest(f"{field}[{index}]", "must be 1-64 letters, digits, '_', '.', ':' or '-'")
    if len(request.memory_entries) > MAX_MEMORY_ENTRIES:
        raise BadRequest("memory_entries", f"must be at most {MAX_MEMORY_ENTRIES}")
    seen: set[str] = set()
    for index, entry in enumerate(request.memory_entries):
        field = f"memory_entries[{index}]"
        if not MEMORY_ID.match(entry.memory_id) or entry.memory_id in seen:
            raise BadRequest(f"{field}.memory_id", "must be a unique id of 1-64 letters, digits, '_', '.', ':' or '-'")
        seen.add(entry.memory_id)
        if not entry.text.strip() or len(entry.text.encode()) > MAX_MEMORY_BYTES:
            raise BadRequest(f"{field}.text", f"must be non-blank and at most {MAX_MEMORY_BYTES} bytes")


def events_page_size(value: int) -> int:
    """AIP-158: negative is an error, zero the default, above the maximum coerced down."""
    if value < 0:
        raise BadRequest("page_size", "must not be negative")
    return 20 if value == 0 else min(value, MAX_EVENTS_PAGE)
