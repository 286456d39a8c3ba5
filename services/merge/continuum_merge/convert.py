"""Stored operations as API messages: one conversion for every answer and every conflict detail."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import resources_pb2 as pb
from continuum_merge.store import PROTOCOL_VERSION, Operation, UnitCounts

STATUSES = {
    "preparing": pb.MERGE_STATUS_PREPARING,
    "paused": pb.MERGE_STATUS_PAUSED,
    "failed": pb.MERGE_STATUS_FAILED,
    "completed": pb.MERGE_STATUS_COMPLETED,
    "cancelled": pb.MERGE_STATUS_CANCELLED,
}
STAGES = {
    "snapshotting": pb.MERGE_STAGE_SNAPSHOTTING,
    "extracting": pb.MERGE_STAGE_EXTRACTING,
    "aggregating": pb.MERGE_STAGE_AGGREGATING,
    "validating": pb.MERGE_STAGE_VALIDATING,
    "publishing": pb.MERGE_STAGE_PUBLISHING,
    "completed": pb.MERGE_STAGE_COMPLETED,
}
# Stages after which the set of units can no longer grow.
FINAL_UNIT_STAGES = frozenset({"aggregating", "validating", "publishing", "completed"})


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def error_code(name: str | None) -> error_code_pb2.MergeErrorCode.ValueType:
    """A stored error code as the enum (unspecified when none or unknown to the contract)."""
    if name is None or name not in error_code_pb2.MergeErrorCode.DESCRIPTOR.values_by_name:
        return error_code_pb2.MERGE_ERROR_CODE_UNSPECIFIED
    return error_code_pb2.MergeErrorCode.Value(name)


def operation_message(operation: Operation, counts: UnitCounts, now_ms: int) -> pb.MergeOperation:
    """The operation as the console shows it at `now_ms` (the locked sources are the live claim's)."""
    parameters = operation.parameters
    progress = pb.MergeProgress(
        protocol_version=PROTOCOL_VERSION,
        operation_id=operation.operation_id,
        target_session_id=operation.target_session_id,
        status=STATUSES[operation.status],
        stage=STAGES[operation.stage],
        run_epoch=operation.run_epoch,
        snapshot_sealed=operation.snapshot_hash is not None,
        locked_source_session_ids=operation.locked_roots(now_ms),
        progress=pb.MergeUnitProgress(
            completed_units=counts.completed,
            known_units=counts.known,
            total_final=operation.units_planned or operation.stage in FINAL_UNIT_STAGES,
        ),
        error_code=error_code(operation.error_code),
        error=operation.error or "",
        can_resume=operation.status == "paused",
        can_cancel=operation.status in ("preparing", "paused", "failed"),
        target_available=operation.status == "completed",
    )
    if operation.retry_ms is not None and operation.status == "preparing":
        progress.retry_time.CopyFrom(_timestamp(operation.retry_ms))
    return pb.MergeOperation(
        progress=progress,
        parameters=pb.MergeParameters(
            source_session_ids=list(parameters.source_session_ids),
            primary_session_id=parameters.primary_session_id,
            title=parameters.title,
            model=parameters.model,
        ),
        idempotency_key=operation.idempotency_key,
        create_time=_timestamp(operation.create_ms),
        update_time=_timestamp(operation.update_ms),
    )
