"""The contracts carry their own vocabulary: error reasons and capability names come from the protos."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from continuum.agent.v1 import error_reason_pb2 as agent_reasons
from continuum.capability.v1 import capability_pb2
from continuum.compaction.v1 import error_reason_pb2 as compaction_reasons
from continuum.gateway.v1 import error_reason_pb2 as gateway_reasons
from continuum.handoff_read.v1 import error_reason_pb2 as handoff_read_reasons
from continuum.merge.v1 import error_reason_pb2 as merge_reasons
from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum_agent import errors as agent_errors
from continuum_compaction import errors as compaction_errors
from continuum_handoff_read import errors as handoff_read_errors
from continuum_merge import errors as merge_errors
from continuum_runtime import wire_names
from continuum_runtime.errors import ServiceError
from continuum_transcript import errors as transcript_errors

ROOT = Path(__file__).resolve().parents[1]


def _subclasses(root: type[ServiceError]) -> list[type[ServiceError]]:
    found, pending = [], [root]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize(
    ("root", "enum"),
    [
        (transcript_errors.TranscriptError, transcript_reasons.ErrorReason),
        (compaction_errors.CompactionError, compaction_reasons.ErrorReason),
        (agent_errors.AgentError, agent_reasons.ErrorReason),
        (merge_errors.MergeError, merge_reasons.ErrorReason),
        (handoff_read_errors.HandoffReadError, handoff_read_reasons.ErrorReason),
    ],
    ids=["transcript", "compaction", "agent", "merge", "handoff-read"],
)
def test_every_service_error_reason_is_a_value_of_the_service_enum(root: type[ServiceError], enum: object) -> None:
    reasons = {cls.reason for cls in _subclasses(root)}
    assert reasons <= set(enum.keys())  # type: ignore[attr-defined]
    assert len(reasons) > 3


def test_a_reason_outside_the_enum_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match="NOT_A_REASON"):

        class Invented(transcript_errors.TranscriptError):
            reason = "NOT_A_REASON"


def test_every_reason_the_gateway_writes_is_a_value_of_its_enum() -> None:
    written: set[str] = set()
    for path in (ROOT / "gateway" / "continuum_gateway").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "reason" and isinstance(node.value, ast.Constant):
                written.add(str(node.value.value))
            if isinstance(node, ast.Tuple) and any(
                isinstance(e, ast.Constant) and str(e.value).startswith("UPSTREAM_") for e in node.elts
            ):
                written |= {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    written = {reason for reason in written if reason.isupper()}
    assert {"INVALID_JSON", "UPSTREAM_UNAVAILABLE", "UPSTREAM_REFUSED"} <= written
    assert written <= set(gateway_reasons.ErrorReason.keys())


def test_capability_names_come_from_the_contract() -> None:
    values = capability_pb2.Capability.values()
    names = {
        wire_names.wire_name(capability_pb2.Capability, value)
        for value in values
        if value != capability_pb2.CAPABILITY_UNSPECIFIED
    }
    assert names == {"transcript-v2", "history-outline-v1", "compaction-v1", "merge-v2", "agent-v1"}
    assert wire_names.TRANSCRIPT_V2 == "transcript-v2"
    with pytest.raises(ValueError, match="no wire name"):
        wire_names.wire_name(capability_pb2.Capability, capability_pb2.CAPABILITY_UNSPECIFIED)


def test_the_merge_metadata_key_and_the_tool_name_come_from_the_contracts() -> None:
    assert wire_names.MERGE_OPERATION_METADATA_KEY == "sessionMergeOperationId"
    assert wire_names.HANDOFF_READ_TOOL == "HandoffRead"
    # Spelled in no other Python: every component reads them from the contracts through wire_names (the
    # console's JavaScript, which reads no contract, names the metadata key itself).
    root = Path(__file__).resolve().parent.parent
    spelled = [
        path
        for tree in ("services", "agent", "gateway", "clients", "runtime")
        for path in (root / tree).rglob("*.py")
        if "/tests/" not in str(path)
        and ('"sessionMergeOperationId"' in path.read_text() or '"HandoffRead"' in path.read_text())
    ]
    assert spelled == []
