"""Protobuf messages in and out of HTTP, in the proto3 JSON mapping (camelCase names, int64 as strings).

Requests are built strictly: malformed JSON, a body that is not an object, unknown fields and unknown
or repeated query parameters are INVALID_ARGUMENT (400) from the gateway itself, never a 500. A
refusal names the field as the request spelled it (``messages[0].role``, ``pageSize``) and says
what would be valid (an enum's values, a number's range). Parse errors go back to the caller, who
sent the content, but are never logged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from starlette.requests import Request
from starlette.responses import JSONResponse

from continuum_gateway.errors import GatewayError
from continuum_gateway.field_paths import proto_name
from continuum_gateway.proto_schema import descriptor_of
from continuum_runtime.errors import FieldViolation

MessageT = TypeVar("MessageT", bound=Message)

# How deep JSON objects and arrays may nest in a body. Metadata is free-form JSON, and protobuf decodes
# no deeper than about 33 levels of it; a body past that would pass here and fail upstream as a 500.
MAX_BODY_DEPTH = 32
# The longest piece of a refused value quoted back in an error.
_QUOTED_CHARS = 64
_INT32 = "an integer from -2147483648 to 2147483647"
_UINT32 = "an integer from 0 to 4294967295"
_INT64 = "an integer from -9223372036854775808 to 9223372036854775807 (a JSON string or number)"
_UINT64 = "an integer from 0 to 18446744073709551615 (a JSON string or number)"
_EXPECTED: Mapping[int, str] = {
    FieldDescriptor.TYPE_STRING: "a string",
    FieldDescriptor.TYPE_BYTES: "a base64 string",
    FieldDescriptor.TYPE_BOOL: "true or false",
    FieldDescriptor.TYPE_INT32: _INT32,
    FieldDescriptor.TYPE_SINT32: _INT32,
    FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_UINT32: _UINT32,
    FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: _UINT64,
    FieldDescriptor.TYPE_FIXED64: _UINT64,
    FieldDescriptor.TYPE_FLOAT: "a number",
    FieldDescriptor.TYPE_DOUBLE: "a number",
}
_WELL_KNOWN_EXPECTED: Mapping[str, str] = {
    "google.protobuf.Timestamp": 'an RFC 3339 timestamp such as "2025-01-31T12:00:00Z"',
    "google.protobuf.Duration": 'a duration in seconds such as "1.5s"',
    "google.protobuf.FieldMask": "a comma-separated list of field names",
    "google.protobuf.Struct": "a JSON object",
    "google.protobuf.ListValue": "a JSON array",
    "google.protobuf.Empty": "an empty JSON object",
}
_FIELD_MASK = "google.protobuf.FieldMask"
_MASK_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


async def parse_body(request: Request, message: MessageT, *, field_prefix: str = "") -> MessageT:
    """Fill `message` from the request's JSON body; an empty body leaves it empty.

    `field_prefix` goes before the names of refused fields when the body is one field of the request
    message (``session.`` for a body that is the request's ``session``).
    """
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
    too_deep = _nested_too_deep(body, field_prefix.rstrip("."))
    if too_deep is not None:
        raise GatewayError.invalid_argument(too_deep, f"is nested more than {MAX_BODY_DEPTH} levels deep")
    try:
        json_format.ParseDict(body, message)
    except (json_format.ParseError, RecursionError):
        violation = refused_field(body, descriptor_of(message), field_prefix.rstrip("."))
        raise GatewayError.invalid_argument(violation.field, violation.description) from None
    return message


def _nested_too_deep(body: dict[str, Any], prefix: str) -> str | None:
    """The path of the first object or array of `body` nested more than MAX_BODY_DEPTH levels deep, if any."""
    pending: list[tuple[object, str, int]] = [(body, prefix, 1)]
    while pending:
        value, path, depth = pending.pop()
        if depth > MAX_BODY_DEPTH:
            return path or "body"
        # Only containers are walked: a body's strings and numbers nest nothing.
        if isinstance(value, dict):
            pending.extend(
                (item, f"{path}.{key}" if path else str(key), depth + 1)
                for key, item in value.items()
                if isinstance(item, (dict, list))
            )
        elif isinstance(value, list):
            pending.extend(
                (item, f"{path}[{index}]", depth + 1)
                for index, item in enumerate(value)
                if isinstance(item, (dict, list))
            )
    return None


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
        aliases = (values or {}).get(key, {})
        bind_field(message, names[key], key, aliases.get(value.lower(), value), aliases)
    return message


def bind_path(request: Request, message: MessageT, names: Mapping[str, str]) -> MessageT:
    """Set fields of `message` from path parameters, named as in `bind_query`."""
    for key, field in names.items():
        bind_field(message, field, key, request.path_params[key])
    return message


def bind_field(
    message: Message, path: str, parameter: str, value: str, aliases: Mapping[str, str] | None = None
) -> None:
    """Set the field at `path` (JSON or proto names, dot-separated) from the text of `parameter`.

    A field mask takes field names in either spelling (``workingDirectory`` or ``working_directory``).
    """
    message, field = _leaf(message, path)
    if field.message_type is not None and field.message_type.full_name == _FIELD_MASK:
        _bind_mask(getattr(message, field.name), parameter, value)
        return
    # Going through ParseDict converts strings exactly as proto JSON does (int64 range, enum names)
    # and reports failures as ParseError instead of a ValueError from a setter. Only booleans need
    # help: proto JSON accepts strings for numbers but not for true/false.
    converted: str | bool = value
    if field.type == FieldDescriptor.TYPE_BOOL:
        converted = {"true": True, "false": False}.get(value.lower(), value)
    try:
        json_format.ParseDict({field.json_name: converted}, message)
    except json_format.ParseError:
        raise GatewayError.invalid_argument(parameter, describe_refusal(field, value, aliases)) from None


def field_value(message: Message, path: str) -> object:
    """The value of the field at `path` (JSON or proto names, dot-separated) as it is set now."""
    parent, field = _leaf(message, path)
    return getattr(parent, field.name)


def _leaf(message: Message, path: str) -> tuple[Message, FieldDescriptor]:
    """The message holding the field at `path`, and that field."""
    *parents, leaf = path.split(".")
    for name in parents:
        message = getattr(message, _field(descriptor_of(message), name).name)
    return message, _field(descriptor_of(message), leaf)


def _field(descriptor: Descriptor, name: str) -> FieldDescriptor:
    field = descriptor.fields_by_camelcase_name.get(name) or descriptor.fields_by_name.get(name)
    if field is None:
        raise KeyError(f"{descriptor.full_name} has no field {name!r}")
    return field


def _bind_mask(mask: Message, parameter: str, value: str) -> None:
    paths = [path.strip() for path in value.split(",") if path.strip()]
    for path in paths:
        if not _MASK_PATH.match(path):
            raise GatewayError.invalid_argument(parameter, f"{_quoted(path)} is not a field name")
    mask.paths.extend(proto_name(path) for path in paths)  # type: ignore[attr-defined]


def refused_field(body: object, descriptor: Descriptor, path: str = "") -> FieldViolation:
    """The first field of `body` that proto JSON cannot parse into `descriptor`, as the body spelled it."""
    if descriptor.full_name.startswith("google.protobuf."):
        return FieldViolation(path or "body", f"must be {_expected_message(descriptor)}")
    if not isinstance(body, dict):
        return FieldViolation(path or "body", "must be a JSON object")
    oneofs: dict[str, str] = {}
    for key, item in body.items():
        here = f"{path}.{key}" if path else str(key)
        field = descriptor.fields_by_camelcase_name.get(key) or descriptor.fields_by_name.get(key)
        if field is None:
            known = ", ".join(f.json_name for f in descriptor.fields)
            return FieldViolation(here, f"unknown field (the fields are: {known})")
        oneof = field.containing_oneof
        if oneof is not None and item is not None:
            if oneof.name in oneofs:
                return FieldViolation(here, f"only one of {oneofs[oneof.name]} and {key} may be set")
            oneofs[oneof.name] = str(key)
        if not _parses(descriptor, {key: item}):
            return _refused_value(item, field, here)
    return FieldViolation(path or "body", "is not valid")


def _refused_value(item: Any, field: FieldDescriptor, path: str) -> FieldViolation:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        if not isinstance(item, dict):
            return FieldViolation(path, "must be a JSON object")
        value_field = field.message_type.fields_by_name["value"]
        for key, value in item.items():
            if not _parses(_container(field), {field.json_name: {key: value}}):
                return _refused_single(value, value_field, f"{path}.{key}")
        return FieldViolation(path, "has a key that is not valid")
    if field.is_repeated:
        if not isinstance(item, list):
            return FieldViolation(path, "must be a JSON array")
        for index, element in enumerate(item):
            if not _parses(_container(field), {field.json_name: [element]}):
                return _refused_single(element, field, f"{path}[{index}]")
        return FieldViolation(path, "is not valid")
    return _refused_single(item, field, path)


def _refused_single(item: Any, field: FieldDescriptor, path: str) -> FieldViolation:
    if field.message_type is not None:
        return refused_field(item, field.message_type, path)
    return FieldViolation(path, describe_refusal(field, item))


def describe_refusal(field: FieldDescriptor, value: object, aliases: Mapping[str, str] | None = None) -> str:
    """Why `value` is no value of `field` (a scalar or enum field), naming what would be valid."""
    if field.enum_type is not None:
        valid = list(aliases) if aliases else [v.name for v in field.enum_type.values]
        return f"{_quoted(value)} is not one of {', '.join(valid)}"
    if field.message_type is not None:
        return f"must be {_expected_message(field.message_type)}"
    return f"{_quoted(value)} is not {_EXPECTED[field.type]}"


def _container(field: FieldDescriptor) -> Descriptor:
    container = field.containing_type
    if container is None:
        raise ValueError(f"{field.full_name} is an extension")
    return container


def _expected_message(descriptor: Descriptor) -> str:
    return _WELL_KNOWN_EXPECTED.get(descriptor.full_name, "a JSON object")


def _parses(descriptor: Descriptor, body: dict[str, Any]) -> bool:
    try:
        json_format.ParseDict(body, message_factory.GetMessageClass(descriptor)())
    except (json_format.ParseError, RecursionError):
        return False
    return True


def _quoted(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > _QUOTED_CHARS:
        text = text[:_QUOTED_CHARS] + "…"
    return repr(text) if isinstance(value, str) else text


def to_json(message: Message) -> dict[str, Any]:
    """The proto3 JSON form of `message`, with every field present (zero values included)."""
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)


def json_response(message: Message, status_code: int = 200, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """`message` as a JSON response."""
    return JSONResponse(to_json(message), status_code=status_code, headers=headers)
