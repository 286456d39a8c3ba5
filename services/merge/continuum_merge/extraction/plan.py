"""Deterministic extraction units over a sealed snapshot: which text parts each model request reads.

Parts are taken in the snapshot's order (source → message → part) and packed greedily under the
budget's material tokens (estimates, from the recorded byte sizes). A tool result stays with the
call before it: when a unit would close between them, the call's parts move to the next unit too
(when they fit). Each unit after the first repeats a few trailing parts of the one before it as
context, so a fact split across the boundary is seen whole. A part over the material budget by itself
is read alone, in consecutive slices of its text that each fit: byte ranges cut on code point boundaries,
each with its own sha256, so a slice unit reads and checks only its own bytes. Coverage is decided by
this plan: every extractable part is in exactly one unit's own parts, or in its slices end to end.

A unit does not hold its parts: it records where they start in files.jsonl and records.jsonl and how
many there are, so a plan over a long history stays small; `scan_unit` reads them again and checks
they are still the ones planned (`input_hash`).
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from continuum_merge.extraction.errors import PackageUnreadable
from continuum_merge.extraction.package import (
    RecordRow,
    iter_files,
    iter_part_chunks,
    iter_records,
    read_part_range,
    read_text_part,
    snapshot_identity,
)
from continuum_runtime.provider.tokens import BYTES_PER_TOKEN, estimate_tokens_of_bytes

__all__ = [
    "EXTRACT_POLICY",
    "PartSlice",
    "PartSpec",
    "UnitBudget",
    "UnitSpec",
    "plan_units",
    "read_slice",
    "scan_unit",
    "split_unit",
]

# The records.jsonl processing policy of material sent to a model (others are archived only).
EXTRACT_POLICY = "extract"
# The stage of extraction units (their rows' `stage`).
UNIT_STAGE = "extracting"
# The shrink floor of issue 10: a unit's material budget is never planned below this.
MIN_MATERIAL_TOKENS = 256


@dataclass(frozen=True)
class UnitBudget:
    """How much one extraction request may carry, in estimated tokens (not bytes, not reported usage)."""

    # The request as a whole: material, instructions, wrapping, the answer and a safety margin.
    request_tokens: int = 16_384
    # The visible answer's target (a complete answer over it is still kept).
    output_tokens: int = 2_048
    # Reasoning reserved beside the visible answer (0 for a model that does not think); the request's
    # max_tokens is both together. Bounded by the window, not by the request target.
    thinking_tokens: int = 0
    # max(1024, 5% of the window) by default.
    safety_tokens: int = 1_024
    # The fixed instructions and the request's JSON frame.
    instruction_tokens: int = 1_024
    # Per part: its alias, role and source in the request, and JSON quoting.
    part_overhead_tokens: int = 32
    # Trailing parts of the previous unit repeated as context, at most this much.
    overlap_tokens: int = 512
    # Parts per unit, however small: keeps the alias list and the stored input bounded.
    max_parts: int = 200
    # Byte guards (bytes, not tokens): a request or a visible answer over them is split, never sent or used.
    request_bytes: int = 1024 * 1024
    response_bytes: int = 256 * 1024
    # A unit whose own material is at most this many estimated tokens is not split again.
    floor_tokens: int = MIN_MATERIAL_TOKENS

    def __post_init__(self) -> None:
        if self.material_tokens < MIN_MATERIAL_TOKENS:
            raise ValueError(f"the budget leaves less than {MIN_MATERIAL_TOKENS} estimated tokens for material")
        if self.max_parts < 1 or self.overlap_tokens < 0 or self.part_overhead_tokens < 0:
            raise ValueError("max_parts must be positive and overheads non-negative")
        if self.request_bytes < 1 or self.response_bytes < 1:
            raise ValueError("the byte guards must be positive")
        if self.thinking_tokens < 0 or self.output_tokens < 1 or self.floor_tokens < MIN_MATERIAL_TOKENS:
            raise ValueError(
                f"output must be positive, thinking non-negative, the floor at least {MIN_MATERIAL_TOKENS}"
            )

    @property
    def generation_tokens(self) -> int:
        """What a request lets the model generate (its max_tokens): the visible target and the thinking reserve."""
        return self.output_tokens + self.thinking_tokens

    @property
    def material_tokens(self) -> int:
        """Estimated tokens left for parts (context included) after everything else is reserved."""
        return self.request_tokens - self.output_tokens - self.safety_tokens - self.instruction_tokens


@dataclass(frozen=True)
class PartSpec:
    """One extractable text part as a unit reads it."""

    ref: str
    record_ref: str
    part: int
    path: str
    size: int
    sha256: str
    session_id: str
    role: str

    def tokens(self, budget: UnitBudget) -> int:
        """Estimated tokens this part takes in a request."""
        return estimate_tokens_of_bytes(self.size) + budget.part_overhead_tokens


@dataclass(frozen=True)
class PartSlice:
    """Bytes [start, end) of a part's UTF-8 text, cut on code point boundaries: where its text starts in
    UTF-16 code units (for evidence ranges) and the sha256 of exactly those bytes (checked when read)."""

    start: int
    end: int
    utf16_start: int
    sha256: str

    @classmethod
    def of(cls, data: bytes, start: int, utf16_start: int) -> PartSlice:
        """The slice of `data`, found at byte `start` of its part after `utf16_start` UTF-16 code units."""
        return cls(start, start + len(data), utf16_start, hashlib.sha256(data).hexdigest())

    def stored(self) -> dict[str, object]:
        """As the unit's stored input keeps it."""
        return {"bytes": [self.start, self.end], "utf16Start": self.utf16_start, "sha256": self.sha256}

    @classmethod
    def from_stored(cls, value: object) -> PartSlice | None:
        """A stored slice, None when absent; ValueError when malformed."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("malformed slice")
        bounds, utf16_start, sha256 = value.get("bytes"), value.get("utf16Start"), value.get("sha256")
        numbers = [*bounds, utf16_start] if isinstance(bounds, list) and len(bounds) == 2 else []
        if (
            not numbers
            or not all(isinstance(number, int) and not isinstance(number, bool) for number in numbers)
            or not 0 <= numbers[0] < numbers[1]
            or numbers[2] < 0
            or not isinstance(sha256, str)
        ):
            raise ValueError("malformed slice")
        return cls(numbers[0], numbers[1], numbers[2], sha256)


def read_slice(package_dir: Path, part: PartSpec, piece: PartSlice | None) -> tuple[str, int]:
    """The text of `piece` of `part` (all of it when None), checked against its hash, and the UTF-16
    offset where it starts in the part; only the slice's bytes are read."""
    if piece is None:
        return read_text_part(package_dir, part.path, size=part.size, sha256=part.sha256), 0
    if piece.end > part.size:
        raise PackageUnreadable(f"a slice of {part.ref} ends past its text")
    text = read_part_range(package_dir, part.path, start=piece.start, end=piece.end, sha256=piece.sha256)
    return text, piece.utf16_start


@dataclass(frozen=True)
class UnitSpec:
    """One planned extraction unit. Its id depends only on the snapshot, the inputs and the processor."""

    unit_id: str
    stage: str
    ordinal: int
    snapshot_hash: str
    processor_version: str
    # sha256 over the refs and hashes of the unit's context and own parts, in order.
    input_hash: str
    # Byte offsets in files.jsonl and records.jsonl where the unit's first part (context first) is listed.
    files_offset: int
    records_offset: int
    context_count: int
    part_count: int
    first_ref: str
    last_ref: str
    # A split of a single part: the slice of its text this unit reads; None: all of it.
    slice: PartSlice | None = None
    # Byte offset in files.jsonl of the first row (the raw JSON) of the record of the unit's first part:
    # where every file row of the unit's records, attachments included, is listed from.
    record_files_offset: int | None = None

    @property
    def rows_offset(self) -> int:
        """Where the files.jsonl rows of the unit's records start (its first part's record's raw row)."""
        return self.files_offset if self.record_files_offset is None else self.record_files_offset

    def input_json(self) -> str:
        """The bounded description stored with the unit row (no text, no part list): with the unit id
        and ordinal, everything `from_stored` needs to rebuild this spec.
        """
        stored: dict[str, object] = {"slice": self.slice.stored()} if self.slice is not None else {}
        if self.record_files_offset is not None:
            stored["recordFilesOffset"] = self.record_files_offset
        return json.dumps(
            stored
            | {
                "stage": self.stage,
                "snapshotHash": self.snapshot_hash,
                "processorVersion": self.processor_version,
                "inputHash": self.input_hash,
                "filesOffset": self.files_offset,
                "recordsOffset": self.records_offset,
                "contextParts": self.context_count,
                "parts": self.part_count,
                "firstRef": self.first_ref,
                "lastRef": self.last_ref,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_stored(cls, unit_id: str, ordinal: int, input_json: str) -> UnitSpec:
        """The spec a unit row describes (its id, ordinal and `input_json`); ValueError when malformed."""
        try:
            stored = json.loads(input_json)
            spec = cls(
                unit_id=unit_id,
                stage=stored["stage"],
                ordinal=ordinal,
                snapshot_hash=stored["snapshotHash"],
                processor_version=stored["processorVersion"],
                input_hash=stored["inputHash"],
                files_offset=stored["filesOffset"],
                records_offset=stored["recordsOffset"],
                context_count=stored["contextParts"],
                part_count=stored["parts"],
                first_ref=stored["firstRef"],
                last_ref=stored["lastRef"],
                slice=PartSlice.from_stored(stored.get("slice")),
                record_files_offset=stored.get("recordFilesOffset"),
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"unit {unit_id} has a malformed stored input") from exc
        numbers = (spec.files_offset, spec.records_offset, spec.context_count, spec.part_count, spec.rows_offset)
        texts = (spec.stage, spec.snapshot_hash, spec.processor_version, spec.input_hash, spec.first_ref, spec.last_ref)
        if not all(isinstance(n, int) and n >= 0 for n in numbers) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"unit {unit_id} has a malformed stored input")
        return spec


@dataclass(frozen=True)
class _Located:
    files_offset: int
    records_offset: int
    part: PartSpec
    # files.jsonl offset of the part's record's first row (its raw JSON).
    record_files_offset: int


def plan_units(package_dir: Path, *, processor_version: str, budget: UnitBudget) -> Iterator[UnitSpec]:
    """The extraction units of the sealed snapshot in `package_dir`, in order, one at a time (the plan of
    a long history is never held whole: what is kept between units is bounded by the budget's parts);
    the same package, processor version and budget always give the same units. Raises PackageUnreadable
    when the manifests are bad (possibly after some units were given).
    """
    snapshot_hash = snapshot_identity(package_dir)
    ordinal = 0
    context: list[_Located] = []
    current: list[_Located] = []
    used = 0
    for located in _extractable(package_dir):
        cost = located.part.tokens(budget)
        if cost > budget.material_tokens:
            # A part over the material budget on its own: closed off alone, in slices that each fit.
            if current:
                yield _unit(ordinal, snapshot_hash, processor_version, context, current)
                ordinal += 1
            for bounds in _slices(package_dir, located.part, budget):
                yield _unit(ordinal, snapshot_hash, processor_version, [], [located], bounds=bounds)
                ordinal += 1
            context, current, used = [], [], 0
            continue
        if current and not _fits(used + cost, len(context) + len(current) + 1, budget):
            carried = _carried_call(current, located, cost, budget)
            own = current[: len(current) - len(carried)]
            yield _unit(ordinal, snapshot_hash, processor_version, context, own)
            ordinal += 1
            context, current = _overlap(own, budget), carried
            used = _tokens(context, budget) + _tokens(current, budget)
            if not _fits(used + cost, len(context) + len(current) + 1, budget):
                # The context is a courtesy: it gives way to the unit's own parts.
                context, used = [], _tokens(current, budget)
        current.append(located)
        used += cost
    if current:
        yield _unit(ordinal, snapshot_hash, processor_version, context, current)


def _fits(tokens: int, parts: int, budget: UnitBudget) -> bool:
    """Whether a unit of `parts` parts and `tokens` estimated tokens is within the budget.

    (A part over the material budget on its own never gets here: it is planned in slices.)
    """
    return tokens <= budget.material_tokens and parts <= budget.max_parts


def scan_unit(package_dir: Path, spec: UnitSpec) -> tuple[list[PartSpec], list[PartSpec]]:
    """The (context, own) parts of `spec`, read again from the snapshot's manifests.

    Raises PackageUnreadable when they are not the ones planned (the manifests changed under the plan).
    """
    parts = [located.part for located in _scan(package_dir, spec)]
    return parts[: spec.context_count], parts[spec.context_count :]


def split_unit(
    package_dir: Path, spec: UnitSpec, *, floor_tokens: int = MIN_MATERIAL_TOKENS
) -> tuple[UnitSpec, UnitSpec] | None:
    """Two children that cover `spec`'s own parts, first half and second half, without context;
    None when the unit has a single part or its own parts are at most `floor_tokens` estimated tokens
    (the shrink floor: there is nothing left to split, the caller pauses).

    For a unit whose request or answer did not fit. The children's ids extend the parent's (``.0``,
    ``.1``), so they are as deterministic as the plan and sort in order under the parent's ordinal.
    """
    own = _scan(package_dir, spec)[spec.context_count :]
    if len(own) == 1:
        return _split_part(package_dir, spec, own[0], floor_tokens)
    if sum(estimate_tokens_of_bytes(located.part.size) for located in own) <= floor_tokens:
        return None
    half = len(own) // 2
    first, second = (
        _unit(spec.ordinal, spec.snapshot_hash, spec.processor_version, [], parts, unit_id=f"{spec.unit_id}.{index}")
        for index, parts in enumerate((own[:half], own[half:]))
    )
    return first, second


def _split_part(
    package_dir: Path, spec: UnitSpec, located: _Located, floor_tokens: int
) -> tuple[UnitSpec, UnitSpec] | None:
    """A unit of one part (or one slice of it) cut into two slices, without context, at the code point
    boundary nearest the middle byte; None when the slice is at most `floor_tokens` estimated tokens or
    a single code point. Reads only the slice's own bytes."""
    text, utf16_start = read_slice(package_dir, located.part, spec.slice)
    data = text.encode()
    if estimate_tokens_of_bytes(len(data)) <= floor_tokens or len(text) < 2:
        return None
    middle = _boundary(data, len(data) // 2) or _boundary(data, len(data) // 2, forward=True)
    start = spec.slice.start if spec.slice is not None else 0
    halves = (
        PartSlice.of(data[:middle], start, utf16_start),
        PartSlice.of(data[middle:], start + middle, utf16_start + _utf16_units(data[:middle])),
    )
    first, second = (
        _unit(spec.ordinal, spec.snapshot_hash, spec.processor_version, [], [located], unit_id=unit_id, bounds=bounds)
        for unit_id, bounds in zip((f"{spec.unit_id}.0", f"{spec.unit_id}.1"), halves, strict=True)
    )
    return first, second


def _scan(package_dir: Path, spec: UnitSpec) -> list[_Located]:
    """The located parts of `spec` (context first), checked against its snapshot and its input hash."""
    if snapshot_identity(package_dir) != spec.snapshot_hash:
        raise PackageUnreadable(f"unit {spec.unit_id} was planned over another snapshot than the one sealed here")
    wanted = spec.context_count + spec.part_count
    parts: list[_Located] = []
    for located in _extractable(package_dir, spec.files_offset, spec.records_offset, spec.rows_offset):
        parts.append(located)
        if len(parts) == wanted:
            break
    if len(parts) != wanted or _input_hash([located.part for located in parts]) != spec.input_hash:
        raise PackageUnreadable(f"unit {spec.unit_id} no longer matches the snapshot's manifests")
    return parts


def _extractable(
    package_dir: Path, files_start: int = 0, records_start: int = 0, first_rows_at: int | None = None
) -> Iterator[_Located]:
    """The text parts of records to extract, joined with their records, in files.jsonl order.

    files.jsonl lists a record's rows together (raw JSON first) and in records.jsonl's order, so both
    files are read once, side by side; a part naming a record not ahead in records.jsonl means a
    damaged manifest. `first_rows_at`: where the rows of the first part's record start, when reading
    from the middle of a record.
    """
    records = iter_records(package_dir, records_start)
    record: tuple[int, RecordRow] | None = None
    rows_at: tuple[str | None, int] = (None, files_start if first_rows_at is None else first_rows_at)
    for files_offset, row in iter_files(package_dir, files_start):
        if row.kind == "raw":
            rows_at = (row.record_ref, files_offset)
        if row.kind != "text":
            continue
        if rows_at[0] is None:
            rows_at = (row.record_ref, rows_at[1])
        elif rows_at[0] != row.record_ref:
            # A record without a raw row (not written by this package's snapshot): its first text row.
            rows_at = (row.record_ref, files_offset)
        while record is None or record[1].record_ref != row.record_ref:
            record = next(records, None)
            if record is None:
                raise PackageUnreadable(
                    f"files.jsonl row at byte {files_offset} names a record not listed (in order) in records.jsonl"
                )
        records_offset, owner = record
        if owner.processing_policy != EXTRACT_POLICY:
            continue
        part = PartSpec(
            ref=row.ref,
            record_ref=row.record_ref,
            part=row.part,
            path=row.path,
            size=row.size,
            sha256=row.sha256,
            session_id=owner.session_id,
            role=owner.role,
        )
        yield _Located(files_offset, records_offset, part, rows_at[1])


def _carried_call(current: list[_Located], incoming: _Located, cost: int, budget: UnitBudget) -> list[_Located]:
    """The trailing parts of `current` to move to the next unit so a tool result meets its call.

    When `incoming` is a tool result, that is the run of tool results before it and every part of the
    message before them (the call), provided something stays behind and the moved parts fit beside it.
    """
    if incoming.part.role != "tool":
        return []
    start = len(current)
    while start > 0 and current[start - 1].part.role == "tool":
        start -= 1
    if start == 0:
        return []
    call = current[start - 1].part.record_ref
    start -= 1
    while start > 0 and current[start - 1].part.record_ref == call:
        start -= 1
    carried = current[start:]
    if start == 0 or not _fits(_tokens(carried, budget) + cost, len(carried) + 1, budget):
        return []
    return carried


def _overlap(parts: list[_Located], budget: UnitBudget) -> list[_Located]:
    """The trailing parts of a unit that fit the overlap budget, as the next unit's context."""
    context: deque[_Located] = deque()
    size = 0
    for located in reversed(parts):
        size += located.part.tokens(budget)
        if size > budget.overlap_tokens:
            break
        context.appendleft(located)
    return list(context)


def _tokens(parts: list[_Located], budget: UnitBudget) -> int:
    return sum(located.part.tokens(budget) for located in parts)


def _unit(
    ordinal: int,
    snapshot_hash: str,
    processor_version: str,
    context: list[_Located],
    own: list[_Located],
    *,
    unit_id: str | None = None,
    bounds: PartSlice | None = None,
) -> UnitSpec:
    """The spec of a unit over `context` and `own` (a slice `bounds` of a single own part); its id is
    derived from them unless given (split)."""
    first = context[0] if context else own[0]
    input_hash = _input_hash([located.part for located in [*context, *own]])
    identity = json.dumps(
        [
            snapshot_hash,
            UNIT_STAGE,
            processor_version,
            input_hash,
            len(context),
            *([[bounds.start, bounds.end]] if bounds else []),
        ],
        separators=(",", ":"),
    )
    return UnitSpec(
        unit_id=unit_id or "x_" + hashlib.sha256(identity.encode()).hexdigest(),
        stage=UNIT_STAGE,
        ordinal=ordinal,
        snapshot_hash=snapshot_hash,
        processor_version=processor_version,
        input_hash=input_hash,
        files_offset=first.files_offset,
        records_offset=first.records_offset,
        context_count=len(context),
        part_count=len(own),
        first_ref=own[0].part.ref,
        last_ref=own[-1].part.ref,
        slice=bounds,
        record_files_offset=first.record_files_offset,
    )


def _slices(package_dir: Path, part: PartSpec, budget: UnitBudget) -> Iterator[PartSlice]:
    """Consecutive slices of the part's text, each within the material budget (in estimated tokens of its
    UTF-8 bytes), cut on code point boundaries; the part is read once, in chunks, and checked whole."""
    limit = (budget.material_tokens - budget.part_overhead_tokens) * BYTES_PER_TOKEN
    pending = bytearray()
    start = utf16_start = 0
    for chunk in iter_part_chunks(package_dir, part.path, size=part.size, sha256=part.sha256):
        pending += chunk
        while len(pending) > limit:
            cut = _boundary(pending, limit)
            piece = bytes(pending[:cut])
            yield PartSlice.of(piece, start, utf16_start)
            start, utf16_start = start + cut, utf16_start + _utf16_units(piece)
            del pending[:cut]
    yield PartSlice.of(bytes(pending), start, utf16_start)


def _boundary(data: bytes | bytearray, at: int, *, forward: bool = False) -> int:
    """The code point boundary in `data` at or before byte `at` (after it when `forward`): a UTF-8
    continuation byte never starts a slice. 0 when there is none before `at`."""
    step = 1 if forward else -1
    while 0 < at < len(data) and (data[at] & 0xC0) == 0x80:
        at += step
    return at


def _utf16_units(data: bytes) -> int:
    """UTF-16 code units of UTF-8 `data` (PackageUnreadable when it is not UTF-8)."""
    try:
        return len(data.decode("utf-8").encode("utf-16-le")) // 2
    except UnicodeDecodeError as exc:
        raise PackageUnreadable("a text part is not UTF-8") from exc


def _input_hash(parts: list[PartSpec]) -> str:
    listed = [[part.ref, part.sha256, part.session_id, part.role] for part in parts]
    return hashlib.sha256(json.dumps(listed, separators=(",", ":")).encode()).hexdigest()
