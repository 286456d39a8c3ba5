"""Field paths in the two spellings: services name fields by proto name (``messages[3].tool_calls``),
HTTP clients by JSON name (``messages[3].toolCalls``).

A path is dot-separated segments, each a field name optionally followed by indexes or map keys in
brackets (``content[0]``, ``metadata["k"]``).
"""

from __future__ import annotations

import re

from google.protobuf.descriptor import Descriptor

_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[[^\]]*\])*)$")
_UPPER = re.compile(r"[A-Z]")


def json_name(proto_name: str) -> str:
    """A proto field name in proto JSON: lowerCamel (``page_token`` → ``pageToken``), as protoc derives it."""
    head, *rest = proto_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def proto_name(name: str) -> str:
    """A JSON field name as a proto name (``workingDirectory`` → ``working_directory``); a proto name
    is left as it is."""
    return _UPPER.sub(lambda match: "_" + match.group(0).lower(), name)


def json_path(path: str, descriptor: Descriptor | None) -> str:
    """`path`, a proto field path into messages of type `descriptor`, with every field by its JSON name.

    Fields are looked up in the descriptors along the path (so a custom ``json_name`` is honoured);
    a segment the descriptors do not know (or below a non-message field) is converted by rule.
    """
    segments = []
    for segment in _split(path):
        match = _SEGMENT.match(segment)
        if match is None:
            segments.append(segment)
            descriptor = None
            continue
        name, selectors = match.groups()
        field = descriptor.fields_by_name.get(name) if descriptor is not None else None
        if field is None:
            segments.append(json_name(name) + selectors)
            descriptor = None
        else:
            segments.append(field.json_name + selectors)
            descriptor = field.message_type
    return ".".join(segments)


def _split(path: str) -> list[str]:
    """Split on the dots outside brackets (a map key may contain dots)."""
    segments: list[str] = []
    current: list[str] = []
    depth = 0
    for character in path:
        if character == "[":
            depth += 1
        elif character == "]":
            depth = max(depth - 1, 0)
        if character == "." and depth == 0:
            segments.append("".join(current))
            current = []
        else:
            current.append(character)
    segments.append("".join(current))
    return segments
