"""The binding of a run (or a merge target) to its package, checked on every call before a byte of the
package is read.

run id -> transcript's GetRun (the caller's live RUN claim) -> its root session, which must still exist
and carry `sessionMergeOperationId` -> merge's GetHandoffBinding for that session (protocol 2, completed,
that session its target, the operation the metadata names) -> the package's handoff/ready.json, whose
sha256 must be the handoff hash merge recorded. That hash is the package version every answer and
cursor is bound to. The session is never one a model or a client chose: a run names its own.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from continuum.merge.v1 import resources_pb2 as mpb
from continuum_handoff_read.errors import BadRequest, NotBound, PackageDamaged
from continuum_handoff_read.merge_client import MergeClient
from continuum_handoff_read.transcript_client import TranscriptClient
from continuum_runtime.wire_names import merge_operation_id

# The only merge protocol whose packages this service reads.
PROTOCOL_VERSION = 2
HANDOFF_DIR = "handoff"
READY_FILE = "ready.json"
SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPERATION_ID = re.compile(r"^[a-f0-9]{32}$")
_READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Binding:
    """A verified binding: the target, its operation, and the package as ready.json describes it."""

    session_id: str
    operation_id: str
    # The configured package root: every package file is opened beneath it, component by component.
    package_root: Path
    # sha256 of handoff/ready.json (merge's handoff hash).
    package_version: str
    # ready.json, parsed: the snapshot identity, counts and every handoff file's sha256.
    ready: dict[str, Any]

    @property
    def package_dir(self) -> Path:
        """`<package root>/<operation id>`: the package the reader opens files beneath."""
        return self.package_root / self.operation_id

    def handoff_sha256(self, name: str) -> str:
        """The sha256 ready.json records for handoff file `name`; PackageDamaged when it lists none."""
        for row in self.ready.get("files", []):
            if isinstance(row, dict) and row.get("path") == name and isinstance(row.get("sha256"), str):
                return str(row["sha256"])
        raise PackageDamaged(f"ready.json does not list {name}", metadata={"operation_id": self.operation_id})


def session_id(value: str, field: str) -> str:
    """A session id as transcript accepts them."""
    if not SESSION_ID.match(value):
        raise BadRequest(field, "must be 1-64 characters of letters, digits, '-' or '_'")
    return value


def operation_id(value: str, field: str) -> str:
    """An operation id as merge issues them."""
    if not OPERATION_ID.match(value):
        raise BadRequest(field, "must be a merge operation id (32 lowercase hex digits)")
    return value


class Binder:
    """Resolves and verifies bindings through transcript and merge; reads only ready.json itself."""

    def __init__(
        self, transcript: TranscriptClient, merge: MergeClient, package_root: Path, ready_max_bytes: int
    ) -> None:
        self._transcript = transcript
        self._merge = merge
        self._package_root = package_root
        self._ready_max_bytes = ready_max_bytes

    async def for_run(self, user: str, run_id: str) -> Binding:
        """The binding of `user`'s live run `run_id`: its root session's, or HANDOFF_NOT_BOUND."""
        root = await self._transcript.run_root(user, run_id)
        session = await self._transcript.live_session(user, root)
        if session is None:
            raise NotBound("the run's session no longer exists", metadata={"run_id": run_id})
        bound = merge_operation_id(session.metadata)
        if not bound:
            raise NotBound("the run's session is not a merged session", metadata={"run_id": run_id})
        return await self._verified(user, root, bound)

    async def for_session(self, user: str, target_session_id: str, bound_operation_id: str) -> Binding:
        """The binding of a merge target whose metadata names `bound_operation_id`, or HANDOFF_NOT_BOUND."""
        session = await self._transcript.live_session(user, target_session_id)
        if session is None or merge_operation_id(session.metadata) != bound_operation_id:
            raise NotBound("the session is not a live target of that merge", metadata={"session_id": target_session_id})
        return await self._verified(user, target_session_id, bound_operation_id)

    async def _verified(self, user: str, target_session_id: str, bound_operation_id: str) -> Binding:
        found = await self._merge.binding(user, target_session_id)
        if (
            found is None
            or found.operation_id != bound_operation_id
            or found.protocol_version != PROTOCOL_VERSION
            or found.status != mpb.MERGE_STATUS_COMPLETED
            or found.target_session_id != target_session_id
            or not found.handoff_hash
        ):
            raise NotBound(
                "the session is not the target of a completed protocol-2 merge",
                metadata={"session_id": target_session_id},
            )
        # Merge issues the id; checked again all the same, since it becomes a path component.
        operation = operation_id(found.operation_id, "operation_id")
        data = await asyncio.to_thread(
            read_beneath, self._package_root, (operation, HANDOFF_DIR, READY_FILE), self._ready_max_bytes
        )
        if hashlib.sha256(data).hexdigest() != found.handoff_hash:
            raise PackageDamaged(
                "handoff/ready.json does not match the operation's handoff hash", metadata={"operation_id": operation}
            )
        try:
            ready = json.loads(data)
        except ValueError as error:
            raise PackageDamaged("handoff/ready.json is not JSON", metadata={"operation_id": operation}) from error
        if not isinstance(ready, dict):
            raise PackageDamaged("handoff/ready.json is not an object", metadata={"operation_id": operation})
        return Binding(target_session_id, operation, self._package_root, found.handoff_hash, ready)


def read_beneath(root: Path, parts: Sequence[str], max_bytes: int) -> bytes:
    """The bytes of the regular file `root/parts...`, opened component by component with O_NOFOLLOW (no
    symlink anywhere beneath `root`, the configured package root), non-blocking; PackageDamaged when a
    component is missing, a symlink or not what it should be, or the file is over `max_bytes`."""
    try:
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise PackageDamaged("the package root is not readable") from error
    try:
        for part in parts[:-1]:
            following = _open_component(part, os.O_RDONLY | os.O_DIRECTORY, directory)
            os.close(directory)
            directory = following
        handle = _open_component(parts[-1], os.O_RDONLY | os.O_NONBLOCK, directory)
    finally:
        os.close(directory)
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise PackageDamaged(f"{'/'.join(parts)} is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(handle, _READ_CHUNK)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > max_bytes:
                raise PackageDamaged(f"{'/'.join(parts)} is larger than {max_bytes} bytes")
            chunks.append(chunk)
    finally:
        os.close(handle)


def _open_component(name: str, flags: int, directory: int) -> int:
    if name in ("", ".", "..") or "/" in name:
        raise PackageDamaged("a package path names something outside the package")
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PackageDamaged(f"package path component {name} is a symlink or not a directory") from error
        if error.errno == errno.ENOENT:
            raise PackageDamaged(f"package file {name} is missing") from error
        raise
