"""Benchmark: sealing a merge snapshot of a >= 1 GiB history against the database handing out the same bytes.

The history: four root sessions, each with subtask children, holding agent turns whose tool outputs are
large (32 KiB to 512 KiB), and attachments of original bytes; loaded with COPY (messages) and the API
(sessions, attachments). The merge side is a separate process, `python -m continuum_merge.snapshot build`,
doing what the merge worker does: claim the four trees, record their cut, copy every message page by
page through transcript's gRPC API and every attachment's bytes, write raw/text/assets with hashes,
sync and seal, release the claims. It runs first on one tree (a quarter of the history) and then on all
four, to show its peak memory is flat. The baseline is the database handing out the same message
bytes and hashing them, `psql -c "COPY (SELECT ...) TO STDOUT" | sha256sum`, plus `sha256sum` over the
attachment files, timed in the same run (twice; the faster counts).

    .venv/bin/python bench/merge_snapshot.py [--database-url postgresql://postgres@host:5432/postgres]
        [--history-mib 1024]

The package is written under TMPDIR. On an ext4 without a journal, creating files just after a mass
delete on the same file system (a test run, another benchmark's cleanup) rescans the recently freed
inodes on every create and can cost most of the seal's CPU: point TMPDIR at a directory nothing was
deleted from lately (`TMPDIR=/work/benchtmp`) for figures that measure merge, not that scan.
On a virtual machine that hands freed memory back to its host (virtio-balloon free page reporting,
`/sys/module/page_reporting`), memory the guest has not held lately costs a host fault on first touch:
here writing files to tmpfs took 0.10 s per 256 MiB for the first ~2 GiB and 0.83 s per 256 MiB after,
so the last part of the whole seal (whose 2 GiB package is new memory, tmpfs or page cache) runs at
about half the speed of the first; the baseline writes nothing.

Result: value = history MiB/s of the seal, baseline = history MiB/s of COPY | sha256sum (+ attachments),
ratio = value / baseline, target: ratio >= 0.5, with rss_mib (peak RSS of the merge process, target
< 256) and rss_quarter_mib (the same at a quarter of the history); seal_cpu_seconds and
transcript_cpu_seconds are the CPU each process spent on the whole seal (on a shared machine the fair
comparison between runs, where wall times are not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

# Run as `python bench/<name>.py`: the repo root must be importable for `bench.bench_support`
# (a package path, so that mypy resolves it the same way as the interpreter does).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from bench.bench_support import (
    BENCH_USER,
    MESSAGE_COLUMNS,
    SCHEMA,
    SERVICE_TOKEN,
    BenchDatabase,
    SyntheticMessage,
    emit_result,
    libpq_url,
    log,
    parse_args,
    process_cpu_seconds,
    service_process,
    synthetic_text,
    throwaway_database,
)
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel

ROOTS = 4
CHILDREN_PER_ROOT = 7
ATTACHMENTS_PER_ROOT = 8
ATTACHMENT_BYTES = 2 * 1024 * 1024
TOOL_OUTPUT_BYTES = (32 * 1024, 512 * 1024)
SMALL_BYTES = (200, 2000)
# Tool outputs are slices of one pool of word salad (generating a GiB word by word would take minutes).
POOL_BYTES = 8 * 1024 * 1024
COPY_BATCH_ROWS = 500
TARGET_RATIO = 0.5
TARGET_RSS_MIB = 256
MIB = 1024 * 1024


def add_options(parser: argparse.ArgumentParser) -> None:
    """`--history-mib`: the size of the history (message bodies and attachments)."""
    parser.add_argument("--history-mib", type=int, default=1024, help="history size in MiB (default %(default)s)")


class Turns:
    """Agent turns of one session: user prompt, assistant calling a tool, large tool output, answer."""

    def __init__(self, rng: random.Random, pool: str, session_number: int) -> None:
        self._rng = rng
        self._pool = pool
        self._session = session_number
        self._calls = 0

    def turn(self) -> list[SyntheticMessage]:
        """The four messages of the next turn."""
        rng = self._rng
        self._calls += 1
        call_id = f"call_{self._session}_{self._calls:07d}"
        size = rng.randint(*TOOL_OUTPUT_BYTES)
        start = rng.randrange(0, len(self._pool) - size)
        call = {"tool_call_id": call_id, "name": "shell", "arguments": json.dumps({"command": "pytest -q"})}
        return [
            SyntheticMessage(pb.MESSAGE_ROLE_USER, synthetic_text(rng, rng.randint(*SMALL_BYTES)), [], "", {}),
            SyntheticMessage(pb.MESSAGE_ROLE_ASSISTANT, synthetic_text(rng, rng.randint(*SMALL_BYTES)), [call], "", {}),
            SyntheticMessage(pb.MESSAGE_ROLE_TOOL, self._pool[start : start + size], [], call_id, {"exit_code": 1}),
            SyntheticMessage(pb.MESSAGE_ROLE_ASSISTANT, synthetic_text(rng, rng.randint(*SMALL_BYTES)), [], "", {}),
        ]


def history_rows(rng: random.Random, sessions: list[str], body_bytes: int) -> Iterator[tuple[Any, ...]]:
    """MESSAGE_COLUMNS rows, a turn at a time in a random session, until `body_bytes` of bodies."""
    pool = synthetic_text(rng, POOL_BYTES)
    turns = [Turns(rng, pool, number) for number in range(len(sessions))]
    written = 0
    create_ms = int(time.time() * 1000) - 10_000_000
    while written < body_bytes:
        index = rng.randrange(len(sessions))
        for message in turns[index].turn():
            create_ms += 1
            row = message.columns(sessions[index], create_ms)
            written += int(row[MESSAGE_COLUMNS.index("body_bytes")])
            yield row


async def load_messages(database: BenchDatabase, rows: Iterator[tuple[Any, ...]]) -> int:
    """COPY the rows in batches (so the generator never sits in memory whole); the message count."""
    connection = await asyncpg.connect(database.raw_url)
    count = 0
    try:
        while batch := [row for _, row in zip(range(COPY_BATCH_ROWS), rows, strict=False)]:
            await connection.copy_records_to_table(
                "messages", schema_name=SCHEMA, columns=list(MESSAGE_COLUMNS), records=batch
            )
            count += len(batch)
        await connection.execute(f"ANALYZE {SCHEMA}.messages")
    finally:
        await connection.close()
    return count


async def upload(stub: api_grpc.TranscriptServiceStub, metadata: Any, session_id: str, data: bytes) -> str:
    """Upload attachment bytes through the API; the attachment id."""

    async def frames() -> AsyncIterator[api.UploadAttachmentRequest]:
        yield api.UploadAttachmentRequest(
            header=api.UploadAttachmentHeader(session_id=session_id, media_type="application/octet-stream")
        )
        for start in range(0, len(data), MIB):
            yield api.UploadAttachmentRequest(chunk=data[start : start + MIB])

    response: api.UploadAttachmentResponse = await stub.UploadAttachment(frames(), metadata=metadata)
    return str(response.attachment.attachment_id)


async def build_history(
    database: BenchDatabase, address: str, rng: random.Random, history_mib: int
) -> tuple[list[str], list[list[str]], int]:
    """Sessions and attachments through the API, messages with COPY; the roots, each root's sessions and
    the history's bytes (message bodies + attachment bytes)."""
    channel = open_channel(address)
    stub = api_grpc.TranscriptServiceStub(channel)
    metadata = call_metadata(SERVICE_TOKEN, BENCH_USER)
    roots: list[str] = []
    trees: list[list[str]] = []
    attachment_bytes = 0
    try:
        for number in range(ROOTS):
            root = f"bench-root-{number}"
            await stub.CreateSession(
                api.CreateSessionRequest(session_id=root, title=f"tree {number}"), metadata=metadata
            )
            tree = [root]
            for child in range(CHILDREN_PER_ROOT):
                child_id = f"{root}-sub-{child}"
                request = api.CreateSessionRequest(
                    session_id=child_id, parent_session_id=root, kind=pb.SESSION_KIND_SUBTASK
                )
                await stub.CreateSession(request, metadata=metadata)
                tree.append(child_id)
            for _ in range(ATTACHMENTS_PER_ROOT):
                data = rng.randbytes(ATTACHMENT_BYTES)
                attachment_id = await upload(stub, metadata, root, data)
                reference = pb.ContentPart(attachment=pb.AttachmentReference(attachment_id=attachment_id))
                message = pb.NewMessage(role=pb.MESSAGE_ROLE_USER, content=[pb.ContentPart(text="the log"), reference])
                await stub.AppendMessages(
                    api.AppendMessagesRequest(session_id=root, messages=[message]), metadata=metadata
                )
                attachment_bytes += len(data)
            roots.append(root)
            trees.append(tree)
    finally:
        await channel.close()
    sessions = [session for tree in trees for session in tree]
    log(f"{len(sessions)} sessions, {attachment_bytes // MIB} MiB of attachments; loading messages with COPY ...")
    started = time.perf_counter()
    count = await load_messages(database, history_rows(rng, sessions, history_mib * MIB - attachment_bytes))
    body_bytes = await fetch_body_bytes(database, sessions)
    log(f"loaded {count:,} messages ({body_bytes / MIB:.0f} MiB of bodies) in {time.perf_counter() - started:.1f}s")
    return roots, trees, body_bytes + attachment_bytes


async def fetch_body_bytes(database: BenchDatabase, sessions: list[str]) -> int:
    """The bytes of message bodies of `sessions` as transcript counts them."""
    connection = await asyncpg.connect(database.raw_url)
    try:
        total = await connection.fetchval(
            f"SELECT sum(body_bytes) FROM {SCHEMA}.messages WHERE session_id = ANY($1::text[])", sessions
        )
    finally:
        await connection.close()
    return int(total or 0)


def baseline_seconds(database: BenchDatabase, sessions: list[str], attachments_dir: Path) -> float:
    """Wall time of the database handing out the sessions' messages through COPY, hashed by sha256sum,
    plus sha256sum over the attachment files."""
    listed = ", ".join(f"'{session}'" for session in sessions)
    query = (
        f"COPY (SELECT message_id, session_id, role, content, tool_calls, tool_call_id, metadata, status"
        f" FROM {SCHEMA}.messages WHERE session_id IN ({listed}) ORDER BY session_id, message_id) TO STDOUT"
    )
    files = [str(path) for path in attachments_dir.rglob("*") if path.is_file() and path.parent.name != "incoming"]
    started = time.perf_counter()
    psql = subprocess.Popen(["psql", libpq_url(database.raw_url), "-X", "-q", "-c", query], stdout=subprocess.PIPE)
    digest = subprocess.run(["sha256sum"], stdin=psql.stdout, capture_output=True, check=True)
    if psql.stdout is not None:
        psql.stdout.close()
    if psql.wait() != 0 or not digest.stdout:
        raise RuntimeError("the COPY baseline failed")
    subprocess.run(["sha256sum", *files], capture_output=True, check=True)
    return time.perf_counter() - started


async def seal(address: str, package_dir: Path, roots: list[str]) -> dict[str, Any]:
    """`python -m continuum_merge.snapshot build` as its own process; its JSON line (seconds, peak RSS)."""
    env = {**os.environ, "MERGE_SERVICE_TOKEN": SERVICE_TOKEN}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "continuum_merge.snapshot", "build", "--transcript", address, "--user", BENCH_USER,
        "--package-dir", str(package_dir), "--disk-reserve-bytes", str(MIB * 1024), *roots,
        env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the snapshot process failed ({process.returncode})")
    result: dict[str, Any] = json.loads(stdout.decode().splitlines()[-1])
    return result


def describe(sealed: dict[str, Any]) -> str:
    """A progress line about one seal."""
    return f"{sealed['seconds']:.2f}s ({sealed['cpu_seconds']:.1f} s CPU), peak RSS {sealed['peak_rss_mib']} MiB"


def verify_seconds(package_dir: Path) -> float:
    """Wall time of `python -m continuum_merge.snapshot verify` over the sealed package."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "continuum_merge.snapshot", "verify", str(package_dir)], capture_output=True, check=True
    )
    return time.perf_counter() - started


async def run(admin_url: str, seed: int, history_mib: int) -> dict[str, Any]:
    """The whole benchmark in its own database and a temporary package root; returns the result fields."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="continuum-bench-merge-") as scratch:
        packages = Path(scratch) / "packages"
        attachments_dir = Path(scratch) / "attachments"
        env = {
            "TRANSCRIPT_DATA_DIR": "{data_dir}",
            "TRANSCRIPT_ATTACHMENTS_DIR": str(attachments_dir),
            "TRANSCRIPT_PORT": "0",
            "TRANSCRIPT_SERVICE_TOKEN": SERVICE_TOKEN,
            "TRANSCRIPT_LOG_LEVEL": "WARNING",
        }
        async with throwaway_database(admin_url) as database:
            env["TRANSCRIPT_DATABASE_URL"] = database.service_url
            async with service_process(("continuum_transcript", "serve"), "transcript", env) as transcript:
                address = f"127.0.0.1:{transcript.port}"
                roots, trees, history_bytes = await build_history(database, address, rng, history_mib)
                sessions = [session for tree in trees for session in tree]
                log("baseline: COPY | sha256sum (+ sha256sum of the attachments) ...")
                first = baseline_seconds(database, sessions, attachments_dir)
                log(f"  {first:.2f}s; sealing a quarter (one tree) ...")
                quarter = await seal(address, packages / "op-quarter", roots[:1])
                log(f"  {describe(quarter)}")
                log("sealing all four trees ...")
                serving = process_cpu_seconds(transcript.pid)
                whole = await seal(address, packages / "op-whole", roots)
                serving = process_cpu_seconds(transcript.pid) - serving
                log(f"  {describe(whole)}; transcript {serving:.1f} s CPU")
                log("baseline again ...")
                second = baseline_seconds(database, sessions, attachments_dir)
                log(f"  {second:.2f}s; verifying the sealed package ...")
                verified = verify_seconds(packages / "op-whole")
                log(f"  {verified:.2f}s")
        shutil.rmtree(packages, ignore_errors=True)
    history = history_bytes / MIB
    baseline = min(first, second)
    return {
        "value": history / whole["seconds"],
        "baseline": history / baseline,
        "valid": whole["peak_rss_mib"] < TARGET_RSS_MIB,
        "rss_mib": whole["peak_rss_mib"],
        "rss_quarter_mib": quarter["peak_rss_mib"],
        "history_mib": round(history, 1),
        "package_mib": round(whole["byte_count"] / MIB, 1),
        "records": whole["record_count"],
        "seal_seconds": whole["seconds"],
        "seal_cpu_seconds": whole["cpu_seconds"],
        "transcript_cpu_seconds": round(serving, 3),
        "baseline_seconds": round(baseline, 3),
        "verify_seconds": round(verified, 3),
    }


def main() -> None:
    """Run, then print the JSON result as the last line (after the database is dropped)."""
    args = parse_args((__doc__ or "").splitlines()[0], add_options)
    result = asyncio.run(run(args.database_url, args.seed, args.history_mib))
    emit_result(
        metric="merge_snapshot_seal_throughput_vs_copy_sha256sum",
        target=TARGET_RATIO,
        unit="MiB/s",
        higher_is_better=True,
        **result,
    )


if __name__ == "__main__":
    main()
