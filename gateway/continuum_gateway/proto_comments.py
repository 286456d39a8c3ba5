"""The contracts' own comments on their messages, fields, enums and values, for the API reference.

`make protos` writes the descriptors of every Continuum .proto file with protoc's source info (the
comments) beside the generated code (`continuum/descriptor_set.binpb`); the generated modules
themselves carry no comments. Elements are looked up by full proto name; an enum value by its enum's
full name and its own (``continuum.transcript.v1.MessageRole.MESSAGE_ROLE_USER``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from importlib import resources

from google.protobuf import descriptor_pb2

DESCRIPTOR_SET = "descriptor_set.binpb"

# Field numbers in descriptor.proto: the location paths of source info are made of them.
_FILE_MESSAGES, _FILE_ENUMS = 4, 5
_MESSAGE_FIELDS, _MESSAGE_NESTED, _MESSAGE_ENUMS = 2, 3, 4
_ENUM_VALUES = 2


class ProtoComments:
    """Comments by full proto name; an element without a comment has none (empty string)."""

    def __init__(self, files: descriptor_pb2.FileDescriptorSet) -> None:
        self._comments: dict[str, str] = {}
        for file in files.file:
            names = _element_names(file)
            for location in file.source_code_info.location:
                name = names.get(tuple(location.path))
                text = location.leading_comments or location.trailing_comments
                if name is not None and text.strip():
                    self._comments[name] = _clean(text)

    @classmethod
    def load(cls) -> ProtoComments:
        """The comments of the generated package's descriptor set (none when it is absent)."""
        files = descriptor_pb2.FileDescriptorSet()
        source = resources.files("continuum") / DESCRIPTOR_SET
        if source.is_file():
            files.ParseFromString(source.read_bytes())
        return cls(files)

    def of(self, full_name: str) -> str:
        """The comment of the element named `full_name`, or ""."""
        return self._comments.get(full_name, "")


def _clean(text: str) -> str:
    # protoc keeps the space after "//" on every line; paragraphs stay separated by blank lines.
    return textwrap.dedent(text).strip()


def _element_names(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Each message, field, enum and enum value of `file` by its source-info location path."""
    names: dict[tuple[int, ...], str] = {}
    scope = f"{file.package}." if file.package else ""
    _messages(names, (_FILE_MESSAGES,), scope, file.message_type)
    _enums(names, (_FILE_ENUMS,), scope, file.enum_type)
    return names


def _messages(
    names: dict[tuple[int, ...], str],
    path: tuple[int, ...],
    scope: str,
    messages: Sequence[descriptor_pb2.DescriptorProto],
) -> None:
    for index, message in enumerate(messages):
        here = (*path, index)
        full_name = scope + message.name
        names[here] = full_name
        for number, field in enumerate(message.field):
            names[(*here, _MESSAGE_FIELDS, number)] = f"{full_name}.{field.name}"
        _messages(names, (*here, _MESSAGE_NESTED), f"{full_name}.", message.nested_type)
        _enums(names, (*here, _MESSAGE_ENUMS), f"{full_name}.", message.enum_type)


def _enums(
    names: dict[tuple[int, ...], str],
    path: tuple[int, ...],
    scope: str,
    enums: Sequence[descriptor_pb2.EnumDescriptorProto],
) -> None:
    for index, enum in enumerate(enums):
        here = (*path, index)
        full_name = scope + enum.name
        names[here] = full_name
        for number, value in enumerate(enum.value):
            names[(*here, _ENUM_VALUES, number)] = f"{full_name}.{value.name}"
