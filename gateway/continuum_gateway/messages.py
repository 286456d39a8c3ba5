"""Message routes, each a thin translation onto one TranscriptService RPC.

    POST /v1/sessions/{session_id}/messages                    AppendMessages
         body {"messages": [NewMessage, ...]}
    GET  /v1/sessions/{session_id}/messages                    ListMessagesAfter
         ?after=<message id>&pageSize=&pageToken=
    GET  /v1/sessions/{session_id}/messages:page               ListMessagePage
         ?anchor=<message id>&direction=older|newer&pageSize=&streamGeneration=&snapshotSequence=
    GET  /v1/sessions/{session_id}/messages/{message_id}       StreamMessage (see `message_body`)
    POST /v1/sessions/{session_id}/messages/{message_id}:edit  EditUserMessage
         body {"content": [ContentPart, ...], "expectedHistoryGeneration": "3"}

`:page` and `:edit` are AIP-136 custom methods; Starlette matches the colon literally. A GET of
``.../messages/7:edit`` reaches GetMessage with the id "7:edit" and is refused as an invalid id.
Message ids are int64, so responses carry them as JSON strings; requests accept both forms.

`:page` takes an optional pin, the ``history`` cursor of a Follow snapshot (``streamGeneration``,
``snapshotSequence``): the page then shows only messages committed at or before ``snapshotSequence``,
and if the session has left that stream generation the answer is still 200, with ``"status":
"PIN_STATUS_STALE"`` and no messages (the browser re-follows for a fresh baseline). Otherwise
``status`` is ``"PIN_STATUS_OK"``; ``streamGeneration`` is always the session's current one. The status is the proto
enum name here, as everywhere in the `/v1` routes (only the seed-defined outline lowercases it).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from continuum.transcript.v1 import transcript_service_pb2
from continuum_gateway import message_body
from continuum_gateway.protojson import json_response
from continuum_gateway.routing import Operation, bind, resource
from continuum_gateway.upstream import call_transcript

_DIRECTIONS = {"older": "PAGE_DIRECTION_OLDER", "newer": "PAGE_DIRECTION_NEWER"}


async def append_messages(request: Request) -> Response:
    """Append a batch of messages atomically; answers the stored messages with their ids."""
    message = await bind(request, transcript_service_pb2.AppendMessagesRequest())
    return json_response(await call_transcript(request, lambda t: t.AppendMessages, message))


async def list_messages_after(request: Request) -> Response:
    """Live messages with ids above `after` (0 or absent: from the start), paged."""
    message = await bind(request, transcript_service_pb2.ListMessagesAfterRequest())
    return json_response(await call_transcript(request, lambda t: t.ListMessagesAfter, message))


async def list_message_page(request: Request) -> Response:
    """A page of live messages older or newer than `anchor` (absent: the latest page), optionally pinned."""
    message = await bind(request, transcript_service_pb2.ListMessagePageRequest())
    return json_response(await call_transcript(request, lambda t: t.ListMessagePage, message))


async def edit_user_message(request: Request) -> Response:
    """Replace a USER message's content; every later message of the session is deleted."""
    message = await bind(request, transcript_service_pb2.EditUserMessageRequest())
    return json_response(await call_transcript(request, lambda t: t.EditUserMessage, message))


_SESSION_ID = {"session_id": "sessionId"}
_MESSAGE_ID = {**_SESSION_ID, "message_id": "messageId"}

ROUTES = [
    resource(
        "/v1/sessions/{session_id}/messages",
        "messages",
        {
            "POST": Operation(
                append_messages,
                request=transcript_service_pb2.AppendMessagesRequest,
                body="*",
                path=_SESSION_ID,
                response=transcript_service_pb2.AppendMessagesResponse,
            ),
            "GET": Operation(
                list_messages_after,
                request=transcript_service_pb2.ListMessagesAfterRequest,
                path=_SESSION_ID,
                query={"after": "afterMessageId", "pageSize": "pageSize", "pageToken": "pageToken"},
                response=transcript_service_pb2.ListMessagesAfterResponse,
            ),
        },
    ),
    resource(
        "/v1/sessions/{session_id}/messages:page",
        "message_page",
        {
            "GET": Operation(
                list_message_page,
                request=transcript_service_pb2.ListMessagePageRequest,
                path=_SESSION_ID,
                query={
                    "anchor": "anchorMessageId",
                    "direction": "direction",
                    "pageSize": "pageSize",
                    "streamGeneration": "streamGeneration",
                    "snapshotSequence": "snapshotSequence",
                },
                query_values={"direction": _DIRECTIONS},
                response=transcript_service_pb2.ListMessagePageResponse,
            )
        },
    ),
    resource(
        "/v1/sessions/{session_id}/messages/{message_id}",
        "message",
        {
            "GET": Operation(
                message_body.get_message,
                request=transcript_service_pb2.GetMessageRequest,
                path=_MESSAGE_ID,
                response=transcript_service_pb2.GetMessageResponse,
            )
        },
    ),
    resource(
        "/v1/sessions/{session_id}/messages/{message_id}:edit",
        "message_edit",
        {
            "POST": Operation(
                edit_user_message,
                request=transcript_service_pb2.EditUserMessageRequest,
                body="*",
                path=_MESSAGE_ID,
                response=transcript_service_pb2.EditUserMessageResponse,
            )
        },
    ),
]
