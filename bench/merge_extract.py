"""Benchmark: extraction and aggregation of a 50 MiB and a 200 MiB history with the offline provider.

Extraction reads only a sealed snapshot package, so the benchmark writes sealed packages directly in the
documented layout (records.jsonl, files.jsonl, raw/, text/ parts of at most 32 KiB, manifest.json,
seal.json; streamed to disk, never held in memory): three root sessions of agent turns (a user request,
an assistant reply naming files and commands, a tool result of 1 to 96 KiB, some with errors). Sealing
itself is bench/merge_snapshot.py's subject. Each package then goes through merge's extraction in its
own process (`--child`): plan_units, every unit through run_unit, aggregate into a verified handoff,
with the offline provider and the default budgets (`ExtractionSettings()`), counting model calls
(units and condensing packs) and reporting the process's peak RSS (VmHWM).

    .venv/bin/python bench/merge_extract.py [--small-mib 50] [--large-mib 200]

Result: value = model calls per MiB at the large size, baseline = calls per MiB at the small size,
ratio = value / baseline, target: ratio <= 1.2 (calls grow no faster than linearly with the history),
with rss_mib (peak RSS of the extraction process at the large size, target < 256) and rss_small_mib.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as `python bench/<name>.py`: the repo root must be importable for `bench.bench_support`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_support import emit_result, log, synthetic_text
from continuum_merge.extraction import CallRecord, ExtractionSettings, aggregate, plan_units, run_unit, verify_handoff
from continuum_runtime.provider import OfflineProvider

MIB = 1024 * 1024
PART_BYTES = 32 * 1024
TARGET_RATIO = 1.2
TARGET_RSS_MIB = 256
PROCESSOR_VERSION = "bench-extract-1"
SOURCES = ("source-a", "source-b", "source-c")


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small-mib", type=int, default=50, help="the smaller history, MiB of text")
    parser.add_argument("--large-mib", type=int, default=200, help="the larger history, MiB of text")
    parser.add_argument("--seed", type=int, default=20251130, help="seed of the synthetic history")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)


class PackageWriter:
    """Writes a sealed snapshot package one record at a time (manifests streamed, hashes while writing)."""

    def __init__(self, package_dir: Path) -> None:
        self.snapshot = package_dir / "snapshot"
        for name in ("raw", "text"):
            (self.snapshot / name).mkdir(parents=True)
        self._records = (self.snapshot / "records.jsonl").open("wb")
        self._files = (self.snapshot / "files.jsonl").open("wb")
        self._hashes = {"records.jsonl": hashlib.sha256(), "files.jsonl": hashlib.sha256()}
        self.records = 0
        self.files = 0
        self.text_bytes = 0

    def _line(self, name: str, row: dict[str, Any]) -> None:
        data = json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        (self._records if name == "records.jsonl" else self._files).write(data)
        self._hashes[name].update(data)

    def add(self, session_id: str, record_id: int, role: str, text: str) -> None:
        raw = json.dumps({"id": record_id, "role": role, "content": text}, sort_keys=True).encode()
        version = hashlib.sha256(raw).hexdigest()
        record_ref = hashlib.sha256(f"{session_id}\n{record_id}\n{version}".encode()).hexdigest()
        self._line(
            "records.jsonl",
            {
                "recordRef": record_ref,
                "origin": {"sessionId": session_id, "recordId": record_id, "version": version, "kind": "message"},
                "role": role.upper(),
                "createdAt": "2026-11-30T12:00:00Z",
                "rawRef": f"raw/{record_ref}.json",
                "processingPolicy": "extract",
            },
        )
        (self.snapshot / f"raw/{record_ref}.json").write_bytes(raw)
        self._file(record_ref, None, f"raw/{record_ref}.json", raw, "raw")
        data = text.encode()
        for part, start in enumerate(range(0, len(data), PART_BYTES)):
            chunk = data[start : start + PART_BYTES]  # ASCII text: every byte is a code point boundary
            path = f"text/{record_ref}-{part}.txt"
            (self.snapshot / path).write_bytes(chunk)
            self._file(record_ref, part, path, chunk, "text")
            self.text_bytes += len(chunk)
        self.records += 1

    def _file(self, record_ref: str, part: int | None, path: str, data: bytes, kind: str) -> None:
        ref = f"r_{record_ref}" + ("" if part is None else f":p{part}")
        row = {"ref": ref, "recordRef": record_ref, "part": part, "path": path, "bytes": len(data), "kind": kind}
        self._line("files.jsonl", row | {"sha256": hashlib.sha256(data).hexdigest()})
        self.files += 1

    def seal(self) -> None:
        self._records.close()
        self._files.close()
        for name in ("occurrences.jsonl", "gaps.jsonl"):
            (self.snapshot / name).write_bytes(b"")
            self._hashes[name] = hashlib.sha256()
        manifest = {
            "version": 1,
            "sources": list(SOURCES),
            "counts": {"records": self.records, "files": self.files},
            "hashes": {name: digest.hexdigest() for name, digest in self._hashes.items()},
        }
        data = json.dumps(manifest, sort_keys=True).encode()
        (self.snapshot / "manifest.json").write_bytes(data)
        seal = {"format": "continuum-merge-snapshot/v1", "version": 1, "manifestHash": hashlib.sha256(data).hexdigest()}
        (self.snapshot / "seal.json").write_bytes(json.dumps(seal, sort_keys=True).encode())


def write_history(package_dir: Path, history_mib: int, seed: int) -> int:
    """A sealed package of about `history_mib` MiB of text in agent turns; its text bytes."""
    rng = random.Random(seed)
    writer = PackageWriter(package_dir)
    turn = 0
    while writer.text_bytes < history_mib * MIB:
        session = SOURCES[turn % len(SOURCES)]
        record = 3 * (turn // len(SOURCES))
        writer.add(session, record + 1, "user", f"Please fix the failing build in src/module_{turn % 97}.py.")
        writer.add(
            session,
            record + 2,
            "assistant",
            f"I changed src/module_{turn % 97}.py and will run the tests.\n$ pytest tests/test_{turn % 97}.py -q",
        )
        tail = "error: AssertionError in test_case\n" if turn % 5 == 0 else "all checks passed\n"
        writer.add(session, record + 3, "tool", synthetic_text(rng, rng.randint(1024, 96 * 1024)) + "\n" + tail)
        turn += 1
    writer.seal()
    return writer.text_bytes


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss would include the forking parent's)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def extract(package_dir: Path) -> dict[str, Any]:
    """The child process: every unit, then the handoff; counts, seconds and peak RSS."""
    settings = ExtractionSettings()
    budget = settings.unit_budget()
    provider = OfflineProvider()
    calls: list[str] = []

    def heard(subject: str, _: CallRecord) -> None:
        calls.append(subject[:2])

    started = time.perf_counter()
    # The plan is streamed, as the service inserts it in batches: never held whole.
    units = plan_units(package_dir, processor_version=PROCESSOR_VERSION, budget=budget)
    results = []
    while (unit := await asyncio.to_thread(next, units, None)) is not None:
        outcome = await run_unit(unit, package_dir, provider, model="", budget=budget, on_call=heard)
        results.append(outcome.path)
    unit_calls = len(calls)
    ready = await aggregate(
        package_dir, results, provider, model="", budget=budget, brief_tokens=settings.brief_tokens, on_call=heard
    )
    await asyncio.to_thread(verify_handoff, package_dir)
    return {
        "units": len(results),
        "calls": len(calls),
        "unit_calls": unit_calls,
        "condense_calls": len(calls) - unit_calls,
        "items": ready.item_count,
        "layers": ready.layer_count,
        "brief_items": ready.brief_item_count,
        "navigation": ready.navigation,
        "seconds": round(time.perf_counter() - started, 3),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def run_child(package_dir: Path) -> dict[str, Any]:
    """Extraction of `package_dir` in its own process; its JSON line."""
    output = subprocess.run(
        [sys.executable, __file__, "--child", str(package_dir)],
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    result: dict[str, Any] = json.loads(output.stdout.decode().splitlines()[-1])
    return result


def measure(scratch: Path, history_mib: int, seed: int) -> dict[str, Any]:
    package = scratch / f"op-{history_mib}"
    log(f"writing a sealed package of {history_mib} MiB of text ...")
    text_bytes = write_history(package, history_mib, seed)
    log(f"  {text_bytes / MIB:.1f} MiB of text parts; extracting and aggregating in a child process ...")
    result = run_child(package) | {"history_mib": round(text_bytes / MIB, 1)}
    log(
        f"  {result['calls']} calls ({result['unit_calls']} units, {result['condense_calls']} condensing), "
        f"{result['seconds']:.1f}s, peak RSS {result['peak_rss_mib']} MiB"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_options(parser)
    args = parser.parse_args()
    if args.child is not None:
        sys.stdout.write(json.dumps(asyncio.run(extract(args.child))) + "\n")
        return
    with tempfile.TemporaryDirectory(prefix="continuum-bench-extract-") as scratch:
        small = measure(Path(scratch), args.small_mib, args.seed)
        large = measure(Path(scratch), args.large_mib, args.seed)
    per_mib_small = small["calls"] / small["history_mib"]
    per_mib_large = large["calls"] / large["history_mib"]
    emit_result(
        metric="merge_extract_model_calls_per_mib_large_vs_small",
        value=per_mib_large,
        baseline=per_mib_small,
        target=TARGET_RATIO,
        unit="calls/MiB",
        higher_is_better=False,
        valid=large["peak_rss_mib"] < TARGET_RSS_MIB,
        rss_mib=large["peak_rss_mib"],
        rss_small_mib=small["peak_rss_mib"],
        history_mib=large["history_mib"],
        history_small_mib=small["history_mib"],
        calls=large["calls"],
        calls_small=small["calls"],
        units=large["units"],
        condense_calls=large["condense_calls"],
        layers=large["layers"],
        brief_items=large["brief_items"],
        navigation=large["navigation"],
        seconds=large["seconds"],
        seconds_small=small["seconds"],
    )


if __name__ == "__main__":
    main()
