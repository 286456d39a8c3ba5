"""A merge through `continuum up` as a newcomer runs it: sessions made through the gateway, merged by the
merge process with the real stages and the built-in offline provider, the package kept private in the
data dir; then the operator's `continuum cleanup merge` against that run."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from deadline_testing import wait_for
from test_e2e_up import COMMAND_TIMEOUT, Run, create_session, operator_command, run

from continuum.merge.v1 import merge_service_pb2 as merge_api
from continuum.merge.v1 import merge_service_pb2_grpc as merge_grpc
from continuum.merge.v1 import resources_pb2 as merge_pb
from continuum_runtime.auth import call_metadata

pytestmark = pytest.mark.e2e

__all__ = ["run"]


def test_up_merges_two_sessions_into_a_private_package_and_cleanup_merge_runs(run: Run, tmp_path: Path) -> None:
    with run.gateway() as client:
        first = create_session(client, "first", ("we chose PostgreSQL", "tests run on both backends"))
        second = create_session(client, "second", ("the gateway relays merges",))
        token = (run.data_dir / "service-token").read_text().strip()
        metadata = call_metadata(token, "dev")
        with grpc.insecure_channel(f"127.0.0.1:{run.port('merge')}", options=[("grpc.enable_http_proxy", 0)]) as ch:
            stub = merge_grpc.MergeServiceStub(ch)
            started = stub.StartMerge(
                merge_api.StartMergeRequest(
                    source_session_ids=[first, second], primary_session_id=first, idempotency_key="e2e"
                ),
                metadata=metadata,
            )
            operation_id = started.operation.progress.operation_id

            def completed() -> bool:
                progress = stub.GetMerge(merge_api.GetMergeRequest(operation_id=operation_id), metadata=metadata)
                status = progress.operation.progress.status
                assert status in (merge_pb.MERGE_STATUS_PREPARING, merge_pb.MERGE_STATUS_COMPLETED), progress
                return bool(status == merge_pb.MERGE_STATUS_COMPLETED)

            wait_for(completed, what="the merge to complete", seconds=COMMAND_TIMEOUT, diagnostics=run.diagnostics)
            target = stub.GetMerge(merge_api.GetMergeRequest(operation_id=operation_id), metadata=metadata)
        merged = client.get(f"/v1/sessions/{target.operation.progress.target_session_id}")
        assert merged.is_success, merged.text

    package = run.data_dir / "merge-packages" / operation_id
    assert json.loads((package / "snapshot" / "seal.json").read_text())["version"] == 1
    assert (package / "handoff" / "ready.json").is_file()
    loose = {
        str(path.relative_to(package)): oct(path.stat().st_mode & 0o777)
        for path in [package.parent, *package.rglob("*")]
        if path.stat().st_mode & 0o077
    }
    assert loose == {}, "the package is readable by other users"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cleanup = operator_command(run, ["cleanup", "merge", "--data-dir", str(run.data_dir)], cwd=elsewhere)
    assert run.operator_processes[-1].wait(timeout=COMMAND_TIMEOUT) == 0, cleanup.read_text() + run.diagnostics()
    assert "checked 1 package(s); removed 0" in cleanup.read_text()
    assert package.is_dir()
    run.stop()
