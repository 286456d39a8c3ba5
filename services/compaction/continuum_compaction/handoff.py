"""A merged session's part of BuildContext (seed 000 §7.1): its reference entry and its HandoffRead tool.

Only a session whose metadata carries `sessionMergeOperationId` reaches handoff-read; every other
session's request is built exactly as before, with no call and nothing added. The entry is asked for
on every request (so it is rebuilt from the binding after a compaction or a restart), placed before
the history as one USER message that is never stored, and counted once in the budget: the automatic
trigger compares summary + messages + entry with the history budget, and the manifest lists it as
its own section.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from google.protobuf import struct_pb2

from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.handoff_read.v1 import error_reason_pb2 as handoff_reasons
from continuum.handoff_read.v1 import handoff_read_service_pb2 as hapi
from continuum.handoff_read.v1 import handoff_read_service_pb2_grpc as hapi_grpc
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_compaction.errors import CapacityExceeded
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details
from continuum_runtime.provider import estimate_message_tokens
from continuum_runtime.wire_names import HANDOFF_READ_TOOL

logger = logging.getLogger("continuum.compaction")

# Handoff-read's answer when not even its minimal entry fits the budget asked for.
ENTRY_DOES_NOT_FIT = handoff_reasons.ErrorReason.Name(handoff_reasons.HANDOFF_ENTRY_DOES_NOT_FIT)
ENTRY_KEY = "handoff_reference"
ENTRY_LABEL = "Merged-session reference"
# The entry travels as background, never as a system instruction.
ENTRY_ROLE = "user"
# Said in the entry when the request's tool lists leave the tool out (seed 000 §7.2).
TOOL_UNAVAILABLE_NOTE = (
    f"The {HANDOFF_READ_TOOL} tool is not available in this request: the originals cannot be read now."
)


@dataclass(frozen=True)
class HandoffEntry:
    """A reference entry as a request carries it, and the tool to offer with it (None when not permitted)."""

    text: str
    tool: api.ToolDefinition | None

    @property
    def tokens(self) -> int:
        """The entry's estimated cost in the request (the estimate the manifest uses)."""
        return estimate_message_tokens(ENTRY_ROLE, self.text)

    def message(self, session_id: str) -> tpb.Message:
        """The entry as the USER message (id 0, never stored) placed before the history."""
        metadata = struct_pb2.Struct()
        metadata.update({"handoffReference": True})
        return tpb.Message(
            message_id=0,
            session_id=session_id,
            role=tpb.MESSAGE_ROLE_USER,
            content=[tpb.ContentPart(text=self.text)],
            status=tpb.MESSAGE_STATUS_COMPLETE,
            metadata=metadata,
        )


def tool_permitted(request: api.BuildContextRequest) -> bool:
    """Whether the request's allow/deny lists let the HandoffRead tool be offered (deny wins)."""
    if HANDOFF_READ_TOOL in request.denied_tools:
        return False
    return not request.allowed_tools or HANDOFF_READ_TOOL in request.allowed_tools


def entry_budget(window_tokens: int, trigger_ratio: float, share: float, ceiling: int) -> int:
    """min(ceiling, share of the history budget), the history budget being window x trigger ratio."""
    return max(1, min(ceiling, int(window_tokens * trigger_ratio * share)))


class HandoffContext:
    """Asks handoff-read for merged sessions' entries over one channel owned by the process."""

    def __init__(self, address: str, token: str, timeout_seconds: float, max_message_bytes: int) -> None:
        self._channel = open_channel(address, max_message_bytes)
        self._stub = hapi_grpc.HandoffReadServiceStub(self._channel)
        self._token = token
        self._timeout = timeout_seconds

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def entry(
        self, user: str, session_id: str, operation_id: str, request: api.BuildContextRequest, max_tokens: int
    ) -> HandoffEntry | None:
        """The entry of a merged session within `max_tokens`, or None when its binding does not verify
        (handoff-read's reason is logged; the request is then built as an ordinary one).
        CapacityExceeded when even the minimal entry does not fit `max_tokens`."""
        permitted = tool_permitted(request)
        note = "" if permitted else "\n" + TOOL_UNAVAILABLE_NOTE
        # The note is part of the entry: its share of the budget comes off what handoff-read may use.
        allowed = max_tokens - (estimate_message_tokens(ENTRY_ROLE, note) - estimate_message_tokens(ENTRY_ROLE, ""))
        if allowed < 1:
            raise CapacityExceeded(
                "the merged session's reference entry does not fit the model's window with the current request"
            )
        call = hapi.GetHandoffReferenceRequest(
            session_id=session_id, merge_operation_id=operation_id, max_tokens=allowed
        )
        try:
            answer: hapi.GetHandoffReferenceResponse = await self._stub.GetHandoffReference(
                call, metadata=call_metadata(self._token, user), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            details = error_details(error)
            if details.reason == ENTRY_DOES_NOT_FIT:
                raise CapacityExceeded(
                    "the merged session's reference entry does not fit the model's window with the current request"
                ) from error
            logger.warning(
                "merged session built without its reference entry",
                extra={
                    "session_id": session_id,
                    "operation_id": operation_id,
                    "reason": details.reason or details.code.name,
                },
            )
            return None
        tool = None
        if permitted:
            tool = api.ToolDefinition(
                name=answer.tool.name,
                description=answer.tool.description,
                parameters_json_schema=answer.tool.parameters_json_schema,
            )
        return HandoffEntry(answer.reference_text + note, tool)
