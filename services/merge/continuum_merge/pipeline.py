"""The seam between the operation machinery and the work it runs: snapshot, units, handoff.

The worker drives an operation through these calls and owns everything around them (leases, epochs,
claims, unit commits, publish); an implementation only reads and writes the operation's package
directory (and, for the snapshot, its sources) and says how a stage stopped with `StageStop`.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from continuum.merge.v1 import error_code_pb2
from continuum_merge.admission import TreeCut
from continuum_merge.store import NewUnit, Unit


@dataclass(frozen=True)
class Sealed:
    """A sealed snapshot as the database records it; `blocking` names saved but unreadable records."""

    version: int
    snapshot_hash: str
    blocking: tuple[str, ...] = ()


@dataclass(frozen=True)
class UnitDone:
    """A unit's result, renamed into place: its path relative to the package, hash and usage
    (None when the provider did not report it: unknown is not zero)."""

    relative_path: str
    sha256: str
    model: str
    input_tokens: int | None
    output_tokens: int | None


class StageStop(Exception):
    """A stage cannot go on: pause (resumable by the user), fail (cancel only) or retry later by itself.

    `code` is a MergeErrorCode name (empty: no code to show, e.g. a retry after an unexpected failure); the
    message is shown to the user (ids and counts, never content). A name the contract does not define is a
    bug here, not an UNSPECIFIED code in a client's progress.
    """

    def __init__(self, code: str, message: str, outcome: Literal["paused", "failed", "retry"]) -> None:
        if code and code not in error_code_pb2.MergeErrorCode.DESCRIPTOR.values_by_name:
            raise ValueError(f"{code!r} is not a MergeErrorCode")
        super().__init__(message)
        self.code = code
        self.message = message
        self.outcome = outcome


class SplitNeeded(Exception):
    """A unit's request or answer did not fit: it is replaced by `children` (deterministic ids that sort
    right after it), committed with the parent's split in one transaction."""

    def __init__(self, children: Sequence[NewUnit]) -> None:
        super().__init__(f"split into {len(children)} units")
        self.children = tuple(children)


class Pipeline(Protocol):
    """What an operation's stages do; every call may raise `StageStop`."""

    async def snapshot(
        self, owner: str, package_dir: Path, cuts: Sequence[TreeCut], version: int, failpoint: Callable[[str], None]
    ) -> Sealed:
        """Copy the sources up to their cuts and seal `<package_dir>/snapshot/` as `version`."""
        ...

    async def verify_snapshot(self, package_dir: Path) -> Sealed:
        """Check a recorded seal against its package."""
        ...

    def plan(self, package_dir: Path, model: str) -> AsyncIterator[Sequence[NewUnit]]:
        """The extraction units of the sealed snapshot (deterministic ids), in plan order, in batches of a
        bounded size (each inserted in its own transaction)."""
        ...

    async def run_unit(self, package_dir: Path, unit: Unit, model: str) -> UnitDone:
        """Run one unit and rename its result into place (`SplitNeeded` when it must be split)."""
        ...

    async def aggregate(self, package_dir: Path, results: AsyncIterable[Path], model: str) -> str:
        """Build the handoff from the units' results (in plan order, read as they come); the hash of its
        ready.json."""
        ...

    async def verify_handoff(self, package_dir: Path) -> str:
        """Check the handoff against ready.json; its hash."""
        ...
