"""BuildContext: the history an agent's next model request carries (seed 001 §7.2, seed 004 §5.1-§5.2).

The existing summary is always injected, whether or not this request compacts and also when automatic
compaction is off. A manual compaction queued for this run fires at its tool-round boundary whatever
the automatic setting says; a signal of any other run is stale and is dropped. Whether memory is
injected is decided when a run starts and kept for all its requests.
"""

from __future__ import annotations

import asyncio
import logging

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum_compaction import store, validation
from continuum_compaction.announce import Announcer
from continuum_compaction.compactor import Attempt, Compactor
from continuum_compaction.cuts import newest_turns_within
from continuum_compaction.errors import CapacityExceeded
from continuum_compaction.handoff import HandoffContext, HandoffEntry, entry_budget
from continuum_compaction.request import ModelRequest, build_request
from continuum_compaction.settings import CompactionSettings
from continuum_compaction.transcript_client import TranscriptClient
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_runtime.wire_names import merge_operation_id

logger = logging.getLogger("continuum.compaction")


class ContextBuilder:
    """Builds model requests for agent runtimes."""

    def __init__(
        self,
        settings: CompactionSettings,
        database: Database,
        transcript: TranscriptClient,
        compactor: Compactor,
        handoff: HandoffContext,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._database = database
        self._transcript = transcript
        self._compactor = compactor
        self._handoff = handoff
        self._clock = clock

    async def build(self, user: str, request: api.BuildContextRequest) -> api.BuildContextResponse:
        """Validate, load after the boundary, compact if due or signalled, assemble, describe."""
        validation.build_context(request)
        session_id, run_id = request.session_id, request.run_id
        session = await self._transcript.get_session(user, session_id)
        window = request.context_window_tokens or self._settings.context_window_tokens
        # Only a merged session asks handoff-read anything; every other session's request is built as before.
        # Asked before a queued manual compaction is taken, so a refusal here leaves the signal queued.
        operation_id = merge_operation_id(session.metadata)
        entry: HandoffEntry | None = None
        if operation_id:
            settings = self._settings
            budget = entry_budget(
                window, settings.trigger_ratio, settings.handoff_reference_ratio, settings.handoff_reference_max_tokens
            )
            entry = await self._handoff.entry(user, session_id, operation_id, request, budget)
        mid_loop = request.trigger_point == api.TRIGGER_POINT_MID_LOOP
        async with self._database.transaction() as connection:
            signalled = await store.settle_signals(connection, session_id, run_id, take=mid_loop)
            inject_memory = await store.memory_choice(
                connection,
                session_id,
                run_id,
                not mid_loop,
                not session.memory_injection_disabled,
                self._clock.now_ms(),
            )
            # Read here rather than on a connection of its own: one round of database work per request.
            record = await store.load_record(connection, session_id)
        extra = entry.tokens if entry is not None else 0
        announcer = Announcer(self._transcript, user, session_id)
        attempt: Attempt | None = None
        if signalled:
            attempt = Attempt(
                events_pb2.TRIGGER_MODE_MANUAL,
                run_id,
                force=True,
                mid_loop=True,
                window_tokens=window,
                extra_tokens=extra,
            )
        elif self._settings.auto_compaction and not request.skip_auto_compaction:
            mode = events_pb2.TRIGGER_MODE_MID_LOOP if mid_loop else events_pb2.TRIGGER_MODE_REQUEST_START
            attempt = Attempt(mode, run_id, force=False, mid_loop=mid_loop, window_tokens=window, extra_tokens=extra)
        try:
            baseline = await self._compactor.load_from(user, session_id, record)
            if attempt is not None:
                baseline, report = await self._compactor.compact(user, session, baseline, attempt, announcer)
        except BaseException:
            if signalled:
                # The user was told "queued": a request that failed before compacting must not use it up.
                await asyncio.shield(self._requeue(session_id, run_id))
            raise
        if attempt is None:
            report = api.CompactionReport(
                outcome=events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED,
                boundary_before=baseline.boundary,
                boundary_after=baseline.boundary,
                boundary_was_invalid=baseline.boundary_was_invalid,
            )
        memory = list(request.memory_entries) if inject_memory else []
        # The answer stays bounded whatever the history after the boundary holds (see the settings).
        history, omitted = newest_turns_within(baseline.history, self._settings.context_max_bytes)
        if omitted:
            logger.warning(
                "messages left out of a request: the history after the boundary passes the response limit",
                extra={"session_id": session_id, "boundary": baseline.boundary, "omitted": omitted},
            )

        def assemble(with_entry: HandoffEntry | None) -> ModelRequest:
            return build_request(
                session_id,
                request.system_prompt_sections,
                memory,
                baseline.summary,
                history,
                window,
                self._settings.manifest_max_bytes,
                omitted,
                with_entry,
            )

        built = assemble(entry)
        if entry is not None and built.manifest.estimated_total_tokens > window:
            # The entry gives way to the request, never the other way round: a smaller entry in what is
            # left of the window, or the capacity error when not even the minimal one fits.
            left = window - (built.manifest.estimated_total_tokens - entry.tokens)
            if left < 1:
                raise CapacityExceeded(
                    "the merged session's reference entry does not fit the model's window with the current request"
                )
            entry = await self._handoff.entry(user, session_id, operation_id, request, left)
            built = assemble(entry)
        await announcer.context_window(built.manifest)
        return api.BuildContextResponse(
            system_prompt=built.system_prompt,
            messages=built.messages,
            manifest=built.manifest,
            compaction=report,
            boundary_message_id=baseline.boundary,
            tool_definitions=[entry.tool] if entry is not None and entry.tool is not None else [],
        )

    async def _requeue(self, session_id: str, run_id: str) -> None:
        async with self._database.transaction() as connection:
            await store.put_signal(connection, session_id, run_id, self._clock.now_ms())
