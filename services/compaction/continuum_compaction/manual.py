"""Manual compaction, `compact_now` (seed 004 §5.4).

Idle session: take a `compaction` claim first (a new turn is then refused with SESSION_ALREADY_RUNNING),
compact bypassing only the threshold, release. The claim's lease is short and renewed by a heartbeat
while the model works, so a compaction that crashed frees the session soon. Running session: queue a
signal bound to the running turn's run id; the runtime consumes it at its next tool-round boundary.
Repeating either is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum_compaction import store, validation
from continuum_compaction.announce import Announcer
from continuum_compaction.claim_holder import ClaimHolder
from continuum_compaction.compactor import Attempt, Compactor
from continuum_compaction.errors import CompactionError, SessionBusy
from continuum_compaction.request import build_request
from continuum_compaction.settings import CompactionSettings
from continuum_compaction.transcript_client import SessionRunning, TranscriptClient
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database

logger = logging.getLogger("continuum.compaction")

RUN_CLAIM = "CLAIM_KIND_RUN"
COMPACTION_CLAIM = "CLAIM_KIND_COMPACTION"


class ManualCompaction:
    """Runs or queues compactions a user asked for."""

    def __init__(
        self,
        settings: CompactionSettings,
        database: Database,
        transcript: TranscriptClient,
        compactor: Compactor,
        holder: ClaimHolder,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._database = database
        self._transcript = transcript
        self._compactor = compactor
        self._holder = holder
        self._clock = clock

    async def compact_now(self, user: str, request: api.CompactNowRequest) -> api.CompactNowResponse:
        """Compact the idle session now, or queue for the running turn."""
        session_id = validation.session_id(request.session_id)
        window = validation.window(request.context_window_tokens) or self._settings.context_window_tokens
        session = await self._transcript.get_session(user, session_id)
        await self._holder.ready()
        try:
            claim_id = await self._acquire(user, session_id)
        except SessionRunning as running:
            if running.holder_kind == RUN_CLAIM and running.holder:
                async with self._database.transaction() as connection:
                    await store.put_signal(connection, session_id, running.holder, self._clock.now_ms())
                return api.CompactNowResponse(state=api.COMPACT_NOW_STATE_QUEUED, run_id=running.holder)
            if running.holder_kind == COMPACTION_CLAIM:
                return api.CompactNowResponse(state=api.COMPACT_NOW_STATE_IN_PROGRESS)
            raise SessionBusy(
                "the session is busy (a merge is reading it); try again when it finishes",
                metadata={
                    "session_id": session_id,
                    "holder_kind": running.holder_kind,
                    "holder": running.holder,
                    "expire_time": running.expire_time,
                },
            ) from running
        renewing = asyncio.create_task(self._keep_claim(user, claim_id))
        try:
            baseline = await self._compactor.load(user, session_id)
            # The event's run id names this one request; the claim's holder names the replica.
            run_id = f"compact-now:{uuid.uuid4().hex}"
            attempt = Attempt(events_pb2.TRIGGER_MODE_MANUAL, run_id, force=True, mid_loop=False, window_tokens=window)
            announcer = Announcer(self._transcript, user, session_id)
            baseline, report = await self._compactor.compact(user, session, baseline, attempt, announcer)
            # No runtime is running to send a request: announce what the history now weighs, so a
            # context gauge drops right away (system sections are the runtime's and are not counted).
            after = build_request(
                session_id, [], [], baseline.summary, baseline.history, window, self._settings.manifest_max_bytes
            )
            await announcer.context_window(after.manifest)
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            await self._release(user, claim_id)
        return api.CompactNowResponse(state=api.COMPACT_NOW_STATE_COMPLETED, report=report)

    async def _acquire(self, user: str, session_id: str) -> str:
        # Shielded: a caller who hangs up while transcript grants the claim must not leave it held
        # (every new turn would be refused until the lease ran out); it is released at once instead.
        acquiring = asyncio.ensure_future(
            self._transcript.acquire_compaction_claim(
                user, session_id, self._holder.name, self._settings.claim_ttl_seconds
            )
        )
        try:
            return await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            with contextlib.suppress(CompactionError, SessionRunning):
                await self._release(user, await acquiring)
            raise

    async def _keep_claim(self, user: str, claim_id: str) -> None:
        # The heartbeat: a slow model must not let the short lease lapse while the summary is written.
        while True:
            await self._clock.sleep(self._settings.claim_renew_seconds)
            try:
                await self._transcript.renew_claim(user, claim_id, self._settings.claim_ttl_seconds)
            except CompactionError as error:
                logger.warning("compaction claim not renewed", extra={"claim_id": claim_id, "reason": error.reason})

    async def _release(self, user: str, claim_id: str) -> None:
        try:
            await asyncio.shield(self._transcript.release_claim(user, claim_id))
        except CompactionError as error:
            # The lease expires on its own; nothing else depends on this release.
            logger.warning("compaction claim not released", extra={"claim_id": claim_id, "reason": error.reason})
