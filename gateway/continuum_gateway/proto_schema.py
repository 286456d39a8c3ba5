"""JSON Schemas (2020-12, as OpenAPI 3.1 uses them) of protobuf messages in the proto3 JSON mapping.

The mapping the gateway speaks (`continuum_gateway.protojson`): fields by their JSON (lowerCamel)
names; 64-bit integers as decimal strings (requests may also send JSON numbers); enums by value
name; ``Timestamp`` as RFC 3339, ``Duration`` as ``"1.5s"``, ``FieldMask`` as a comma-separated
string, ``Struct`` as any object and ``Value`` as any JSON value; ``repeated`` as arrays, maps as
objects; at most one field of a oneof.

Every message has two forms, because the same message reads differently in each direction:

- output (component ``<full proto name>``): what responses carry. The gateway prints every field
  without presence (zero values included), so those are ``required``; message fields, oneof
  members and ``optional`` fields appear only when set.
- input (component ``<full proto name>-Input``): what requests may send. Only fields marked
  ``(google.api.field_behavior) = REQUIRED`` are required (a required repeated field needs an item);
  fields the route fills from its path or query are left out.

In both, ``OUTPUT_ONLY`` fields are ``readOnly`` (sent in a request, they are ignored), and unknown
fields are refused (``additionalProperties: false``), as the gateway refuses them. Descriptions are
the contracts' own comments (`continuum_gateway.proto_comments`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from itertools import combinations
from typing import Any, cast

from google.api import field_behavior_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

from continuum_gateway.proto_comments import ProtoComments

JsonSchema = dict[str, Any]

_INT32 = {"type": "integer", "format": "int32", "minimum": -(2**31), "maximum": 2**31 - 1}
_UINT32 = {"type": "integer", "format": "uint32", "minimum": 0, "maximum": 2**32 - 1}
_INT64_PATTERN = "^-?[0-9]+$"
_UINT64_PATTERN = "^[0-9]+$"
_NUMBER = {"anyOf": [{"type": "number"}, {"enum": ["NaN", "Infinity", "-Infinity"]}]}

_SCALARS: Mapping[int, JsonSchema] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_INT32: _INT32,
    FieldDescriptor.TYPE_SINT32: _INT32,
    FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_UINT32: _UINT32,
    FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_FLOAT: _NUMBER,
    FieldDescriptor.TYPE_DOUBLE: _NUMBER,
}
_SIGNED_64 = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64})
_UNSIGNED_64 = frozenset({FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64})

# Well-known types have JSON forms of their own instead of objects of their fields.
_WELL_KNOWN: Mapping[str, JsonSchema] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]{1,9})?s$"},
    "google.protobuf.FieldMask": {"type": "string"},
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Empty": {"type": "object", "maxProperties": 0},
    "google.protobuf.Any": {"type": "object", "properties": {"@type": {"type": "string"}}, "required": ["@type"]},
    "google.protobuf.StringValue": {"type": "string"},
    "google.protobuf.BytesValue": {"type": "string", "contentEncoding": "base64"},
    "google.protobuf.BoolValue": {"type": "boolean"},
    "google.protobuf.Int32Value": _INT32,
    "google.protobuf.UInt32Value": _UINT32,
    "google.protobuf.Int64Value": {"type": "string", "format": "int64", "pattern": _INT64_PATTERN},
    "google.protobuf.UInt64Value": {"type": "string", "format": "uint64", "pattern": _UINT64_PATTERN},
    "google.protobuf.FloatValue": _NUMBER,
    "google.protobuf.DoubleValue": _NUMBER,
}


class Direction(enum.Enum):
    """Which way a message travels: it decides what is required (see the module docstring)."""

    INPUT = "Input"
    OUTPUT = "Output"


def descriptor_of(message: type[Message] | Message) -> Descriptor:
    """A message class's (or message's) descriptor, typed as the descriptor module's class."""
    # The stubs type it as the union of the pure-Python and the upb class, which behave alike.
    return cast(Descriptor, message.DESCRIPTOR)


def component_name(descriptor: Descriptor, direction: Direction) -> str:
    """The name of a message's schema under ``#/components/schemas``."""
    return descriptor.full_name + ("-Input" if direction is Direction.INPUT else "")


def behaviors(field: FieldDescriptor) -> set[int]:
    """The field's `google.api.field_behavior` values (REQUIRED, OUTPUT_ONLY, ...)."""
    return set(field.GetOptions().Extensions[field_behavior_pb2.field_behavior])


def is_input_required(field: FieldDescriptor) -> bool:
    """Whether a request must set the field."""
    return field_behavior_pb2.REQUIRED in behaviors(field)


class SchemaBuilder:
    """Builds schemas into `components`, one per message form and one per enum, referenced by `$ref`."""

    def __init__(self, comments: ProtoComments) -> None:
        self.comments = comments
        self.components: dict[str, JsonSchema] = {}
        # Fields left out of a message's input form (the route fills them), by component name.
        self._omitted: dict[str, frozenset[str]] = {}

    def message(self, descriptor: Descriptor, direction: Direction, *, omit: Collection[str] = ()) -> JsonSchema:
        """The schema of a message: a `$ref` to its component (a well-known type inline).

        `omit` names fields (proto names) that its input form leaves out; a message's input form is
        built once, so every use must omit the same fields.
        """
        if descriptor.full_name in _WELL_KNOWN:
            return dict(_WELL_KNOWN[descriptor.full_name])
        name = component_name(descriptor, direction)
        omitted = frozenset(omit)
        if name in self._omitted:
            if self._omitted[name] != omitted:
                raise ValueError(f"{name} is used with different fields left out: {self._omitted[name]} / {omitted}")
        else:
            self._omitted[name] = omitted
            self.components[name] = {}  # a placeholder: messages may refer to themselves
            self.components[name] = self._object(descriptor, direction, omitted)
        return {"$ref": f"#/components/schemas/{name}"}

    def enum(self, descriptor: EnumDescriptor) -> JsonSchema:
        """The schema of an enum (its value names): a `$ref` to its component."""
        if descriptor.full_name == "google.protobuf.NullValue":
            return {"type": "null"}
        name = descriptor.full_name
        if name not in self.components:
            lines = [self.comments.of(name)] if self.comments.of(name) else []
            values = []
            for value in descriptor.values:
                comment = self.comments.of(f"{name}.{value.name}")
                values.append(f"- `{value.name}`" + (f": {comment}" if comment else ""))
            self.components[name] = {
                "type": "string",
                "enum": [value.name for value in descriptor.values],
                "description": "\n\n".join([*lines, "\n".join(values)]),
            }
        return {"$ref": f"#/components/schemas/{name}"}

    def field(self, field: FieldDescriptor, direction: Direction) -> JsonSchema:
        """The schema of a field's value: an array for `repeated`, an object for a map."""
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            schema: JsonSchema = {"type": "object", "additionalProperties": self.single(value, direction)}
            if key.type != FieldDescriptor.TYPE_STRING:
                schema["propertyNames"] = {"pattern": _INT64_PATTERN}
            return schema
        if field.is_repeated:
            return {"type": "array", "items": self.single(field, direction)}
        return self.single(field, direction)

    def single(self, field: FieldDescriptor, direction: Direction) -> JsonSchema:
        """The schema of one value of a field (an item of a repeated field)."""
        if field.message_type is not None:
            return self.message(field.message_type, direction)
        if field.enum_type is not None:
            return self.enum(field.enum_type)
        if field.type in _SIGNED_64 or field.type in _UNSIGNED_64:
            signed = field.type in _SIGNED_64
            schema: JsonSchema = {
                "type": "string",
                "format": "int64" if signed else "uint64",
                "pattern": _INT64_PATTERN if signed else _UINT64_PATTERN,
            }
            if direction is Direction.INPUT:
                # Proto JSON parsers take numbers too; responses always carry strings.
                schema["type"] = ["string", "integer"]
            return schema
        return dict(_SCALARS[field.type])

    def _object(self, descriptor: Descriptor, direction: Direction, omitted: frozenset[str]) -> JsonSchema:
        properties: dict[str, JsonSchema] = {}
        required: list[str] = []
        for field in descriptor.fields:
            if field.name in omitted:
                continue
            schema = self.field(field, direction)
            if field_behavior_pb2.OUTPUT_ONLY in behaviors(field):
                schema["readOnly"] = True
            comment = self.comments.of(field.full_name)
            if comment:
                schema["description"] = comment
            properties[field.json_name] = schema
            if direction is Direction.OUTPUT and not field.has_presence:
                required.append(field.json_name)
            if direction is Direction.INPUT and is_input_required(field):
                required.append(field.json_name)
                if field.is_repeated:
                    schema["minItems"] = 1
        schema = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            schema["required"] = required
        comment = self.comments.of(descriptor.full_name)
        if comment:
            schema["description"] = comment
        pairs = [
            [first.json_name, second.json_name]
            for oneof in descriptor.oneofs
            for first, second in combinations([f for f in oneof.fields if f.json_name in properties], 2)
        ]
        if pairs:
            # A oneof: at most one of its fields is set.
            schema["not"] = {"anyOf": [{"required": pair} for pair in pairs]}
        return schema
