"""A scripted stand-in for the merge stages (importable as `pipeline_testing`), to drive the worker's
machinery: leases, epochs, claims, the unit commit protocol and the publish saga.

It writes real files in the operation's package directory (a seal, one result per unit, a ready
file) with the same commit rules the stages follow (tmp + rename, hashes recorded), can hold a unit's
call at a gate, and can stop a stage once. The real snapshot and extraction stages have their own tests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from continuum_merge.admission import TreeCut
from continuum_merge.pipeline import Sealed, SplitNeeded, StageStop, UnitDone
from continuum_merge.store import NewUnit, Unit

PROCESSOR = "scripted-1"


def _write(path: Path, body: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".tmp")
    scratch.write_bytes(body)
    scratch.replace(path)
    return hashlib.sha256(body).hexdigest()


def _hash(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@dataclass
class ScriptedPipeline:
    """`units` extraction units; `stops` maps a stage name to the StageStop it raises once."""

    units: int = 3
    stops: dict[str, StageStop] = field(default_factory=dict)
    # Unit ids whose first call waits until the test sets the event.
    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    calls: Counter[str] = field(default_factory=Counter)
    snapshots: list[tuple[str, int, tuple[TreeCut, ...]]] = field(default_factory=list)
    # Unit ids that do not fit: their first call asks for two halves instead.
    splits: set[str] = field(default_factory=set)

    def _maybe_stop(self, stage: str) -> None:
        stop = self.stops.pop(stage, None)
        if stop is not None:
            raise stop

    async def snapshot(
        self, owner: str, package_dir: Path, cuts: Sequence[TreeCut], version: int, failpoint: Callable[[str], None]
    ) -> Sealed:
        self.calls["snapshot"] += 1
        self._maybe_stop("snapshot")
        self.snapshots.append((owner, version, tuple(cuts)))
        body = json.dumps({"version": version, "cuts": [cut.last_message_ids for cut in cuts]}).encode()
        return Sealed(version, _write(package_dir / "snapshot" / "seal.json", body))

    async def verify_snapshot(self, package_dir: Path) -> Sealed:
        self.calls["verify_snapshot"] += 1
        seal = package_dir / "snapshot" / "seal.json"
        found = _hash(seal)
        if found is None:
            raise StageStop("PACKAGE_DAMAGED", "seal.json is missing", "paused")
        return Sealed(json.loads(seal.read_text())["version"], found)

    async def plan(self, package_dir: Path, model: str) -> AsyncIterator[Sequence[NewUnit]]:
        self.calls["plan"] += 1
        # Batches of two, as the stages hand over a long plan in bounded batches.
        for start in range(0, self.units, 2):
            yield [
                NewUnit(f"unit-{index}", "extracting", index, f"{index:064x}", "{}", PROCESSOR, model)
                for index in range(start, min(start + 2, self.units))
            ]

    async def run_unit(self, package_dir: Path, unit: Unit, model: str) -> UnitDone:
        self.calls[unit.unit_id] += 1
        self._maybe_stop(unit.unit_id)
        if unit.unit_id in self.splits:
            self.splits.discard(unit.unit_id)
            raise SplitNeeded(
                [
                    NewUnit(
                        f"{unit.unit_id}.{half}", "extracting", unit.ordinal, f"{half:064x}", "{}", PROCESSOR, model
                    )
                    for half in (0, 1)
                ]
            )
        gate = self.holds.pop(unit.unit_id, None)
        if gate is not None:
            self.waiting.add(unit.unit_id)
            await gate.wait()
        relative = f"work/{unit.unit_id}.json"
        digest = _write(package_dir / relative, json.dumps({"unit": unit.unit_id, "model": model}).encode())
        return UnitDone(relative, digest, model, 10, None)

    async def aggregate(self, package_dir: Path, results: AsyncIterable[Path], model: str) -> str:
        self.calls["aggregate"] += 1
        self._maybe_stop("aggregate")
        listed = {path.name: _hash(path) async for path in results}
        return _write(package_dir / "handoff" / "ready.json", json.dumps(listed, sort_keys=True).encode())

    async def verify_handoff(self, package_dir: Path) -> str:
        self.calls["verify_handoff"] += 1
        found = _hash(package_dir / "handoff" / "ready.json")
        if found is None:
            raise StageStop("PACKAGE_DAMAGED", "ready.json is missing", "paused")
        return found
