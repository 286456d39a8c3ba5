"""HandoffRead exactly as BuildContext offers it: the definition handed to the model, the call made through
handoff-read for the turn's run, and the answer shaped into a bounded tool result.

BuildContext returns the HandoffRead definition only for a merged session whose binding verifies (and
only when the request's allow/deny lists permit it); the agent offers what it returns, nothing more, and
runs a HandoffRead call only in a round that offered it. Handoff-read resolves the session from the run
id the RUN claim was acquired with, never from a session id the model could choose. A refusal (an
unknown ref, a damaged package, reading not wired in yet, handoff-read unreachable) is a tool error
the model reads, not a failed turn.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum.handoff_read.v1 import handoff_read_service_pb2 as hapi
from continuum_agent.clients import Upstreams
from continuum_agent.errors import AgentError
from continuum_runtime.wire_names import HANDOFF_READ_TOOL

logger = logging.getLogger("continuum.agent")

# A refusal's message as the model sees it, at most (handoff-read's messages are short; this bounds them).
MAX_ERROR_CHARS = 1000


def model_definitions(offered: Sequence[capi.ToolDefinition]) -> list[dict[str, Any]]:
    """The OpenAI-style definitions of the tools BuildContext offered that this agent can run.

    Only HandoffRead is runnable here; a definition of another name (a later contract's) or with a
    schema that is not a JSON object is left out rather than offered to a model that could not use it.
    """
    definitions = []
    for definition in offered:
        if definition.name != HANDOFF_READ_TOOL:
            logger.warning("offered tool not runnable here", extra={"tool": definition.name[:64]})
            continue
        try:
            schema = json.loads(definition.parameters_json_schema or "{}")
        except ValueError:
            schema = None
        if not isinstance(schema, dict):
            logger.warning("offered tool has no usable schema", extra={"tool": definition.name})
            continue
        definitions.append(
            {
                "type": "function",
                "function": {"name": definition.name, "description": definition.description, "parameters": schema},
            }
        )
    return definitions


async def execute(upstreams: Upstreams, user: str, run_id: str, arguments: str, max_bytes: int) -> str:
    """The JSON tool result of one HandoffRead call of run `run_id`, at most `max_bytes` of UTF-8."""
    try:
        response = await upstreams.execute_handoff_read(user, run_id, arguments or "{}")
    except AgentError as error:
        logger.info("handoff read refused", extra={"run_id": run_id, "reason": error.reason})
        return json.dumps({"error": error.message[:MAX_ERROR_CHARS], "reason": error.reason}, ensure_ascii=False)
    return tool_result(response, max_bytes)


def tool_result(response: hapi.ExecuteHandoffReadResponse, max_bytes: int) -> str:
    """`response` as the model reads it, within `max_bytes`.

    Handoff-read keeps an answer's text within 16 KiB, but a smaller configured limit (or escaping) can
    still leave it too large: entries are then kept whole while they fit, the rest by ref and kind
    only while those fit, and the result says `"truncated": true` and how many it left out, so the model
    can read them by ref. `complete` is false whenever anything was left out.
    """
    result: dict[str, Any] = {
        "entries": [],
        "complete": response.complete,
        "nextCursor": response.next_cursor,
        "warning": response.warning,
        "packageVersion": response.package_version,
    }
    # The envelope as a cut result would be (its flags, the largest count): the worst case up front.
    used = _size({**result, "complete": False, "truncated": True, "omittedEntries": len(response.entries)})
    kept: list[dict[str, str]] = result["entries"]
    cut = False
    omitted = 0
    for entry in response.entries:
        item = {"ref": entry.ref, "kind": entry.kind, "text": entry.text}
        # Each entry costs its JSON and the ", " before it.
        if cut or used + _size(item) + 2 > max_bytes:
            cut = True
            item = {"ref": entry.ref, "kind": entry.kind}
            if used + _size(item) + 2 > max_bytes:
                omitted += 1
                continue
        kept.append(item)
        used += _size(item) + 2
    if cut:
        result.update({"complete": False, "truncated": True, "omittedEntries": omitted})
    return json.dumps(result, ensure_ascii=False)


def _size(value: dict[str, Any]) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())
