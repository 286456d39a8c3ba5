"""Aggregation: every unit's items kept as details, condensed layer by layer into a bounded brief.

``handoff/`` is built in ``handoff.staging/`` and renamed into place once every file is written and
synced, so it is either absent or whole. Its files:

- ``details/<unit id>.json``: each unit's checked result, byte for byte (details are never replaced);
  ``text/<unit id>.txt``: the same items as readable lines; ``details.jsonl``: one line per unit with
  both paths, their sha256 and the unit's counts.
- ``layers/<n>.jsonl``: the condensed items of layer n (evidence: item ids of the layer below; layer 1
  cites detail items), so every brief item can be followed down to the original parts.
- ``overview.json``: counts by section, status and source, the number of gaps, and the entry to the details.
- ``brief.json``: the bounded brief; ``handoff.md``: the readable entry the target session starts from.
- ``ready.json``: the snapshot identity, the processor version and every other file's sha256; its own
  sha256 is the handoff hash the operation records.

Each layer packs the items of the one below under the request budget and sends the packs serially; a
layer must shrink (estimated tokens), else the brief becomes the deterministic navigation (counts and
entries to the details) instead of summarising the same content again. A pack whose request or answer
does not fit (or stays invalid) is bisected like a unit, down to a pack of one item.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from continuum_merge.extraction.budget import CallPolicy
from continuum_merge.extraction.errors import HandoffDamaged, PackageUnreadable, StorageShort
from continuum_merge.extraction.package import (
    HANDOFF_DIR,
    SNAPSHOT_DIR,
    STORAGE_ERRNOS,
    WORK_DIR,
    file_sha256,
    fsync_dir,
    iter_jsonl,
    snapshot_identity,
    write_atomic,
)
from continuum_merge.extraction.plan import UnitBudget
from continuum_merge.extraction.prompts import condense_request
from continuum_merge.extraction.schema import SCHEMA_VERSION, SECTIONS, STATUSES
from continuum_merge.extraction.unit import RESULT_KIND, SHRINKABLE, CallHook, ask_items, item_id
from continuum_runtime.provider import ModelProvider
from continuum_runtime.provider.tokens import estimate_tokens

__all__ = ["BRIEF_TOKENS", "HandoffReady", "aggregate", "verify_handoff"]

# The brief's target in estimated tokens (issue 10's default).
BRIEF_TOKENS = 2_048
# What a layer shows of one item below it: a bounded excerpt (the whole item stays in its file).
EXCERPT_CHARS = 600
NOT_RECORDED = "Not recorded."
_STAGING = "handoff.staging"
# The files every handoff has, each listed with its sha256 in ready.json.
_ENTRY_FILES = ("details.jsonl", "overview.json", "brief.json", "handoff.md")


@dataclass(frozen=True)
class HandoffReady:
    """A complete handoff, as ready.json describes it."""

    # sha256 of ready.json: what the operation records and publish checks.
    handoff_hash: str
    snapshot_hash: str
    processor_version: str
    unit_count: int
    item_count: int
    brief_item_count: int
    layer_count: int
    # Detail items the brief does not reach ("N more items not expanded").
    not_expanded: int
    # The brief is the deterministic navigation (the layers would not shrink).
    navigation: bool


async def aggregate(
    package_dir: Path,
    unit_results: Iterable[Path] | AsyncIterable[Path],
    provider: ModelProvider,
    *,
    model: str,
    budget: UnitBudget | None = None,
    brief_tokens: int = BRIEF_TOKENS,
    policy: CallPolicy | None = None,
    on_call: CallHook | None = None,
) -> HandoffReady:
    """Build ``handoff/`` from `unit_results` (the units' ``work/`` files, in plan order; read one at a
    time, so an async iterable may page them from the database).

    Each result is checked (kind, snapshot, schema) before it is copied. Condensing requests get one
    repair each; a second invalid answer raises AnswerInvalid. Provider failures propagate. File work
    runs in threads; `verify_handoff` does not (call it in one). `on_call` hears of every condensing
    call with its usage (packs answered by an earlier run are reused without a call). Calls are made
    under `policy` (per-call timeout, attempts and backoff). Out of storage, the staging directory is
    removed (condensed packs already saved stay) and StorageShort raised.
    """
    try:
        return await _aggregate(
            package_dir,
            unit_results,
            provider,
            model=model,
            budget=budget or UnitBudget(),
            brief_tokens=brief_tokens,
            policy=policy or CallPolicy(),
            on_call=on_call,
        )
    except (OSError, StorageShort) as exc:
        if isinstance(exc, OSError) and exc.errno not in STORAGE_ERRNOS:
            raise
        await asyncio.to_thread(shutil.rmtree, package_dir / _STAGING, ignore_errors=True)
        if isinstance(exc, StorageShort):
            raise
        raise StorageShort(_STAGING, errno.errorcode.get(exc.errno or 0, str(exc.errno))) from exc


async def _aggregate(
    package_dir: Path,
    unit_results: Iterable[Path] | AsyncIterable[Path],
    provider: ModelProvider,
    *,
    model: str,
    budget: UnitBudget,
    brief_tokens: int,
    policy: CallPolicy,
    on_call: CallHook | None,
) -> HandoffReady:
    snapshot_hash = await asyncio.to_thread(_prepare, package_dir)
    staging = package_dir / _STAGING
    processor_version, counts = await _write_details(package_dir, staging, unit_results, snapshot_hash)
    layer: Path | None = None
    layer_tokens = counts.excerpt_tokens
    layer_count = 0
    not_expanded = 0
    navigation = False
    while layer_tokens > brief_tokens:
        target = staging / "layers" / f"{layer_count + 1}.jsonl"
        tokens, dropped = await _condense(
            _layer_entries(staging, layer),
            target,
            _Asker(provider, budget, package_dir, policy, on_call),
            f"{snapshot_hash}:L{layer_count + 1}",
        )
        if tokens >= layer_tokens:
            target.unlink()
            navigation = True
            break
        layer, layer_tokens, layer_count = target, tokens, layer_count + 1
        not_expanded += dropped
    if navigation:
        brief = _navigation(counts, snapshot_hash)
    else:
        brief = {
            "schemaVersion": SCHEMA_VERSION,
            "snapshotHash": snapshot_hash,
            "navigation": False,
            "layer": layer_count,
            "items": [
                {key: entry[key] for key in ("itemId", "section", "status", "content", "evidence")}
                for entry in _layer_entries(staging, layer)
            ],
            "notExpanded": not_expanded,
        }
    ready = {
        "schemaVersion": SCHEMA_VERSION,
        "snapshotHash": snapshot_hash,
        "processorVersion": processor_version,
        "requestedModel": model,
        "units": counts.units,
        "items": counts.items,
        "briefItems": len(brief["items"]),
        "layers": layer_count,
        "notExpanded": brief["notExpanded"],
        "navigation": navigation,
    }
    return await asyncio.to_thread(_finish, package_dir, counts, brief, ready)


def _prepare(package_dir: Path) -> str:
    """A fresh staging directory; the snapshot identity."""
    snapshot_hash = snapshot_identity(package_dir)
    staging = package_dir / _STAGING
    shutil.rmtree(staging, ignore_errors=True)
    for name in ("details", "text", "layers"):
        (staging / name).mkdir(parents=True)
    return snapshot_hash


def _finish(package_dir: Path, counts: _Counts, brief: dict[str, Any], ready: dict[str, Any]) -> HandoffReady:
    """Write the entry files and ready.json, sync everything and rename the staging into ``handoff/``."""
    staging = package_dir / _STAGING
    overview = _overview(counts, package_dir, ready["snapshotHash"])
    _write_json(staging / "overview.json", overview)
    _write_json(staging / "brief.json", brief)
    (staging / "handoff.md").write_text(_markdown(overview, brief), encoding="utf-8")
    files = [*_ENTRY_FILES]
    files += [f"layers/{number}.jsonl" for number in range(1, ready["layers"] + 1)]
    ready = ready | {"files": [{"path": name, "sha256": file_sha256(staging / name)} for name in files]}
    ready_hash = write_atomic(staging / "ready.json", json.dumps(ready, sort_keys=True).encode())
    _sync_tree(staging)
    final = package_dir / HANDOFF_DIR
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    fsync_dir(package_dir)
    return _ready(ready, ready_hash)


def verify_handoff(package_dir: Path) -> HandoffReady:
    """The handoff in `package_dir`, after checking every file against ready.json and details.jsonl
    and ready.json against the sealed snapshot. Raises HandoffDamaged.
    """
    handoff = package_dir / HANDOFF_DIR
    try:
        data = (handoff / "ready.json").read_bytes()
        ready = json.loads(data)
    except (OSError, ValueError) as exc:
        raise HandoffDamaged("ready.json is missing or not JSON") from exc
    try:
        snapshot_hash = snapshot_identity(package_dir)
    except PackageUnreadable as exc:
        raise HandoffDamaged("the sealed snapshot the handoff was built from is unreadable") from exc
    if not isinstance(ready, dict) or ready.get("snapshotHash") != snapshot_hash:
        raise HandoffDamaged("ready.json does not name this package's sealed snapshot")
    listed = ready.get("files")
    if not isinstance(listed, list) or not all(isinstance(row, dict) for row in listed):
        raise HandoffDamaged("ready.json lists no files")
    if not set(_ENTRY_FILES) <= {row.get("path") for row in listed}:
        raise HandoffDamaged("ready.json does not list every entry file of the handoff")
    for row in listed:
        _check(handoff, row.get("path"), row.get("sha256"))
    try:
        for _, line in iter_jsonl(handoff / "details.jsonl"):
            _check(handoff, line.get("path"), line.get("sha256"))
            _check(handoff, line.get("textPath"), line.get("textSha256"))
    except PackageUnreadable as exc:
        raise HandoffDamaged("details.jsonl is unreadable") from exc
    return _ready(ready, _sha256_bytes(data))


@dataclass
class _Counts:
    """What the details add up to; bounded by sections, statuses and sources, not by the history."""

    units: int = 0
    items: int = 0
    excerpt_tokens: int = 0
    by_section: Counter[tuple[str, str]] = field(default_factory=Counter)
    by_source: Counter[tuple[str, str, str]] = field(default_factory=Counter)


async def _write_details(
    package_dir: Path, staging: Path, unit_results: Iterable[Path] | AsyncIterable[Path], snapshot_hash: str
) -> tuple[str, _Counts]:
    """Copy and check each unit result (one at a time, in a thread); write text/ and details.jsonl.
    Returns the processor version and the counts."""
    counts = _Counts()
    processor_version = ""
    work = (package_dir / WORK_DIR).resolve()
    manifest = await asyncio.to_thread((staging / "details.jsonl").open, "wb")
    try:
        async for path in _each(unit_results):
            processor_version = await asyncio.to_thread(
                _write_detail, staging, manifest, work, path, snapshot_hash, processor_version, counts
            )
    finally:
        await asyncio.to_thread(manifest.close)
    return processor_version, counts


async def _each(paths: Iterable[Path] | AsyncIterable[Path]) -> AsyncIterator[Path]:
    if isinstance(paths, AsyncIterable):
        async for path in paths:
            yield path
    else:
        for path in paths:
            yield path


def _write_detail(
    staging: Path,
    manifest: BinaryIO,
    work: Path,
    path: Path,
    snapshot_hash: str,
    processor_version: str,
    counts: _Counts,
) -> str:
    """Copy and check one unit result, add it to `counts` and details.jsonl; its processor version."""
    if path.is_symlink() or path.resolve().parent != work:
        raise PackageUnreadable("a unit result is not a file in the package's work directory")
    try:
        data = path.read_bytes()
        result = json.loads(data)
    except (OSError, ValueError) as exc:
        raise PackageUnreadable(f"unit result {path.name} is unreadable") from exc
    unit_id = _checked_result(result, snapshot_hash, path.name)
    if (staging / f"details/{unit_id}.json").exists():
        raise PackageUnreadable(f"unit result {path.name} is given twice")
    if processor_version and result["processorVersion"] != processor_version:
        raise PackageUnreadable("unit results come from different processor versions")
    detail = f"details/{unit_id}.json"
    (staging / detail).write_bytes(data)
    lines = []
    unit_counts: Counter[str] = Counter()
    for item in result["items"]:
        lines.append(f"[{item['section']} / {item['status']}] {item['content']} ({item['itemId']})")
        unit_counts[f"{item['section']}/{item['status']}"] += 1
        counts.by_section[item["section"], item["status"]] += 1
        for source in dict.fromkeys(evidence["sessionId"] for evidence in item["evidence"]):
            counts.by_source[source, item["section"], item["status"]] += 1
        counts.excerpt_tokens += _entry_tokens(item["content"])
    text_path = f"text/{unit_id}.txt"
    text = ("\n".join(lines) + "\n").encode() if lines else b""
    (staging / text_path).write_bytes(text)
    row = {
        "unitId": unit_id,
        "ordinal": result["ordinal"],
        "path": detail,
        "sha256": _sha256_bytes(data),
        "textPath": text_path,
        "textSha256": _sha256_bytes(text),
        "items": len(result["items"]),
        "counts": dict(sorted(unit_counts.items())),
    }
    manifest.write(json.dumps(row, sort_keys=True).encode() + b"\n")
    counts.units += 1
    counts.items += len(result["items"])
    return str(result["processorVersion"])


def _checked_result(result: Any, snapshot_hash: str, name: str) -> str:
    """The unit id of a unit result that is well-formed and of this snapshot; PackageUnreadable if not."""
    if (
        not isinstance(result, dict)
        or result.get("kind") != RESULT_KIND
        or result.get("schemaVersion") != SCHEMA_VERSION
        or not isinstance(result.get("items"), list)
        or not isinstance(result.get("processorVersion"), str)
        or not isinstance(result.get("ordinal"), int)
    ):
        raise PackageUnreadable(f"unit result {name} is not an extraction result")
    if result.get("snapshotHash") != snapshot_hash:
        raise PackageUnreadable(f"unit result {name} was made from another snapshot")
    unit_id = result.get("unitId")
    if not isinstance(unit_id, str) or f"{unit_id}.json" != name:
        raise PackageUnreadable(f"unit result {name} names another unit")
    for item in result["items"]:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("itemId"), str)
            and item.get("section") in SECTIONS
            and item.get("status") in STATUSES
            and isinstance(item.get("content"), str)
            and item["content"]
            and isinstance(item.get("evidence"), list)
            and item["evidence"]
            and all(isinstance(e, dict) and isinstance(e.get("sessionId"), str) for e in item["evidence"])
        ):
            raise PackageUnreadable(f"unit result {name} holds an item that breaks schema v2")
    return unit_id


def _layer_entries(staging: Path, layer: Path | None) -> Iterator[dict[str, Any]]:
    """The items of a layer, one at a time: the detail items (layer 0) or a condensed layer's file."""
    if layer is not None:
        for _, entry in iter_jsonl(layer):
            yield entry
        return
    for _, row in iter_jsonl(staging / "details.jsonl"):
        result = json.loads((staging / row["path"]).read_bytes())
        for item in result["items"]:
            yield {
                "itemId": item["itemId"],
                "section": item["section"],
                "status": item["status"],
                "content": item["content"],
                "evidence": [evidence["ref"] for evidence in item["evidence"]],
                "covers": 1,
            }


@dataclass(frozen=True)
class _Asker:
    """Who condensing asks, within which budget, where answers are kept, and who hears of each call."""

    provider: ModelProvider
    budget: UnitBudget
    package_dir: Path
    policy: CallPolicy
    on_call: CallHook | None


async def _condense(below: Iterator[dict[str, Any]], target: Path, asker: _Asker, layer_key: str) -> tuple[int, int]:
    """Condense `below` in budgeted packs into `target`; returns its estimated tokens and the detail items
    left uncited (not expanded) by this layer.
    """
    tokens = 0
    dropped = 0
    with target.open("wb") as out:
        for number, pack in enumerate(_packs(below, asker.budget)):
            for items, uncovered in await _condense_shrinking(pack, asker, f"{layer_key}:{number}"):
                for item in items:
                    out.write(json.dumps(item, ensure_ascii=False, sort_keys=True).encode() + b"\n")
                    tokens += _entry_tokens(item["content"])
                dropped += uncovered
    return tokens, dropped


async def _condense_shrinking(
    pack: list[dict[str, Any]], asker: _Asker, key: str
) -> list[tuple[list[dict[str, Any]], int]]:
    """`_condense_pack`, bisecting the pack (keys ``<key>.0``, ``<key>.1``) when its request or answer does
    not fit or its answer stays invalid after the repair; a pack of one item that still fails raises."""
    try:
        return [await _condense_pack(pack, asker, key)]
    except SHRINKABLE:
        if len(pack) < 2:
            raise
    half = len(pack) // 2
    first = await _condense_shrinking(pack[:half], asker, f"{key}.0")
    return first + await _condense_shrinking(pack[half:], asker, f"{key}.1")


def _packs(entries: Iterator[dict[str, Any]], budget: UnitBudget) -> Iterator[list[dict[str, Any]]]:
    """`entries` in consecutive packs within the request budget (an oversized entry goes alone)."""
    pack: list[dict[str, Any]] = []
    used = 0
    for entry in entries:
        cost = _entry_tokens(entry["content"]) + budget.part_overhead_tokens
        if pack and (used + cost > budget.material_tokens or len(pack) >= budget.max_parts):
            yield pack
            pack, used = [], 0
        pack.append(entry)
        used += cost
    if pack:
        yield pack


async def _condense_pack(pack: list[dict[str, Any]], asker: _Asker, key: str) -> tuple[list[dict[str, Any]], int]:
    """One condensing request (and at most one repair) over `pack`; the new items and uncited coverage.

    The outcome is kept in ``work/condense/<hash of key and inputs>.json``, so aggregating again after a
    crash, or with another model, asks only for the packs not answered yet.
    """
    aliases = {f"a{number}": entry for number, entry in enumerate(pack, start=1)}
    inputs = [
        {"alias": alias, "section": e["section"], "status": e["status"], "content": _excerpt(e["content"])}
        for alias, e in aliases.items()
    ]
    identity = json.dumps([key, inputs, [e["itemId"] for e in pack]], ensure_ascii=False, sort_keys=True)
    saved = asker.package_dir / WORK_DIR / "condense" / f"{hashlib.sha256(identity.encode()).hexdigest()}.json"
    reused = _saved_pack(saved)
    if reused is not None:
        return reused
    answer, _, _ = await ask_items(
        asker.provider,
        lambda rejected: condense_request(inputs, rejected=rejected),
        aliases,
        budget=asker.budget,
        subject=key,
        operation_id=asker.package_dir.name,
        policy=asker.policy,
        on_call=asker.on_call,
    )
    cited: set[str] = set()
    items = []
    for index, item in enumerate(answer):
        fresh = [alias for alias in item.evidence if alias not in cited]
        cited.update(item.evidence)
        items.append(
            {
                "itemId": item_id(key, index),
                "section": item.section,
                "status": item.status,
                "content": item.content,
                "evidence": [aliases[alias]["itemId"] for alias in item.evidence],
                "covers": sum(int(aliases[alias]["covers"]) for alias in fresh),
            }
        )
    uncovered = sum(int(entry["covers"]) for alias, entry in aliases.items() if alias not in cited)
    await asyncio.to_thread(
        write_atomic, saved, json.dumps({"items": items, "uncovered": uncovered}, ensure_ascii=False).encode()
    )
    return items, uncovered


def _saved_pack(path: Path) -> tuple[list[dict[str, Any]], int] | None:
    """A pack's saved outcome, or None when there is none (or it is unreadable: then it is asked again)."""
    try:
        saved = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("uncovered"), int):
        return None
    items = saved.get("items")
    if not isinstance(items, list) or not all(
        isinstance(item, dict) and item.get("section") in SECTIONS and item.get("status") in STATUSES for item in items
    ):
        return None
    return items, saved["uncovered"]


def _navigation(counts: _Counts, snapshot_hash: str) -> dict[str, Any]:
    """The deterministic brief: counts by section and status, and entries to the details."""
    items = [
        {
            "itemId": item_id(f"{snapshot_hash}:navigation", index),
            "section": section,
            "status": status,
            "content": f"{count} detailed items; not expanded here: read the details before continuing this work.",
            "evidence": ["details.jsonl"],
        }
        for index, ((section, status), count) in enumerate(sorted(counts.by_section.items()))
    ]
    return {
        "schemaVersion": SCHEMA_VERSION,
        "snapshotHash": snapshot_hash,
        "navigation": True,
        "layer": 0,
        "items": items,
        "notExpanded": counts.items,
    }


def _overview(counts: _Counts, package_dir: Path, snapshot_hash: str) -> dict[str, Any]:
    by_section: dict[str, dict[str, int]] = {section: {} for section in SECTIONS}
    for (section, status), count in sorted(counts.by_section.items()):
        by_section[section][status] = count
    by_source: dict[str, dict[str, dict[str, int]]] = {}
    for (source, section, status), count in sorted(counts.by_source.items()):
        by_source.setdefault(source, {}).setdefault(section, {})[status] = count
    gaps = sum(1 for _ in iter_jsonl(package_dir / SNAPSHOT_DIR / "gaps.jsonl"))
    return {
        "schemaVersion": SCHEMA_VERSION,
        "snapshotHash": snapshot_hash,
        "units": counts.units,
        "items": counts.items,
        "bySection": by_section,
        "bySource": by_source,
        "emptySections": [section for section in SECTIONS if not by_section[section]],
        "gaps": gaps,
        "details": "details.jsonl",
    }


def _markdown(overview: dict[str, Any], brief: dict[str, Any]) -> str:
    """The readable entry: the brief by section, "not recorded" where the details have nothing."""
    lines = [
        "# Merged handoff",
        "",
        f"{overview['items']} detailed items from {overview['units']} extraction units "
        f"across {len(overview['bySource'])} source sessions; {overview['gaps']} gaps in the history.",
        "Historical reference: what the sources recorded, not proof that the current workspace still matches.",
    ]
    if brief["navigation"]:
        lines.append("The brief is a navigation only: details not expanded, read them before continuing.")
    lines += ["", "## sources", ""]
    for source, sections in overview["bySource"].items():
        described = ", ".join(
            f"{section} {sum(statuses.values())}" for section, statuses in sections.items() if statuses
        )
        lines.append(f"- {source}: {described}")
    for section in SECTIONS:
        lines += ["", f"## {section}", ""]
        entries = [item for item in brief["items"] if item["section"] == section]
        if section in overview["emptySections"]:
            lines.append(NOT_RECORDED)
        lines += [f"- [{item['status']}] {item['content']} ({item['itemId']})" for item in entries]
    if brief["notExpanded"]:
        lines += ["", f"{brief['notExpanded']} more items not expanded: see details.jsonl."]
    lines += ["", "Details: details.jsonl (one line per unit: details/<unit>.json and text/<unit>.txt)."]
    return "\n".join(lines) + "\n"


def _entry_tokens(content: str) -> int:
    return estimate_tokens(_excerpt(content))


def _excerpt(content: str) -> str:
    return content if len(content) <= EXCERPT_CHARS else content[: EXCERPT_CHARS - 1] + "…"


def _check(handoff: Path, relative: Any, sha256: Any) -> None:
    """`handoff`/`relative` exists, is no symlink and has `sha256`; the path must stay inside handoff/."""
    if not isinstance(relative, str) or not isinstance(sha256, str):
        raise HandoffDamaged("a handoff manifest line lacks its path or hash")
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts or "\\" in relative:
        raise HandoffDamaged("a handoff manifest line names a path outside handoff/")
    path = handoff / relative
    try:
        if path.is_symlink() or file_sha256(path) != sha256:
            raise HandoffDamaged(f"handoff file {relative} does not match its recorded sha256")
    except OSError as exc:
        raise HandoffDamaged(f"handoff file {relative} is missing") from exc


def _ready(ready: dict[str, Any], ready_hash: str) -> HandoffReady:
    try:
        return HandoffReady(
            handoff_hash=ready_hash,
            snapshot_hash=str(ready["snapshotHash"]),
            processor_version=str(ready["processorVersion"]),
            unit_count=int(ready["units"]),
            item_count=int(ready["items"]),
            brief_item_count=int(ready["briefItems"]),
            layer_count=int(ready["layers"]),
            not_expanded=int(ready["notExpanded"]),
            navigation=bool(ready["navigation"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HandoffDamaged("ready.json lacks a field") from exc


def _write_json(path: Path, value: Any) -> None:
    path.write_bytes(json.dumps(value, ensure_ascii=False, sort_keys=True, indent=1).encode())


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, so the rename publishes only durable bytes."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as stream:
                os.fsync(stream.fileno())
    for directory in [root, *(path for path in root.rglob("*") if path.is_dir())]:
        fsync_dir(directory)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
