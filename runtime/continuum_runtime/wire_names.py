"""Names values have on the wire, read from the contracts: the `wire_name` option of an enum value
(continuum.capability.v1), and the protocol capabilities' names.

The names live in the proto, so every client, in any language, reads them from the same place: the
capabilities (`Capability`), merge's session metadata key (`merge.v1.MergeName`) and handoff-read's tool
name (`handoff_read.v1.HandoffReadName`). This module only looks them up.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2

from continuum.capability.v1 import capability_pb2 as cpb
from continuum.handoff_read.v1 import handoff_read_service_pb2 as hpb
from continuum.merge.v1 import resources_pb2 as mpb


def wire_name(enum: Any, value: int) -> str:
    """The name `value` of the generated enum `enum` has on the wire (e.g. "transcript-v2")."""
    described = enum.DESCRIPTOR.values_by_number[value]
    name: str = described.GetOptions().Extensions[cpb.wire_name]
    if not name:
        raise ValueError(f"{described.name} has no wire name")
    return name


TRANSCRIPT_V2 = wire_name(cpb.Capability, cpb.CAPABILITY_TRANSCRIPT_V2)
HISTORY_OUTLINE_V1 = wire_name(cpb.Capability, cpb.CAPABILITY_HISTORY_OUTLINE_V1)
COMPACTION_V1 = wire_name(cpb.Capability, cpb.CAPABILITY_COMPACTION_V1)
MERGE_V2 = wire_name(cpb.Capability, cpb.CAPABILITY_MERGE_V2)
AGENT_V1 = wire_name(cpb.Capability, cpb.CAPABILITY_AGENT_V1)

# The key of a merge target's session metadata naming its merge operation.
MERGE_OPERATION_METADATA_KEY = wire_name(mpb.MergeName, mpb.MERGE_NAME_OPERATION_METADATA_KEY)
# The HandoffRead tool's name.
HANDOFF_READ_TOOL = wire_name(hpb.HandoffReadName, hpb.HANDOFF_READ_NAME_TOOL)


def merge_operation_id(metadata: struct_pb2.Struct) -> str:
    """The merge operation a session's metadata names (MERGE_OPERATION_METADATA_KEY); empty for an
    ordinary session."""
    field = metadata.fields.get(MERGE_OPERATION_METADATA_KEY)
    if field is None or field.WhichOneof("kind") != "string_value":
        return ""
    return field.string_value
