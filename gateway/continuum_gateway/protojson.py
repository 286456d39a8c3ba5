"""Protobuf messages in and out of HTTP, in the proto3 JSON mapping (camelCase names, int64 as strings).

Requests are built strictly: malformed JSON, a body that is not an object, unknown fields and unknown
or repeated query parameters are INVALID_ARGUMENT (400) from the gateway itself, never a 500. Parse
errors go back to the caller, who sent the content, but are never logged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import JSONResponse

from continuum_gateway.errors import GatewayError

MessageT = TypeVar("MessageT", bound=Message)


async def parse_body(request: Request, message: MessageT) -> MessageT:
    """Fill `message` from the request's JSON body; an empty body leaves it empty."""
    raw = await request.body()
    if not raw.strip():
        return message
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:
        # ValueError covers malformed JSON and undecodable bytes; RecursionError absurd nesting.
        raise GatewayError.invalid_argument("body", f"not valid JSON: {error}", reason="INVALID_JSON") from None
    if not isinstance(body, dict):
        raise GatewayError.invalid_argument("body", "must be a JSON object", reason="INVALID_JSON")
    try:
        json_format.ParseDict(body, message)
    except json_format.ParseError as error:
        raise GatewayError.invalid_argument("body", str(error)) from None
    return message


def bind_query(
    request: Request,
    message: MessageT,
    names: Mapping[str, str],
    *,
    values: Mapping[str, Mapping[str, str]] | None = None,
) -> MessageT:
    """Set fields of `message` from query parameters.

    `names` maps each accepted parameter to its proto-JSON field name (``{"after": "afterMessageId"}``);
    `values` optionally maps a parameter's friendly values to enum names (``"older"`` →
    ``"PAGE_DIRECTION_OLDER"``). An unknown or repeated parameter is refused rather than ignored, so a
    typo cannot silently change what a client reads.
    """
    seen: set[str] = set()
    for key, value in request.query_params.multi_items():
        if key not in names:
            allowed = ", ".join(sorted(names)) or "none"
            raise GatewayError.invalid_argument(key, f"unknown query parameter (allowed: {allowed})")
        if key in seen:
            raise GatewayError.invalid_argument(key, "query parameter given more than once")
        seen.add(key)
        translated = (values or {}).get(key, {}).get(value.lower(), value)
        _bind_one(message, key, names[key], translated)
    return message


def bind_path(request: Request, message: MessageT, names: Mapping[str, str]) -> MessageT:
    """Set fields of `message` from path parameters, named as in `bind_query`."""
    for key, field in names.items():
        _bind_one(message, key, field, request.path_params[key])
    return message


def _bind_one(message: Message, parameter: str, field: str, value: str) -> None:
    # Going through ParseDict converts strings exactly as proto JSON does (int64 range, enum names,
    # field masks) and reports failures as ParseError instead of a ValueError from a setter. Only
    # booleans need help: proto JSON accepts strings for numbers but not for true/false.
    converted: str | bool = value
    descriptor = message.DESCRIPTOR.fields_by_camelcase_name.get(field)
    if descriptor is not None and descriptor.type == FieldDescriptor.TYPE_BOOL:
        converted = {"true": True, "false": False}.get(value.lower(), value)
    try:
        json_format.ParseDict({field: converted}, message)
    except json_format.ParseError as error:
        raise GatewayError.invalid_argument(parameter, str(error)) from None


def to_json(message: Message) -> dict[str, Any]:
    """The proto3 JSON form of `message`, with every field present (zero values included)."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


def json_response(message: Message, status_code: int = 200, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """`message` as a JSON response."""
    return JSONResponse(to_json(message), status_code=status_code, headers=headers)
