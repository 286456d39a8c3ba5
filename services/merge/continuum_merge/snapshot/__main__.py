"""Operator entry points of the snapshot package (also what the benchmark and the memory test run as the
merge process):

    python -m continuum_merge.snapshot verify <package dir>
    python -m continuum_merge.snapshot build --transcript HOST:PORT --user USER --package-dir DIR
        [--version N] [--disk-reserve-bytes B] ROOT_SESSION_ID...

`build` does what the merge worker does around the copy: it takes transcript's MERGE claims on every
root's tree (all or nothing; renewed while it copies), records each tree's cut, seals the package and
releases the claims. The service token comes from MERGE_SERVICE_TOKEN. Each command prints one JSON
line: the sealed snapshot, with the wall and CPU seconds it took and the process's peak RSS in MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path

from google.protobuf import duration_pb2

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_merge.snapshot.build import build_snapshot
from continuum_merge.snapshot.errors import SnapshotError
from continuum_merge.snapshot.layout import SealedSnapshot
from continuum_merge.snapshot.reader import TranscriptSourceReader, capture_cut
from continuum_merge.snapshot.verify import verify_snapshot
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.process_memory import peak_rss_bytes

CLAIM_TTL_SECONDS = 60
CLAIM_RENEW_SECONDS = 20
CALL_TIMEOUT_SECONDS = 120.0


def _report(sealed: SealedSnapshot, seconds: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = {
        **asdict(sealed),
        "seconds": round(seconds, 3),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
        "peak_rss_mib": round(peak_rss_bytes(os.getpid()) / 2**20, 1),
    }
    sys.stdout.write(json.dumps(line) + "\n")


async def _renew(stub: api_grpc.TranscriptServiceStub, metadata: tuple[tuple[str, str], ...], claim_id: str) -> None:
    while True:
        await asyncio.sleep(CLAIM_RENEW_SECONDS)
        await stub.RenewClaims(
            api.RenewClaimsRequest(claim_id=claim_id, ttl=duration_pb2.Duration(seconds=CLAIM_TTL_SECONDS)),
            metadata=metadata,
            timeout=CALL_TIMEOUT_SECONDS,
        )


async def _build(arguments: argparse.Namespace) -> SealedSnapshot:
    metadata = call_metadata(os.environ.get("MERGE_SERVICE_TOKEN", ""), arguments.user)
    channel = open_channel(arguments.transcript)
    stub = api_grpc.TranscriptServiceStub(channel)
    try:
        claim = await stub.AcquireClaims(
            api.AcquireClaimsRequest(
                session_ids=arguments.roots,
                kind=tpb.CLAIM_KIND_MERGE,
                holder=f"snapshot-cli-{os.getpid()}",
                ttl=duration_pb2.Duration(seconds=CLAIM_TTL_SECONDS),
            ),
            metadata=metadata,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        claim_id = claim.claim.claim_id
        renewing = asyncio.create_task(_renew(stub, metadata, claim_id))
        try:
            reader = TranscriptSourceReader(stub, metadata, CALL_TIMEOUT_SECONDS)
            cuts = [await capture_cut(reader, root) for root in arguments.roots]
            return await build_snapshot(
                reader,
                cuts,
                arguments.package_dir,
                version=arguments.version,
                disk_reserve_bytes=arguments.disk_reserve_bytes,
            )
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            await stub.ReleaseClaims(
                api.ReleaseClaimsRequest(claim_id=claim_id), metadata=metadata, timeout=CALL_TIMEOUT_SECONDS
            )
    finally:
        await channel.close()


def main(argv: list[str] | None = None) -> int:
    """Run one command; 0 on success, 1 with a one-line reason on stderr when the package or a source
    refuses."""
    parser = argparse.ArgumentParser(prog="python -m continuum_merge.snapshot")
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check a sealed package against its own hashes")
    verify.add_argument("package_dir", type=Path)
    build = commands.add_parser("build", help="claim source trees, copy them up to their cut and seal")
    build.add_argument("--transcript", required=True, help="host:port of transcript")
    build.add_argument("--user", required=True, help="the user who owns the sources")
    build.add_argument("--package-dir", type=Path, required=True, help="<package root>/<operation id>")
    build.add_argument("--version", type=int, default=1)
    build.add_argument("--disk-reserve-bytes", type=int, default=1024**3)
    build.add_argument("roots", nargs="+", help="root session ids")
    arguments = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if arguments.command == "verify":
            sealed = verify_snapshot(arguments.package_dir)
        else:
            sealed = asyncio.run(_build(arguments))
    except SnapshotError as error:
        sys.stderr.write(f"{type(error).__name__}: {error}\n")
        return 1
    _report(sealed, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
