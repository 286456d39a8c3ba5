"""The wire names of the protocol capabilities, read from the contract (continuum.capability.v1).

The names live in the proto as the `wire_name` option of each `Capability` value, so every client,
in any language, reads them from the same place; this module only looks them up once.
"""

from __future__ import annotations

from continuum.capability.v1 import capability_pb2 as cpb


def wire_name(capability: cpb.Capability.ValueType) -> str:
    """The name peers exchange for `capability` (e.g. "transcript-v2")."""
    value = cpb.Capability.DESCRIPTOR.values_by_number[capability]
    name: str = value.GetOptions().Extensions[cpb.wire_name]
    if not name:
        raise ValueError(f"capability {value.name} has no wire name")
    return name


TRANSCRIPT_V2 = wire_name(cpb.CAPABILITY_TRANSCRIPT_V2)
HISTORY_OUTLINE_V1 = wire_name(cpb.CAPABILITY_HISTORY_OUTLINE_V1)
COMPACTION_V1 = wire_name(cpb.CAPABILITY_COMPACTION_V1)
MERGE_V2 = wire_name(cpb.CAPABILITY_MERGE_V2)
AGENT_V1 = wire_name(cpb.CAPABILITY_AGENT_V1)
