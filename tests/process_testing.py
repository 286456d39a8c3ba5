"""Services as killable processes (importable as `process_testing`)."""

from __future__ import annotations

import asyncio
import os
import sys
from asyncio.subprocess import Process
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from deadline_testing import eventually


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def runs(pid: int, marker: bytes) -> bool:
    """True while `pid` is alive and its command line contains `marker` (guards against a reused pid)."""
    try:
        return alive(pid) and marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False  # it exited between the two reads


def children_of(parent: int) -> set[int]:
    """Live processes whose parent is `parent`."""
    found = set()
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.add(int(stat_path.parent.name))
    return found


def service_log(data_dir: Path, name: str) -> Path:
    """The file a service's JSON log lines go to, beside its data, for diagnosing a failed test."""
    return data_dir / f"{name}.log"


def _open_service_log(data_dir: Path, name: str) -> BinaryIO:
    data_dir.mkdir(parents=True, exist_ok=True)
    return open(service_log(data_dir, name), "ab")


async def serve_module(module: str, name: str, data_dir: Path, env: Mapping[str, str]) -> tuple[Process, int]:
    """`python -m <module> serve` as its own process (so a test can kill it), and its bound port.

    `env` adds to this process's environment; the service publishes its port in
    `<data_dir>/run/<name>.port`, which must be the data directory `env` gives it.
    """
    port_file = data_dir / "run" / f"{name}.port"
    port_file.unlink(missing_ok=True)
    with _open_service_log(data_dir, name) as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, "serve", env={**os.environ, **env}, stderr=log
        )
    try:
        await eventually(port_file.exists, what=f"{module} to start (its port file)", seconds=20, interval=0.05)
    except AssertionError:
        process.kill()
        await process.wait()
        raise
    return process, int(port_file.read_text())
