"""The gateway's OpenAPI 3.1 document, generated from its route table and the proto messages.

    GET /v1/openapi.json    the document (no token needed)

Every `Resource` route contributes its operations (`routing.Operation`): path, query and header
parameters with the schemas and comments of the request fields they set, the request body as the
input form of its proto message, the success responses as the output form of the proto message (or
the schema the route builds), and the AIP-193 error responses. The Follow WebSocket, which OpenAPI
cannot describe, is a path item without operations whose ``x-websocket`` extension gives its
subprotocols, hello and messages. Schemas follow the proto3 JSON mapping (`proto_schema`).

The document is built once per app, on first request (`ApiDocument`); the reference page
(`reference`) renders the same document.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, WebSocketRoute

from continuum.agent.v1 import error_reason_pb2 as agent_reasons
from continuum.compaction.v1 import error_reason_pb2 as compaction_reasons
from continuum.gateway.v1 import error_reason_pb2 as gateway_reasons
from continuum.merge.v1 import error_reason_pb2 as merge_reasons
from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum.transcript.v1 import follow_pb2, transcript_service_pb2
from continuum_gateway.errors import BAD_REQUEST_TYPE, DOMAIN, ERROR_INFO_TYPE, RELAYED_DETAILS, TYPE_URL_PREFIX
from continuum_gateway.field_paths import proto_name
from continuum_gateway.follow import FOLLOW_SUBPROTOCOL, MAX_CAPABILITIES, MAX_CAPABILITY_LENGTH
from continuum_gateway.proto_comments import ProtoComments
from continuum_gateway.proto_schema import (
    Direction,
    JsonSchema,
    SchemaBuilder,
    component_name,
    descriptor_of,
    is_input_required,
)
from continuum_gateway.routing import Operation, Resource
from continuum_runtime.wire_names import TRANSCRIPT_V2

OPENAPI_PATH = "/v1/openapi.json"
ERROR, ERROR_STATUS = "Error", "ErrorStatus"
FOLLOW_HELLO, FOLLOW_FRAME, FOLLOW_ERROR = "FollowHello", "FollowFrame", "FollowError"
_JSON = "application/json"
_ERROR_REF = {"$ref": f"#/components/schemas/{ERROR}"}

_INTRODUCTION = """\
HTTP and WebSocket access to Continuum sessions: their messages, compaction, merges and live transcript.

**Authentication.** Every route but the probes and this reference needs `Authorization: Bearer
<token>`; the token stands for one user, and the services decide what that user may read.

**JSON.** Bodies and responses are protobuf messages in the proto3 JSON mapping: fields by their
lowerCamel names (proto names are accepted in requests too), 64-bit integers as decimal strings
(requests may send numbers), enums by value name, timestamps in RFC 3339, durations as `"1.5s"`.
Responses carry every field without presence, zero values included. Unknown fields and unknown query
parameters are refused.

**Errors** are AIP-193 bodies (the `Error` schema): `code` is the HTTP status, `status` the gRPC code
name, and `details` hold an `ErrorInfo` (its `reason` is the machine code, its `domain` says who
refused: `gateway.continuum`, `transcript.continuum`, `compaction.continuum`, `merge.continuum` or
`agent.continuum`)
and, for a malformed request, a `BadRequest` whose `fieldViolations` name each field as the request
spelled it (a path parameter by its name in the route). A merge conflict also carries the merge
operation as it stands (`@type` `type.googleapis.com/continuum.merge.v1.MergeOperation`).

**Pages.** List routes take `pageSize` and `pageToken` and answer `nextPageToken` (empty on the last
page); a token is only good for the same route and parameters.
"""


_FOLLOW = f"""\
A browser's live view of a session, relayed frame for frame from transcript's Follow stream.

Open the socket with the subprotocols `{FOLLOW_SUBPROTOCOL}` and `continuum.bearer.` + the bearer
token in unpadded base64url (browsers cannot set headers on a WebSocket; other clients may send
`Authorization: Bearer <token>` instead). Then send the hello (`{FOLLOW_HELLO}`) within ten seconds:
`{{"type": "hello", "capabilities": ["{TRANSCRIPT_V2}"]}}`, with `"resume": {{"streamGeneration": "3",
"seq": "41"}}` to continue from the last applied cursor.

Every message the gateway sends is one JSON text (`{FOLLOW_FRAME}`): `type` names the frame and the
field holding it (`handshake`, `snapshotBegin`, `snapshotRecords`, ..., `snapshotEnd`, `batch`,
`chunk`, `settlement`, `heartbeat`, `resync`), in proto JSON like the REST routes. A `resync` frame
ends the stream (close 1000): follow again, with `resume` when it says `resumable`. A failure is one
`{FOLLOW_ERROR}` message with the REST error body, then a close with 4000 + its HTTP status (4401
without a valid token, 4404 for an unknown session, 4426 without `{TRANSCRIPT_V2}`, 4429 for a
client too slow to keep up).
"""


class ApiDocument:
    """The document of an app's routes, built on first use (the routes are complete by then)."""

    def __init__(self, app_routes: Callable[[], Sequence[BaseRoute]], comments: ProtoComments) -> None:
        self._app_routes = app_routes
        self._comments = comments
        self._document: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        """The document."""
        if self._document is None:
            self._document = document(self._app_routes(), self._comments)
        return self._document


def routes(api: ApiDocument) -> list[Resource]:
    """The route serving `api`."""

    async def openapi_document(request: Request) -> Response:
        """This document."""
        return JSONResponse(api.get())

    operation = Operation(openapi_document, response=lambda schemas: {"type": "object"}, public=True)
    return [Resource(OPENAPI_PATH, "openapi", {"GET": operation})]


def document(app_routes: Sequence[BaseRoute], comments: ProtoComments) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app_routes`."""
    schemas = SchemaBuilder(comments)
    paths: dict[str, Any] = {}
    for route in app_routes:
        if isinstance(route, Resource):
            item = paths.setdefault(route.path, {})
            for method, operation in route.operations.items():
                item[method.lower()] = _operation(operation, route, schemas)
        elif isinstance(route, WebSocketRoute):
            paths[route.path] = _follow(route, schemas)
    reasons = [
        schemas.enum(enum.DESCRIPTOR)
        for enum in (
            gateway_reasons.ErrorReason,
            transcript_reasons.ErrorReason,
            compaction_reasons.ErrorReason,
            merge_reasons.ErrorReason,
            agent_reasons.ErrorReason,
        )
    ]
    relayed = [_relayed_detail(descriptor_of(kind), schemas) for kind in RELAYED_DETAILS.values()]
    return {
        "openapi": "3.1.0",
        "info": {"title": "Continuum gateway", "version": "v1", "description": _INTRODUCTION},
        "paths": paths,
        "components": {
            "schemas": {
                **dict(sorted(schemas.components.items())),
                ERROR: {
                    "type": "object",
                    "description": "An AIP-193 error body.",
                    "properties": {"error": {"$ref": f"#/components/schemas/{ERROR_STATUS}"}},
                    "required": ["error"],
                    "additionalProperties": False,
                },
                ERROR_STATUS: _error_status_schema(reasons, relayed),
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _operation(operation: Operation, route: Resource, schemas: SchemaBuilder) -> dict[str, Any]:
    summary, _, description = (inspect.getdoc(operation.endpoint) or "").partition("\n")
    request = descriptor_of(operation.request) if operation.request is not None else None
    parameters = [
        *(_parameter("path", name, path, request, operation, schemas) for name, path in operation.path.items()),
        *(_parameter("query", name, path, request, operation, schemas) for name, path in operation.query.items()),
        *(
            {"name": name, "in": "header", "description": text, "schema": {"type": "string"}}
            for name, text in operation.headers.items()
        ),
    ]
    undeclared = set(route.param_convertors) - set(operation.path)
    if undeclared:
        # OpenAPI requires every template variable; so does `bind`, to fill the request from it.
        raise ValueError(f"{operation.name}: path parameters {sorted(undeclared)} are not bound to request fields")
    result: dict[str, Any] = {"operationId": operation.name, "summary": summary.strip()}
    if description.strip():
        result["description"] = description.strip()
    if parameters:
        result["parameters"] = parameters
    if operation.body is not None and request is not None:
        result["requestBody"] = _request_body(operation, request, schemas)
    result["responses"] = _responses(operation, schemas)
    if operation.public:
        result["security"] = []
    return result


def _request_field(descriptor: Descriptor, path: str) -> FieldDescriptor:
    *parents, leaf = [proto_name(name) for name in path.split(".")]
    for name in parents:
        descriptor = _message_type(descriptor.fields_by_name[name])
    return descriptor.fields_by_name[leaf]


def _message_type(field: FieldDescriptor) -> Descriptor:
    if field.message_type is None:
        raise ValueError(f"{field.full_name} is not a message")
    return field.message_type


def _parameter(
    location: str,
    name: str,
    path: str,
    request: Descriptor | None,
    operation: Operation,
    schemas: SchemaBuilder,
) -> dict[str, Any]:
    assert request is not None, f"{operation.name}: parameters need a request message"
    field = _request_field(request, path)
    aliases = operation.query_values.get(name)
    if aliases:
        schema: JsonSchema = {"type": "string", "enum": list(aliases)}
    elif field.message_type is not None and field.message_type.full_name == "google.protobuf.FieldMask":
        schema = {"type": "string", "description": "Field names, comma-separated (JSON or proto names)."}
    else:
        # Parameters are text: 64-bit integers as their decimal digits, like in responses.
        schema = schemas.single(field, Direction.OUTPUT)
    parameter: dict[str, Any] = {"name": name, "in": location, "schema": schema}
    comment = schemas.comments.of(field.full_name)
    if comment:
        parameter["description"] = comment
    if location == "path" or is_input_required(field):
        parameter["required"] = True
    return parameter


def _request_body(operation: Operation, request: Descriptor, schemas: SchemaBuilder) -> dict[str, Any]:
    # Fields the path or query sets are not part of the body.
    bound = [proto_name(path).split(".") for path in [*operation.path.values(), *operation.query.values()]]
    if operation.body == "*":
        descriptor = request
        omit = [parts[0] for parts in bound if len(parts) == 1]
    else:
        body = proto_name(str(operation.body))
        descriptor = _message_type(request.fields_by_name[body])
        omit = [parts[1] for parts in bound if len(parts) == 2 and parts[0] == body]
    schema = schemas.message(descriptor, Direction.INPUT, omit=omit)
    component = schemas.components[component_name(descriptor, Direction.INPUT)]
    return {"required": bool(component.get("required")), "content": {_JSON: {"schema": schema}}}


def _responses(operation: Operation, schemas: SchemaBuilder) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    content: dict[str, Any] = {}
    answer = operation.response
    if isinstance(answer, type) and issubclass(answer, Message):
        content = {operation.media_type: {"schema": schemas.message(descriptor_of(answer), Direction.OUTPUT)}}
    elif answer is not None and not isinstance(answer, type):
        content = {operation.media_type: {"schema": answer(schemas)}}
    headers = {
        name: {"description": text, "required": True, "schema": {"type": "string"}}
        for name, text in operation.response_headers.items()
    }
    for status, description in operation.statuses.items():
        response: dict[str, Any] = {"description": description}
        if content and status != 204:
            response["content"] = content
        if headers:
            response["headers"] = headers
        responses[str(status)] = response
    for status, description in _errors(operation).items():
        responses[str(status)] = {"description": description, "content": {_JSON: {"schema": _ERROR_REF}}}
    responses["default"] = {
        "description": "Any other failure (see the gRPC code → HTTP status table).",
        "content": {_JSON: {"schema": _ERROR_REF}},
    }
    return responses


def _errors(operation: Operation) -> dict[int, str]:
    if operation.errors is not None:
        return dict(operation.errors)
    if operation.public:
        return {}
    errors = {
        400: "Malformed request (INVALID_ARGUMENT, naming the field) or a refused precondition.",
        401: "No valid bearer token.",
        403: "The session belongs to another user.",
        404: "No such session (or message).",
        409: "A conflict: the session changed (ABORTED) or already exists.",
        429: "A limit was reached for now.",
        500: "An unexpected failure; nothing about it is disclosed.",
        503: "A service is unavailable; retry later.",
        504: "A service did not answer in time.",
    }
    if operation.body is not None:
        errors[408] = "The body stalled for longer than the gateway waits (REQUEST_TIMEOUT)."
        errors[413] = "The body is over the gateway's limit (REQUEST_TOO_LARGE)."
    return dict(sorted(errors.items()))


def _relayed_detail(descriptor: Descriptor, schemas: SchemaBuilder) -> JsonSchema:
    """A resource a service attaches to its refusal, as a JSON `Any`: its fields and its ``@type``."""
    schemas.message(descriptor, Direction.OUTPUT)
    detail = copy.deepcopy(schemas.components[component_name(descriptor, Direction.OUTPUT)])
    detail["properties"] = {"@type": {"const": TYPE_URL_PREFIX + descriptor.full_name}, **detail["properties"]}
    detail["required"] = ["@type", *detail.get("required", [])]
    return detail


def _error_status_schema(reasons: list[JsonSchema], relayed: list[JsonSchema]) -> JsonSchema:
    error_info = {
        "type": "object",
        "properties": {
            "@type": {"const": ERROR_INFO_TYPE},
            "reason": {
                "type": "string",
                "description": f"The machine code: a value of the ErrorReason of the domain's package "
                f"({', '.join(r['$ref'].rsplit('/', 1)[-1] for r in reasons)}).",
            },
            "domain": {"type": "string", "description": f"Who refused: {DOMAIN} or a service's domain."},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "required": ["@type", "reason", "domain", "metadata"],
        "additionalProperties": False,
    }
    violation = {
        "type": "object",
        "properties": {"field": {"type": "string"}, "description": {"type": "string"}},
        "required": ["field", "description"],
        "additionalProperties": False,
    }
    bad_request = {
        "type": "object",
        "properties": {"@type": {"const": BAD_REQUEST_TYPE}, "fieldViolations": {"type": "array", "items": violation}},
        "required": ["@type", "fieldViolations"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "description": "What went wrong.",
        "properties": {
            "code": {"type": "integer", "description": "The HTTP status."},
            "status": {"type": "string", "enum": [code.name for code in grpc.StatusCode]},
            "message": {"type": "string"},
            "details": {"type": "array", "items": {"anyOf": [error_info, bad_request, *relayed]}},
        },
        "required": ["code", "status", "message", "details"],
        "additionalProperties": False,
    }


def _follow(route: WebSocketRoute, schemas: SchemaBuilder) -> dict[str, Any]:
    """The Follow WebSocket as a path item without operations (OpenAPI has none for WebSockets)."""
    cursor = schemas.message(follow_pb2.FollowCursor.DESCRIPTOR, Direction.INPUT)
    schemas.components[FOLLOW_HELLO] = {
        "type": "object",
        "description": "The first message a client sends.",
        "properties": {
            "type": {"const": "hello"},
            "capabilities": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": MAX_CAPABILITY_LENGTH},
                "maxItems": MAX_CAPABILITIES,
                "contains": {"const": TRANSCRIPT_V2},
            },
            "resume": {**cursor, "description": "The last applied cursor, to resume with the suffix only."},
        },
        "required": ["type", "capabilities"],
        "additionalProperties": False,
    }
    descriptor = transcript_service_pb2.FollowResponse.DESCRIPTOR
    schemas.message(descriptor, Direction.OUTPUT)
    frame = copy.deepcopy(schemas.components[component_name(descriptor, Direction.OUTPUT)])
    kinds = [field.json_name for field in descriptor.oneofs_by_name["frame"].fields]
    frame["properties"]["type"] = {
        "type": "string",
        "enum": [*kinds, "unknown"],
        "description": "The frame's kind: the name of the one other field it carries.",
    }
    frame["required"] = ["type", *frame.get("required", [])]
    schemas.components[FOLLOW_FRAME] = frame
    schemas.components[FOLLOW_ERROR] = {
        "type": "object",
        "description": "A failure, sent before the close: the AIP-193 body of the same failure over REST.",
        "properties": {"type": {"const": "error"}, "error": {"$ref": f"#/components/schemas/{ERROR_STATUS}"}},
        "required": ["type", "error"],
        "additionalProperties": False,
    }
    return {
        "summary": "Follow a session live (WebSocket).",
        "description": _FOLLOW,
        "parameters": [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "x-websocket": {
            "subprotocols": [FOLLOW_SUBPROTOCOL, "continuum.bearer.<base64url(token), unpadded>"],
            "client-messages": {"$ref": f"#/components/schemas/{FOLLOW_HELLO}"},
            "server-messages": [
                {"$ref": f"#/components/schemas/{FOLLOW_FRAME}"},
                {"$ref": f"#/components/schemas/{FOLLOW_ERROR}"},
            ],
            "close-codes": "1000 after a resync frame; otherwise 4000 + the HTTP status of the failure "
            "(4400, 4401, 4403, 4404, 4426 for a client without transcript-v2, 4429 for a client "
            "too slow to keep up, 4503, ...).",
        },
    }
