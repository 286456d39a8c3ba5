"""Session merge routes (``merge-v2``), each a thin translation onto one MergeService RPC.

    POST /v1/session-merges                              StartMerge
         body {"sourceSessionIds": [...], "primarySessionId": "...", "title": "...", "model": "...",
               "idempotencyKey": "..."}
         201 {"operation": MergeOperation, "created": true} with Location, or 200 with
         "created": false when the idempotency key named an operation started before
    GET  /v1/session-merges/{operation_id}               GetMerge        200 {"operation": ...}
    GET  /v1/session-merges:active                       GetActiveMerge  200 {"operation": ...}, or 204
         (no body) when the user has no unfinished merge
    POST /v1/session-merges/{operation_id}:resume        ResumeMerge     body {"expectedEpoch": "3", "model": "..."}
    POST /v1/session-merges/{operation_id}:cancel        CancelMerge     no body

Every call acts for the authenticated browser user; merge decides ownership, so another user's
operation is 403 and an unknown one 404. A conflict (409: MERGE_ACTIVE_EXISTS, MERGE_IDEMPOTENCY_CONFLICT,
and the state conflicts MERGE_STALE_OPERATION, MERGE_ALREADY_COMPLETED, MERGE_SOURCE_BUSY, MERGE_CANCEL_CLEANUP,
see `errors.REASON_HTTP_STATUS`) carries the operation as it stands after the refusal in the error's
``details``, so a client shows the latest state without another call (`errors.RELAYED_DETAILS`).
``:active``, ``:resume`` and ``:cancel`` are AIP-136 custom methods, matched literally; the custom
method routes come before ``/{operation_id}``, whose parameter would otherwise take ``x:resume``.

The app serves these routes only when the gateway has a merge address (`capabilities`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from continuum.merge.v1 import merge_service_pb2 as api
from continuum_gateway.protojson import json_response
from continuum_gateway.routing import Operation, bind, resource
from continuum_gateway.upstream import call_merge


async def start_merge(request: Request) -> Response:
    """Start merging 2 to 5 idle sessions into a new one; the idempotency key makes the call repeatable.

    Answers 201 with the new operation, or 200 with the one an earlier call with the same key and
    parameters started. The same key with other parameters is 409 MERGE_IDEMPOTENCY_CONFLICT, and a
    user with an unfinished merge gets 409 MERGE_ACTIVE_EXISTS; both carry that operation.
    """
    message = await bind(request, api.StartMergeRequest())
    response: api.StartMergeResponse = await call_merge(request, lambda m: m.StartMerge, message)
    location = request.url_for("session_merge", operation_id=response.operation.progress.operation_id).path
    return json_response(response, status_code=201 if response.created else 200, headers={"Location": location})


async def get_merge(request: Request) -> Response:
    """One merge operation of the user."""
    message = await bind(request, api.GetMergeRequest())
    return json_response(await call_merge(request, lambda m: m.GetMerge, message))


async def get_active_merge(request: Request) -> Response:
    """The user's unfinished merge operation; 204 without a body when there is none."""
    message = await bind(request, api.GetActiveMergeRequest())
    response: api.GetActiveMergeResponse = await call_merge(request, lambda m: m.GetActiveMerge, message)
    if not response.HasField("operation"):
        return Response(status_code=204)
    return json_response(response)


async def resume_merge(request: Request) -> Response:
    """Resume a paused merge at the run epoch the caller saw, optionally with another model.

    A resume of an operation that moved on (another resume won, it is no longer paused) is 409
    MERGE_STALE_OPERATION carrying the operation as it stands.
    """
    message = await bind(request, api.ResumeMergeRequest())
    return json_response(await call_merge(request, lambda m: m.ResumeMerge, message))


async def cancel_merge(request: Request) -> Response:
    """Cancel an unfinished merge; cancelling a cancelled one answers it again.

    A completed merge can no longer be cancelled: 409 MERGE_ALREADY_COMPLETED carrying it.
    """
    message = await bind(request, api.CancelMergeRequest())
    return json_response(await call_merge(request, lambda m: m.CancelMerge, message))


_OPERATION_ID = {"operation_id": "operationId"}
# What a merge route can answer besides success, by what it reads (the body, an operation, the sources).
_COMMON_ERRORS = {
    401: "No valid bearer token.",
    500: "An unexpected failure; nothing about it is disclosed.",
    503: "Merge (or transcript behind it) is unavailable; retry later.",
    504: "Merge did not answer in time.",
}
_BODY_ERRORS = {
    408: "The body stalled for longer than the gateway waits (REQUEST_TIMEOUT).",
    413: "The body is over the gateway's limit (REQUEST_TOO_LARGE).",
}
_OPERATION_ERRORS = {
    400: "Malformed request (INVALID_ARGUMENT, naming the field).",
    403: "The operation belongs to another user (MERGE_PERMISSION_DENIED).",
    404: "No such operation (MERGE_OPERATION_NOT_FOUND).",
    409: "The operation's state refuses the call; the error carries it as it stands (a resume: "
    "MERGE_STALE_OPERATION; a cancel: MERGE_ALREADY_COMPLETED).",
}
_START_ERRORS = {
    400: "Malformed request (INVALID_ARGUMENT, naming the field).",
    403: "A source session belongs to another user.",
    404: "No such source session.",
    409: "An unfinished merge exists (MERGE_ACTIVE_EXISTS), the idempotency key was used with other "
    "parameters (MERGE_IDEMPOTENCY_CONFLICT; the error carries that operation), a source is busy "
    "(MERGE_SOURCE_BUSY) or a cancelled merge is still stopping (MERGE_CANCEL_CLEANUP, carrying it).",
}


def _errors(*tables: dict[int, str]) -> dict[int, str]:
    return dict(sorted({status: text for table in tables for status, text in table.items()}.items()))


ROUTES = [
    resource(
        "/v1/session-merges",
        "session_merges",
        {
            "POST": Operation(
                start_merge,
                request=api.StartMergeRequest,
                body="*",
                response=api.StartMergeResponse,
                statuses={
                    201: "The merge was started.",
                    200: "The idempotency key named a merge started before with the same parameters; it is answered.",
                },
                response_headers={"Location": "The operation's path, `/v1/session-merges/{operation_id}`."},
                errors=_errors(_COMMON_ERRORS, _BODY_ERRORS, _START_ERRORS),
            )
        },
    ),
    resource(
        "/v1/session-merges:active",
        "session_merges_active",
        {
            "GET": Operation(
                get_active_merge,
                request=api.GetActiveMergeRequest,
                response=api.GetActiveMergeResponse,
                statuses={200: "The user's unfinished merge.", 204: "The user has no unfinished merge."},
                errors=_errors(_COMMON_ERRORS),
            )
        },
    ),
    resource(
        "/v1/session-merges/{operation_id}:resume",
        "session_merge_resume",
        {
            "POST": Operation(
                resume_merge,
                request=api.ResumeMergeRequest,
                body="*",
                path=_OPERATION_ID,
                response=api.ResumeMergeResponse,
                errors=_errors(_COMMON_ERRORS, _BODY_ERRORS, _OPERATION_ERRORS),
            )
        },
    ),
    resource(
        "/v1/session-merges/{operation_id}:cancel",
        "session_merge_cancel",
        {
            "POST": Operation(
                cancel_merge,
                request=api.CancelMergeRequest,
                path=_OPERATION_ID,
                response=api.CancelMergeResponse,
                errors=_errors(_COMMON_ERRORS, _OPERATION_ERRORS),
            )
        },
    ),
    resource(
        "/v1/session-merges/{operation_id}",
        "session_merge",
        {
            "GET": Operation(
                get_merge,
                request=api.GetMergeRequest,
                path=_OPERATION_ID,
                response=api.GetMergeResponse,
                errors=_errors(_COMMON_ERRORS, _OPERATION_ERRORS),
            )
        },
    ),
]
