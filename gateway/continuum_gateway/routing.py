"""The route table: one `Operation` per method of a path, grouped by `resource()` into one Starlette route.

An `Operation` says everything the gateway knows about a method of a route: its handler, the proto
request it fills (from the body, path and query), what it answers. Handlers bind their request with
`bind(request, message)`, which follows the operation; the OpenAPI document (`openapi`) is generated
from the same operations, so the reference cannot describe parameters the route does not take.

Starlette answers a wrong method with the `Allow` list of the first route whose path matched; with one
route per path serving several methods, that list is every method the resource supports.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Scope

from continuum_gateway.errors import GatewayError, UpstreamError
from continuum_gateway.field_paths import json_path, proto_name
from continuum_gateway.proto_schema import SchemaBuilder, descriptor_of
from continuum_gateway.protojson import bind_field, bind_query, field_value, parse_body

Endpoint = Callable[[Request], Awaitable[Response]]
# A response schema the route writes itself (not a proto message as is), built with the same builder.
ResponseSchema = Callable[[SchemaBuilder], dict[str, Any]]
MessageT = TypeVar("MessageT", bound=Message)

# Where `resource()` leaves the operation of a request (an ASGI scope extension key).
_OPERATION_SCOPE_KEY = "continuum.operation"


@dataclass(frozen=True)
class Operation:
    """One method of one route.

    `body` is ``"*"`` when the JSON body is the whole `request` message, a field name (``"session"``)
    when it is that field, None when the route reads no body. `path` and `query` map each parameter
    to the request field it sets, by JSON name (``{"after": "afterMessageId"}``, nested
    ``"session.sessionId"``); `query_values` gives a parameter's friendly values for enum names.
    `headers` are request headers the route reads (name → description). `response` is the proto
    message the route answers as is, or a function building the schema of what it answers.
    `media_type` is the success responses' content type; `statuses` describe the success statuses;
    `response_headers` the headers every success carries; `errors` the error statuses worth naming
    (None: those of any route of its kind). `public` routes need no token.
    """

    endpoint: Endpoint
    request: type[Message] | None = None
    body: str | None = None
    path: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)
    query_values: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    response: type[Message] | ResponseSchema | None = None
    media_type: str = "application/json"
    statuses: Mapping[int, str] = field(default_factory=lambda: {200: "OK"})
    response_headers: Mapping[str, str] = field(default_factory=dict)
    errors: Mapping[int, str] | None = None
    public: bool = False

    @property
    def name(self) -> str:
        """The operation's id: its handler's name in lowerCamel (``createSession``)."""
        head, *rest = self.endpoint.__name__.split("_")
        return head + "".join(part.title() for part in rest)

    def field_name(self, path: str) -> str:
        """A service's field path (proto names) as this route's client names it.

        A field the route fills from a path or query parameter is that parameter; any other is the
        field's JSON path in the request (``messages[3].toolCalls``, ``session.workingDirectory``).
        """
        for parameter, bound in [*self.path.items(), *self.query.items()]:
            if path == proto_name(bound):
                return parameter
        return json_path(path, descriptor_of(self.request) if self.request is not None else None)


# The AIP-136 custom methods of every route made (`cancel` of `…/{operation_id}:cancel`).
_CUSTOM_METHOD = re.compile(r":([A-Za-z]+)$")
_CUSTOM_METHODS: set[str] = set()


class Resource(Route):
    """A Starlette route dispatching each method to its `Operation`."""

    def __init__(self, path: str, name: str, operations: Mapping[str, Operation]) -> None:
        self.operations = dict(operations)
        table = self.operations

        async def dispatch(request: Request) -> Response:
            method = "GET" if request.method == "HEAD" and "HEAD" not in table else request.method
            operation = table[method]
            request.scope[_OPERATION_SCOPE_KEY] = operation
            try:
                return await operation.endpoint(request)
            except UpstreamError as failure:
                failure.field_name = operation.field_name
                raise

        super().__init__(path, dispatch, methods=list(table), name=name)
        custom = _CUSTOM_METHOD.search(path)
        if custom is not None:
            _CUSTOM_METHODS.add(custom.group(1))

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        """As a Starlette route, except that no path parameter ends in a custom method (`x:cancel`):
        sent with the wrong method, `…/{operation_id}:cancel` must find the custom method's route (a
        405 naming its methods), not the resource's with `x:cancel` for an id (a 400)."""
        match, child = super().matches(scope)
        values = child.get("path_params", {}).values() if match is not Match.NONE else ()
        if any(str(value).rpartition(":")[2] in _CUSTOM_METHODS for value in values if ":" in str(value)):
            return Match.NONE, {}
        return match, child


def resource(path: str, name: str, operations: Mapping[str, Operation | Endpoint]) -> Resource:
    """A route at `path` serving ``operations[method]`` (HEAD is served by GET).

    A bare handler stands for an operation with nothing but that handler.
    """
    return Resource(
        path,
        name,
        {
            method: operation if isinstance(operation, Operation) else Operation(operation)
            for method, operation in operations.items()
        },
    )


def operation_of(request: Request) -> Operation:
    """The operation `request` was dispatched to."""
    operation = request.scope.get(_OPERATION_SCOPE_KEY)
    if not isinstance(operation, Operation):
        raise RuntimeError("the request was not dispatched by a Resource route")
    return operation


async def bind(request: Request, message: MessageT) -> MessageT:
    """Fill `message` from the request as its operation says: the body first, then path and query
    parameters. A body field the path also names must say the same or be left out; an operation
    without a body takes none (or `{}`). Unknown query parameters are refused."""
    operation = operation_of(request)
    if operation.body == "*":
        await parse_body(request, message)
    elif operation.body is not None:
        target = getattr(message, proto_name(operation.body))
        await parse_body(request, target, field_prefix=operation.body)
    else:
        # No body, or `{}`: anything else is refused rather than ignored.
        await parse_body(request, Empty())
    for parameter, path in operation.path.items():
        said = field_value(message, path)
        bind_field(message, path, parameter, request.path_params[parameter])
        if said and said != field_value(message, path):
            raise GatewayError.invalid_argument(
                json_path(path, descriptor_of(message)),
                f"must be left out or match the path's {parameter} ({request.path_params[parameter]!r})",
            )
    return bind_query(request, message, operation.query, values=operation.query_values)
