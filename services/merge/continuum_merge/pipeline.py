"""The seam between the operation machinery and the work it runs: snapshot, units, handoff.

The worker drives an operation through these calls and owns everything around them (leases, epochs,
claims, unit commits, publish); an implementation only reads and writes the operation's package
directory (and, for the snapshot, its sources) and says how a stage stopped with `StageStop`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

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


@dataclass(frozen=True)
class UnitSplit:
    """A unit whose request or answer did not fit: the children that replace it, covering its own
    parts in order. The worker commits the parent as split together with its children."""

    children: tuple[NewUnit, ...]
    # Why (an error class or a guard), for the log; never content.
    reason: str


class StageStop(Exception):
    """A stage cannot go on: pause (resumable by the user), fail (cancel only) or retry later by itself.

    `code` is a MergeErrorCode name; the message is shown to the user (ids and counts, never content).
    """

    def __init__(self, code: str, message: str, outcome: Literal["paused", "failed", "retry"]) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.outcome = outcome


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

    async def plan(self, package_dir: Path, model: str) -> list[NewUnit]:
        """The extraction units of the sealed snapshot (deterministic ids)."""
        ...

    async def run_unit(self, package_dir: Path, unit: Unit, model: str) -> UnitDone | UnitSplit:
        """Run one unit and rename its result into place, or say which smaller units replace it."""
        ...

    async def aggregate(self, package_dir: Path, results: Sequence[Path], model: str) -> str:
        """Build the handoff from the units' results; the hash of its ready.json."""
        ...

    async def verify_handoff(self, package_dir: Path) -> str:
        """Check the handoff against ready.json; its hash."""
        ...
