"""Compaction itself: load after the boundary, cut at whole turns, summarize in batches, persist by CAS.

The order of one compaction (seed 001 §7.2-§7.10):
1. read the record and validate its boundary message; an invalid one is dropped and the full
   history loaded once (no recursion, no second model call);
2. load only messages with id > boundary and normalize them;
3. if the trigger holds (or the user forced it), summarize whole-turn batches; a failed batch
   stops the later ones;
4. pick the largest successful batch prefix whose boundary passes the prefix-integrity check;
5. move transcript's edit fence up to the new boundary, a compare-and-set from the fence read with
   the session at the history generation that was loaded: an edit in between, or another
   compaction moving the fence first, makes us discard the result; an edit afterwards is refused;
6. compare-and-set the record; on a conflict discard the result, reload once and go on without
   compacting again; on success reload after the new boundary so messages written meanwhile count.
No model call holds a database transaction. Once a compaction started, a failure of what it depends on
(transcript, the model, the database) is recorded as FAILED and the request is answered from its
baseline; anything else is a bug and reaches the caller as INTERNAL, logged with its frames.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_compaction import store
from continuum_compaction.announce import Announcer
from continuum_compaction.convert import event_message, outcome_name, trigger_name
from continuum_compaction.cuts import Unit, batches, plan_cut, safe_boundary, should_compact
from continuum_compaction.errors import CompactionError
from continuum_compaction.facts import Fact, preserved_facts
from continuum_compaction.history import LoadedHistory, load_history
from continuum_compaction.settings import CompactionSettings
from continuum_compaction.summarizer import BatchSummary, summarize_batch, summary_message_text
from continuum_compaction.transcript_client import FenceMoved, HistoryRewritten, TranscriptClient
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_runtime.provider import ModelProvider, ProviderError, ProviderInputTooLarge, estimate_message_tokens

logger = logging.getLogger("continuum.compaction")

# The shortest a message is clipped to when a summarization prompt is too large for the model.
MIN_MESSAGE_CHARS = 200
# What a started compaction depends on may fail: transcript (unreachable or refusing), the model, the
# database (SQLAlchemy wraps driver errors; a connection that cannot even be opened is an OSError).
DEPENDENCY_FAILURES = (CompactionError, ProviderError, SQLAlchemyError, OSError)


@dataclass(frozen=True)
class Baseline:
    """The summary in force and the messages after its boundary, as loaded for one request."""

    record: store.CompactionRecord | None
    history: LoadedHistory
    boundary_was_invalid: bool = False

    @property
    def summary(self) -> str:
        """The summary text, empty when there is none."""
        return self.record.summary_text if self.record is not None else ""

    @property
    def boundary(self) -> int:
        """The last summarized message id (0: none)."""
        return self.history.boundary

    @property
    def estimated_tokens(self) -> int:
        """Estimated tokens of summary + every message after the boundary (what the trigger compares)."""
        summary = estimate_message_tokens("system", summary_message_text(self.summary)) if self.summary else 0
        return summary + self.history.tokens


@dataclass(frozen=True)
class Attempt:
    """How a compaction is asked for."""

    mode: events_pb2.TriggerMode.ValueType
    run_id: str
    # Bypass only the threshold (manual compaction).
    force: bool
    # Completed tool rounds of the running turn may be compacted (a tool-round boundary).
    mid_loop: bool
    window_tokens: int
    # What the request carries besides summary and messages and the trigger must count too (a merged
    # session's reference entry): counted here once, never also taken off the window.
    extra_tokens: int = 0


class Compactor:
    """Compacts sessions for one process; stateless between requests."""

    def __init__(
        self,
        settings: CompactionSettings,
        database: Database,
        transcript: TranscriptClient,
        provider: ModelProvider,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._database = database
        self._transcript = transcript
        self._provider = provider
        self._clock = clock

    async def load(self, user: str, session_id: str) -> Baseline:
        """Read the record, validate its boundary, and load only the messages after it."""
        async with self._database.connection() as connection:
            record = await store.load_record(connection, session_id)
        return await self.load_from(user, session_id, record)

    async def load_from(self, user: str, session_id: str, record: store.CompactionRecord | None) -> Baseline:
        """Validate the boundary of `record` (as the caller just read it) and load only the messages after it."""
        invalid = False
        if record is not None and record.last_compacted_msg_id > 0:
            reason = await self._boundary_problem(user, session_id, record.last_compacted_msg_id)
            if reason:
                logger.warning(
                    "compaction boundary is invalid; dropping the record and loading the full history",
                    extra={"session_id": session_id, "boundary": record.last_compacted_msg_id, "reason": reason},
                )
                async with self._database.transaction() as connection:
                    await store.delete_record(connection, session_id, record.last_compacted_msg_id)
                record, invalid = None, True
        return await self._load_after(user, session_id, record, invalid)

    async def _load_after(
        self, user: str, session_id: str, record: store.CompactionRecord | None, invalid: bool = False
    ) -> Baseline:
        boundary = record.last_compacted_msg_id if record is not None else 0
        messages, clipped = await self._transcript.list_after(
            user, session_id, boundary, self._settings.context_message_max_bytes
        )
        return Baseline(record, load_history(boundary, messages, clipped), invalid)

    async def _boundary_problem(self, user: str, session_id: str, boundary: int) -> str:
        message = await self._transcript.get_message(user, session_id, boundary)
        if message is None:
            return "missing"
        if message.session_id != session_id:
            return "other_session"
        if message.deleted:
            return "deleted"
        return ""

    async def compact(
        self, user: str, session: tpb.Session, baseline: Baseline, attempt: Attempt, announcer: Announcer
    ) -> tuple[Baseline, api.CompactionReport]:
        """Compact once if due; returns the baseline to build the request from and what happened."""
        settings = self._settings
        plan = plan_cut(baseline.history, settings.recent_turns, attempt.mid_loop)
        report = api.CompactionReport(
            outcome=events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED,
            boundary_before=baseline.boundary,
            boundary_after=baseline.boundary,
            boundary_was_invalid=baseline.boundary_was_invalid,
        )
        due = attempt.force or should_compact(
            estimated_tokens=baseline.estimated_tokens + attempt.extra_tokens,
            window_tokens=attempt.window_tokens,
            trigger_ratio=settings.trigger_ratio,
            plan=plan,
            min_compact_messages=settings.min_compact_message_count,
            min_new_messages=settings.min_new_message_count,
        )
        if not due:
            return baseline, report
        report.trigger_mode = attempt.mode
        run = _Run(session.session_id, attempt, baseline, self._clock)
        if not plan.candidates:
            report.outcome = events_pb2.COMPACTION_OUTCOME_NOTHING_TO_COMPACT
            await self._finish(run, report, baseline, announcer)
            return baseline, report
        await announcer.started(attempt.mode, attempt.run_id, baseline.boundary)
        try:
            return await self._run(user, session, baseline, plan.candidates, run, report, announcer)
        except DEPENDENCY_FAILURES as error:
            # The request still gets a correct context (the summary it started from and everything
            # after it); the attempt is recorded and announced as failed unless it already persisted.
            logger.warning("compaction failed", extra={"session_id": session.session_id, "error": type(error).__name__})
            if report.outcome != events_pb2.COMPACTION_OUTCOME_COMPACTED:
                report.outcome = events_pb2.COMPACTION_OUTCOME_FAILED
                with contextlib.suppress(*DEPENDENCY_FAILURES):
                    await self._finish(run, report, baseline, announcer)
            return baseline, report

    async def _run(
        self,
        user: str,
        session: tpb.Session,
        baseline: Baseline,
        candidates: Sequence[Unit],
        run: _Run,
        report: api.CompactionReport,
        announcer: Announcer,
    ) -> tuple[Baseline, api.CompactionReport]:
        if max(max(unit.ids) for unit in candidates) < session.compaction_fence_message_id:
            # Another compaction fenced past everything this one could summarize and is persisting
            # (or crashed before it could; the next compaction that reaches further moves on).
            report.outcome = events_pb2.COMPACTION_OUTCOME_CONFLICT
            reloaded = await self.load(user, session.session_id)
            await self._finish(run, report, reloaded, announcer)
            return reloaded, report
        done, run.failed = await self._summarize(baseline.summary, candidates)
        chosen = _largest_safe_prefix(baseline.history, done)
        if chosen is None:
            report.outcome = events_pb2.COMPACTION_OUTCOME_FAILED
            await self._finish(run, report, baseline, announcer)
            return baseline, report
        boundary, summary, run.succeeded = chosen
        succeeded = [result for _, result in done[: run.succeeded]]
        # Each batch checked every fact carried into it, so the last one speaks for the whole summary.
        report.facts_found = summary.facts_found
        report.facts_kept = summary.facts_kept
        new = store.NewSummary(
            session_id=session.session_id,
            expected_boundary=baseline.record.last_compacted_msg_id if baseline.record is not None else None,
            boundary=boundary,
            summary_text=summary.text,
            model=summary.model,
            input_tokens=sum(result.input_tokens for result in succeeded),
            output_tokens=sum(result.output_tokens for result in succeeded),
        )
        fence = session.compaction_fence_message_id
        persisted: tuple[store.CompactionRecord, dict[str, Any]] | None = None
        # Below the fence another compaction already covers more: yield to its summary. At the fence,
        # the messages are already protected; above it, move it first (compare-and-set).
        if boundary >= fence:
            try:
                if boundary > fence:
                    await self._transcript.set_fence(
                        user, session.session_id, boundary, session.history_generation, expected_fence=fence
                    )
                persisted = await self._persist(new, run, report)
            except HistoryRewritten:
                report.outcome = events_pb2.COMPACTION_OUTCOME_HISTORY_REWRITTEN
                reloaded = await self.load(user, session.session_id)
                await self._finish(run, report, reloaded, announcer)
                return reloaded, report
            except FenceMoved:
                persisted = None
        if persisted is None:
            # Never resubmit this result against the newer boundary: it did not fold that summary in.
            report.outcome = events_pb2.COMPACTION_OUTCOME_CONFLICT
            reloaded = await self.load(user, session.session_id)
            await self._finish(run, report, reloaded, announcer)
            return reloaded, report
        # The record just stored needs neither a second read nor a boundary check: its boundary was in
        # the history loaded at this generation and is fenced now. Messages written meanwhile count.
        record, recorded = persisted
        reloaded = await self._load_after(user, session.session_id, record)
        report.boundary_after = reloaded.boundary
        await announcer.finished(event_message(recorded, include_summary=False))
        return reloaded, report

    async def _summarize(
        self, previous: str, candidates: Sequence[Unit]
    ) -> tuple[list[tuple[list[Unit], BatchSummary]], int]:
        settings = self._settings
        done: list[tuple[list[Unit], BatchSummary]] = []
        summary = previous
        facts = preserved_facts(previous)
        for batch in batches(candidates, settings.max_batch_messages, settings.max_rounds_per_request):
            try:
                result = await self._summarize_batch(summary, batch, facts)
            except ProviderError as error:
                # Later batches would summarize a history with a hole in it: stop here.
                logger.warning("summary batch failed", extra={"reason": error.reason, "batch_messages": _size(batch)})
                return done, 1
            done.append((batch, result))
            summary, facts = result.text, list(result.facts)
        return done, 0

    async def _summarize_batch(self, summary: str, batch: Sequence[Unit], facts: Sequence[Fact]) -> BatchSummary:
        """One batch; a prompt the model finds too large is retried with each message clipped shorter,
        since a whole turn is never split and would otherwise block compaction for good."""
        settings = self._settings
        clip = settings.summary_input_message_chars
        while True:
            try:
                return await summarize_batch(
                    self._provider,
                    summary,
                    batch,
                    carried_facts=facts,
                    max_output_tokens=settings.summary_max_output_tokens,
                    max_message_chars=clip,
                )
            except ProviderInputTooLarge:
                if clip <= MIN_MESSAGE_CHARS:
                    raise
                clip = max(MIN_MESSAGE_CHARS, clip // 4)
                logger.info("summary prompt too large; clipping messages shorter", extra={"clip_chars": clip})

    async def _persist(
        self, new: store.NewSummary, run: _Run, report: api.CompactionReport
    ) -> tuple[store.CompactionRecord, dict[str, Any]] | None:
        """CAS the summary and record its event in one transaction: the stored record and event, None on
        a conflict."""
        async with self._database.transaction() as connection:
            record = await store.persist_summary(connection, new, self._clock.now_ms())
            if record is None:
                return None
            report.outcome = events_pb2.COMPACTION_OUTCOME_COMPACTED
            tail = sum(message.tokens for message in run.before.history.view if message.message_id > new.boundary)
            row = run.event(
                report,
                boundary_after=new.boundary,
                tokens_after=_tokens_of(new.summary_text) + tail,
                model=new.model,
                summary_text=new.summary_text,
            )
            report.event_id = await store.record_event(connection, row, self._clock.now_ms())
        return record, {**row.__dict__, "event_id": report.event_id, "create_ms": self._clock.now_ms()}

    async def _finish(self, run: _Run, report: api.CompactionReport, after: Baseline, announcer: Announcer) -> None:
        """Record and announce an attempt that persisted nothing."""
        report.boundary_after = after.boundary
        row = run.event(report, boundary_after=after.boundary, tokens_after=after.estimated_tokens)
        async with self._database.transaction() as connection:
            report.event_id = await store.record_event(connection, row, self._clock.now_ms())
        recorded = {**row.__dict__, "event_id": report.event_id, "create_ms": self._clock.now_ms()}
        await announcer.finished(event_message(recorded, include_summary=False))


@dataclass
class _Run:
    """One compaction attempt in progress, as its event will record it."""

    session_id: str
    attempt: Attempt
    before: Baseline
    clock: Clock
    started: float = field(init=False)
    succeeded: int = 0
    failed: int = 0

    def __post_init__(self) -> None:
        self.started = self.clock.monotonic()

    def event(
        self,
        report: api.CompactionReport,
        *,
        boundary_after: int,
        tokens_after: int,
        model: str = "",
        summary_text: str | None = None,
    ) -> store.EventRow:
        """The event row of this attempt with the outcome in `report`."""
        return store.EventRow(
            session_id=self.session_id,
            run_id=self.attempt.run_id,
            trigger_mode=trigger_name(self.attempt.mode),
            outcome=outcome_name(report.outcome),
            boundary_before=self.before.boundary,
            boundary_after=boundary_after,
            tokens_before=self.before.estimated_tokens,
            tokens_after=tokens_after,
            model=model,
            duration_ms=int((self.clock.monotonic() - self.started) * 1000),
            batches_succeeded=self.succeeded,
            batches_failed=self.failed,
            facts_found=report.facts_found,
            facts_kept=report.facts_kept,
            summary_text=summary_text,
        )


def _largest_safe_prefix(
    history: LoadedHistory, done: Sequence[tuple[list[Unit], BatchSummary]]
) -> tuple[int, BatchSummary, int] | None:
    """(boundary, cumulative summary, batches) of the longest run of successful batches whose boundary
    passes the prefix-integrity check; None when no prefix is safe."""
    for count in range(len(done), 0, -1):
        units = [unit for batch, _ in done[:count] for unit in batch]
        boundary = safe_boundary(history, units)
        if boundary is not None:
            return boundary, done[count - 1][1], count
    return None


def _size(batch: Sequence[Unit]) -> int:
    return sum(len(unit.messages) for unit in batch)


def _tokens_of(summary: str) -> int:
    return estimate_message_tokens("system", summary_message_text(summary))
