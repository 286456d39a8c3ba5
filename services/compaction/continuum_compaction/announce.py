"""Runtime events compaction publishes into the session's Follow stream (seed 004 §5.2, §5.4).

Best effort: a Follow event that cannot be published is logged (ids only) and never fails the
request whose context is being built.
"""

from __future__ import annotations

import logging

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import resources_pb2 as pb
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum_compaction.errors import CompactionError
from continuum_compaction.transcript_client import TranscriptClient

logger = logging.getLogger("continuum.compaction")


class Announcer:
    """Publishes compaction progress and the context window for one session on behalf of its owner."""

    def __init__(self, transcript: TranscriptClient, user: str, session_id: str) -> None:
        self._transcript = transcript
        self._user = user
        self._session_id = session_id

    async def _publish(self, *events: fpb.RuntimeEvent) -> None:
        try:
            await self._transcript.publish_events(self._user, self._session_id, events)
        except CompactionError as error:
            logger.warning(
                "runtime event not published",
                extra={
                    "session_id": self._session_id,
                    "kinds": [e.WhichOneof("event") for e in events],
                    "reason": error.reason,
                },
            )

    async def started(self, mode: events_pb2.TriggerMode.ValueType, run_id: str, boundary: int) -> None:
        """Compaction began."""
        started = events_pb2.CompactionStarted(trigger_mode=mode, run_id=run_id, boundary_before=boundary)
        await self._publish(fpb.RuntimeEvent(compaction_started=started))

    async def finished(self, event: pb.CompactionEvent) -> None:
        """Compaction ended; a marker follows when a new summary took effect."""
        ended = events_pb2.CompactionEnded(
            trigger_mode=event.trigger_mode,
            outcome=event.outcome,
            boundary_before=event.boundary_before,
            boundary_after=event.boundary_after,
            estimated_tokens_before=event.estimated_tokens_before,
            estimated_tokens_after=event.estimated_tokens_after,
            event_id=event.event_id,
        )
        events = [fpb.RuntimeEvent(compaction_ended=ended)]
        if event.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED:
            marker = events_pb2.CompactionMarker(
                trigger_mode=event.trigger_mode, boundary=event.boundary_after, event_id=event.event_id
            )
            events.append(fpb.RuntimeEvent(compaction_marker=marker))
        await self._publish(*events)

    async def context_window(self, manifest: events_pb2.ContextManifest) -> None:
        """The estimated size of the request just built; the actual size is the runtime's to report."""
        window = events_pb2.ContextWindow(estimated_tokens=manifest.estimated_total_tokens, manifest=manifest)
        await self._publish(fpb.RuntimeEvent(context_window=window))
