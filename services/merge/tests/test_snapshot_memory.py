"""The snapshot's command-line entry as its own process. The copy streams: sealing four times the history
(claiming, cutting, copying and sealing as the worker does) takes about the same peak memory, far below
the history's size. `verify` answers the seal or why the package is damaged."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from google.protobuf import duration_pb2
from snapshot_testing import Sources, running_sources, text_message
from transcript_testing import SERVICE_TOKEN

import continuum_merge
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_merge.snapshot import verify_snapshot, writer

MIB = 1024 * 1024
OUTPUT_BYTES = 256 * 1024
# Where continuum_merge is imported from, for the child process.
MERGE_PATH = str(Path(continuum_merge.__file__).resolve().parents[1])
# Peak RSS may differ between the two runs by what the writer lets the allocator keep before it trims
# (either run may peak just before a trim) and by allocator noise, never by the history's growth. The
# whole history is large enough that holding a quarter of what it adds to the quarter's would reach that.
FLAT_MIB = writer.TRIM_SLACK_BYTES // MIB + 16
WHOLE_MIB = 256
# Well below the history's size: the copy streams (what the process holds after a trim, ~90 MiB, plus
# the slack and the pages in flight).
PEAK_MIB = 160


async def _history(sources: Sources, root: str, mib: int) -> None:
    """A root and a subtask child holding `mib` MiB of tool outputs in turns, plus a 4 MiB attachment."""
    await sources.session(root)
    child = await sources.session(f"{root}-sub", parent=root, kind=tpb.SESSION_KIND_SUBTASK)
    attachment = await sources.upload(root, os.urandom(4 * MIB), "application/octet-stream")
    reference = tpb.ContentPart(attachment=tpb.AttachmentReference(attachment_id=attachment))
    await sources.append(
        root, tpb.NewMessage(role=tpb.MESSAGE_ROLE_USER, content=[tpb.ContentPart(text="see the log"), reference])
    )
    turns = mib * MIB // OUTPUT_BYTES // 2
    for turn in range(0, turns, 8):
        for session in (root, child):
            batch: list[tpb.NewMessage] = []
            for number in range(turn, min(turn + 8, turns)):
                call = f"call-{number}"
                output = (f"line {number} " * (OUTPUT_BYTES // 6))[:OUTPUT_BYTES]
                batch.append(
                    tpb.NewMessage(
                        role=tpb.MESSAGE_ROLE_ASSISTANT, tool_calls=[tpb.ToolCall(tool_call_id=call, name="shell")]
                    )
                )
                batch.append(text_message(tpb.MESSAGE_ROLE_TOOL, output, tool_call_id=call))
            await sources.append(session, *batch)


async def _command(*arguments: str) -> tuple[int, str, str]:
    """`python -m continuum_merge.snapshot ...` as its own process: exit code, stdout, stderr."""
    env = {
        **os.environ,
        "MERGE_SERVICE_TOKEN": SERVICE_TOKEN,
        "PYTHONPATH": os.pathsep.join([MERGE_PATH, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "continuum_merge.snapshot", *arguments,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def _seal_in_process(sources: Sources, root: str, package: Path) -> dict[str, Any]:
    """`build` as its own process; its JSON line."""
    code, stdout, stderr = await _command(
        "build", "--transcript", f"127.0.0.1:{sources.client.service.port}", "--user", "alice",
        "--package-dir", str(package), "--disk-reserve-bytes", "0", root,
    )  # fmt: skip
    assert code == 0, stderr[-2000:]
    result: dict[str, Any] = json.loads(stdout.splitlines()[-1])
    return result


async def test_peak_memory_is_flat_in_the_history_size(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await _history(sources, "quarter", WHOLE_MIB // 4)
        await _history(sources, "whole", WHOLE_MIB)
        quarter = await _seal_in_process(sources, "quarter", tmp_path / "packages" / "op-quarter")
        whole = await _seal_in_process(sources, "whole", tmp_path / "packages" / "op-whole")

    assert whole["byte_count"] > 3 * quarter["byte_count"]
    assert whole["byte_count"] > 2 * WHOLE_MIB * MIB  # raw and text of every output, and the asset
    sealed = verify_snapshot(tmp_path / "packages" / "op-whole")
    assert sealed.snapshot_hash == whole["snapshot_hash"]
    measured = f"peak RSS {quarter['peak_rss_mib']} MiB at a quarter, {whole['peak_rss_mib']} MiB whole"
    assert whole["peak_rss_mib"] < quarter["peak_rss_mib"] + FLAT_MIB, measured
    assert whole["peak_rss_mib"] < PEAK_MIB, measured


async def test_verify_command_answers_the_seal_or_the_damage(tmp_path: Path, database_url: str) -> None:
    async with running_sources(tmp_path, database_url) as sources:
        await sources.session("a")
        await sources.append("a", text_message(tpb.MESSAGE_ROLE_USER, "hello"))
        package = tmp_path / "packages" / "op"
        sealed = await _seal_in_process(sources, "a", package)
        # The command released its claims: another holder can claim the tree at once.
        claimed = await sources.client.stub.AcquireClaims(
            api.AcquireClaimsRequest(
                session_ids=["a"], kind=tpb.CLAIM_KIND_RUN, holder="run-1", ttl=duration_pb2.Duration(seconds=10)
            ),
            metadata=sources.user,
        )
        assert list(claimed.claim.root_session_ids) == ["a"]

    code, stdout, _ = await _command("verify", str(package))
    assert code == 0 and json.loads(stdout)["snapshot_hash"] == sealed["snapshot_hash"]
    (package / "snapshot" / "gaps.jsonl").write_bytes(b"{}\n")
    code, stdout, stderr = await _command("verify", str(package))
    assert (code, stdout) == (1, "")
    assert stderr.startswith("PackageDamaged: ") and "gaps.jsonl" in stderr
