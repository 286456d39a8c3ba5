"""One extraction unit: read its parts from the sealed snapshot, ask the model, check, write the result.

No database work happens here (the caller's short transactions surround it). The result is written to
``work/<unit id>.json`` through a temporary file and a rename, and its sha256 returned, so the caller can
commit path and hash; a crash before that commit leaves at most a result the next run overwrites.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from continuum_merge.extraction.attachments import check_attachments
from continuum_merge.extraction.budget import CallPolicy
from continuum_merge.extraction.errors import AnswerInvalid, PackageUnreadable, UnitTooLarge
from continuum_merge.extraction.package import WORK_DIR, file_sha256, write_atomic
from continuum_merge.extraction.plan import PartSlice, PartSpec, UnitBudget, UnitSpec, read_slice, scan_unit
from continuum_merge.extraction.prompts import extract_request
from continuum_merge.extraction.schema import SCHEMA_VERSION, AnswerItem, AnswerProblem, parse_answer
from continuum_runtime.provider import (
    ChatMessage,
    Completion,
    ModelProvider,
    ProviderBadResponse,
    ProviderError,
    ProviderInputTooLarge,
    ProviderOutputTruncated,
    ProviderRateLimited,
    ProviderUnavailable,
    Usage,
    estimate_message_tokens,
)

__all__ = [
    "RESULT_KIND",
    "SHRINKABLE",
    "CallHook",
    "CallRecord",
    "UnitOutcome",
    "ask_items",
    "complete_patiently",
    "item_id",
    "run_unit",
    "sum_usage",
    "verify_unit_result",
]

logger = logging.getLogger("continuum.merge.extraction")

RESULT_KIND = "extraction"


@dataclass(frozen=True)
class CallRecord:
    """One model request a unit made: who answered, what it cost (as reported) and how it ended."""

    model: str
    usage: Usage
    finish_reason: str | None


# Told of each answered model call: the unit id or condensing pack it was for, and the call.
CallHook = Callable[[str, CallRecord], None]


@dataclass(frozen=True)
class UnitOutcome:
    """A unit's written result."""

    unit_id: str
    # Absolute, and relative to the operation's directory (what the unit row stores).
    path: Path
    relative_path: str
    sha256: str
    item_count: int
    # The model that answered the accepted request.
    model: str
    # Summed over the calls; None when any call's usage was not reported (unknown is not zero).
    usage: Usage | None
    calls: tuple[CallRecord, ...]


async def run_unit(
    spec: UnitSpec,
    package_dir: Path,
    provider: ModelProvider,
    *,
    model: str,
    budget: UnitBudget | None = None,
    policy: CallPolicy | None = None,
    on_call: CallHook | None = None,
) -> UnitOutcome:
    """Extract `spec`'s parts with `provider` and write ``work/<unit id>.json`` (file work in a thread).

    `model` is the model the operation asked for (recorded beside the one that answered). An answer
    that fails the checks gets one repair request naming the problem; a second failure raises
    AnswerInvalid. UnitTooLarge (byte guards), `ProviderInputTooLarge` and `ProviderOutputTruncated` mean
    the unit must be split (`split_unit`); other `ProviderError`s propagate as they are; a damaged
    snapshot raises PackageUnreadable; a user message of unreadable attachments only raises
    AttachmentUnreadable (before any call); no room to write the result raises StorageShort. Nothing
    is written unless the answer is accepted. `on_call` hears of every answered call, also those of a
    unit that then fails (their usage still counts). Each call is made under `policy`
    (`complete_patiently`).
    """
    budget = budget or UnitBudget()
    context, own = await asyncio.to_thread(scan_unit, package_dir, spec)
    await asyncio.to_thread(check_attachments, package_dir, spec.rows_offset, own)
    inputs, by_alias = await asyncio.to_thread(_inputs, package_dir, context, own, spec.slice)
    items, completion, calls = await ask_items(
        provider,
        lambda rejected: extract_request(inputs, rejected=rejected),
        by_alias,
        budget=budget,
        subject=spec.unit_id,
        operation_id=package_dir.name,
        policy=policy,
        on_call=on_call,
    )
    return await asyncio.to_thread(_write, spec, package_dir, model, completion, items, by_alias, calls)


async def ask_items(
    provider: ModelProvider,
    request: Callable[[str | None], list[ChatMessage]],
    aliases: Collection[str],
    *,
    budget: UnitBudget,
    subject: str,
    operation_id: str = "",
    policy: CallPolicy | None = None,
    on_call: CallHook | None = None,
) -> tuple[list[AnswerItem], Completion, tuple[CallRecord, ...]]:
    """Send `request(None)`; when the answer fails the checks, send `request(problem)` once more.

    `operation_id` (the package directory's name) and `subject` name the call in logs.
    Returns the checked items, the accepted completion and every call made. Raises AnswerInvalid
    (naming `subject`, a unit or condensing pack) when the repaired answer fails too, and UnitTooLarge
    when a request or an answer is over the budget's byte guards. `on_call(subject, call)` hears of
    each answered call as it ends, accepted, rejected or cut off (for per-call accounting). Logs ids, figures and
    reasons only: never the request or the answer. Each call is made under `policy` (`complete_patiently`).
    """
    policy = policy or CallPolicy()
    calls: list[CallRecord] = []
    rejected: str | None = None
    for attempt in (1, 2):
        messages = request(rejected)
        request_bytes = sum(len(message.content.encode()) for message in messages)
        if request_bytes > budget.request_bytes:
            raise UnitTooLarge(
                f"{subject}: request of {request_bytes} bytes is over the {budget.request_bytes}-byte guard",
                unit_id=subject,
            )
        try:
            completion = await complete_patiently(
                provider,
                messages,
                max_output_tokens=budget.generation_tokens,
                policy=policy,
                subject=subject,
                operation_id=operation_id,
            )
        except ProviderOutputTruncated as truncated:
            # A cut-off answer is never used, but it was paid for.
            if on_call is not None:
                on_call(subject, CallRecord(provider.model, truncated.usage, "length"))
            raise
        calls.append(CallRecord(completion.model, completion.usage, completion.finish_reason))
        if on_call is not None:
            on_call(subject, calls[-1])
        figures = {
            "operation_id": operation_id,
            "subject": subject,
            "attempt": attempt,
            "model": completion.model,
            "request_bytes": request_bytes,
            "estimated_input_tokens": sum(estimate_message_tokens(m.role, m.content) for m in messages),
            "material_tokens": budget.material_tokens,
            "visible_target_tokens": budget.output_tokens,
            "max_output_tokens": budget.generation_tokens,
            "finish_reason": completion.finish_reason,
            "usage_reported": completion.usage.reported,
        }
        response_bytes = len(completion.text.encode())
        if response_bytes > budget.response_bytes:
            logger.warning("structured answer over the byte guard", extra=figures)
            raise UnitTooLarge(
                f"{subject}: answer of {response_bytes} bytes is over the {budget.response_bytes}-byte guard",
                unit_id=subject,
            )
        try:
            items = parse_answer(completion.text, aliases)
        except AnswerProblem as problem:
            rejected = str(problem)
            logger.warning("structured answer rejected", extra=figures | {"problem": rejected})
            continue
        logger.info("structured answer accepted", extra=figures | {"items": len(items)})
        return items, completion, tuple(calls)
    raise AnswerInvalid(f"{subject}: answer still invalid after one repair: {rejected}", unit_id=subject)


# What a smaller input may cure: the request or the answer did not fit, or the model kept answering
# outside the schema after its one repair. The caller bisects the input (a unit or a condensing pack).
SHRINKABLE = (UnitTooLarge, ProviderInputTooLarge, ProviderOutputTruncated, AnswerInvalid)
# Failures another attempt of the same request may cure: 429, 5xx, network, timeout, a garbled answer.
_TRANSIENT = (ProviderRateLimited, ProviderUnavailable, ProviderBadResponse)


async def complete_patiently(
    provider: ModelProvider,
    messages: Sequence[ChatMessage],
    *,
    max_output_tokens: int,
    policy: CallPolicy,
    subject: str,
    operation_id: str = "",
) -> Completion:
    """`provider.complete` with the per-call timeout and up to `policy.attempts` attempts.

    A rate limit, an unavailable provider (5xx, network), a call over its timeout or an answer that is
    not a chat completion is tried again after the backoff (or the server's Retry-After) on the
    policy's clock; the last attempt's error propagates (a timeout as `ProviderUnavailable`). Every
    other `ProviderError` (credentials, a refused model, a prompt too large, a truncated answer)
    propagates at once: another attempt of the same request cannot cure it.
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return await _within_timeout(provider.complete(messages, max_output_tokens=max_output_tokens), policy)
        except ProviderError as error:
            if not isinstance(error, _TRANSIENT) or attempt == policy.attempts:
                raise
            delay = policy.delay(attempt, getattr(error, "retry_after", None))
            logger.warning(
                "model call failed, trying again",
                extra={
                    "operation_id": operation_id,
                    "subject": subject,
                    "attempt": attempt,
                    "model": provider.model,
                    "error": type(error).__name__,
                    "status": error.status,
                    "request_id": error.request_id,
                    "delay_seconds": delay,
                },
            )
            await policy.clock.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _within_timeout(call: Awaitable[Completion], policy: CallPolicy) -> Completion:
    """`call`'s completion, or ProviderUnavailable once `policy.timeout_seconds` pass on its clock (the call
    is cancelled, its connection closed)."""
    task = asyncio.ensure_future(call)
    timer = asyncio.ensure_future(policy.clock.sleep(policy.timeout_seconds))
    try:
        await asyncio.wait((task, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ProviderUnavailable(f"model call timed out after {policy.timeout_seconds:g} s")
    return task.result()


def verify_unit_result(package_dir: Path, relative_path: str, sha256: str) -> Path:
    """The committed result at `relative_path` (as the unit row stores it) after checking its sha256.

    A completed unit is reused only through this; PackageUnreadable when it is missing or changed.
    """
    name = PurePosixPath(relative_path)
    if name.parent != PurePosixPath(WORK_DIR) or not name.name.endswith(".json"):
        raise PackageUnreadable(f"unit result path {relative_path!r} is not in the work directory")
    path = package_dir / WORK_DIR / name.name
    try:
        matches = not path.is_symlink() and file_sha256(path) == sha256
    except OSError as exc:
        raise PackageUnreadable(f"unit result {name.name} is missing ({type(exc).__name__})") from exc
    if not matches:
        raise PackageUnreadable(f"unit result {name.name} does not match its committed sha256")
    return path


def item_id(unit_id: str, index: int) -> str:
    """The program-assigned id of the `index`-th item of a unit (layer) result."""
    return "it_" + hashlib.sha256(f"{unit_id}\n{index}".encode()).hexdigest()[:32]


def sum_usage(calls: Sequence[CallRecord]) -> Usage | None:
    """The calls' usage added up, or None when any call left a figure unreported."""
    prompt = [call.usage.prompt_tokens for call in calls]
    completion = [call.usage.completion_tokens for call in calls]
    if any(value is None for value in (*prompt, *completion)):
        return None
    return Usage(
        prompt_tokens=sum(v for v in prompt if v is not None),
        completion_tokens=sum(v for v in completion if v is not None),
    )


def _inputs(
    package_dir: Path, context: list[PartSpec], own: list[PartSpec], piece: PartSlice | None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The request's inputs (text read and verified; only the slice `piece` of a split single part, whose
    bytes alone are read) and each alias's evidence entry, with the UTF-16 range it covers."""
    inputs: list[dict[str, Any]] = []
    by_alias: dict[str, dict[str, Any]] = {}
    for number, part in enumerate([*context, *own], start=1):
        alias = f"i{number}"
        # A slice unit has a single own part and no context.
        text, first = read_slice(package_dir, part, piece if number > len(context) else None)
        entry: dict[str, Any] = {"alias": alias, "role": part.role, "source": part.session_id, "text": text}
        if number <= len(context):
            entry["context"] = True
        inputs.append(entry)
        by_alias[alias] = {
            "ref": part.ref,
            "recordRef": part.record_ref,
            "part": part.part,
            "sessionId": part.session_id,
            # In UTF-16 code units (what editors and browsers index by).
            "utf16": [first, first + len(text.encode("utf-16-le")) // 2],
        }
    return inputs, by_alias


def _write(
    spec: UnitSpec,
    package_dir: Path,
    requested_model: str,
    completion: Completion,
    items: list[AnswerItem],
    by_alias: dict[str, dict[str, Any]],
    calls: tuple[CallRecord, ...],
) -> UnitOutcome:
    result = {
        "schemaVersion": SCHEMA_VERSION,
        "kind": RESULT_KIND,
        "unitId": spec.unit_id,
        "ordinal": spec.ordinal,
        "snapshotHash": spec.snapshot_hash,
        "inputHash": spec.input_hash,
        "processorVersion": spec.processor_version,
        "requestedModel": requested_model,
        "model": completion.model,
        "items": [
            {
                "itemId": item_id(spec.unit_id, index),
                "section": item.section,
                "status": item.status,
                "content": item.content,
                "evidence": [by_alias[alias] for alias in item.evidence],
            }
            for index, item in enumerate(items)
        ],
    }
    relative = f"{WORK_DIR}/{spec.unit_id}.json"
    path = package_dir / relative
    digest = write_atomic(path, json.dumps(result, ensure_ascii=False, sort_keys=True).encode())
    return UnitOutcome(
        unit_id=spec.unit_id,
        path=path,
        relative_path=relative,
        sha256=digest,
        item_count=len(items),
        model=completion.model,
        usage=sum_usage(calls),
        calls=calls,
    )
