"""Runtime events compaction publishes into the session's Follow stream (seed 004 §5.2, §5.4).

Best effort: a Follow event that cannot be published is logged (ids only) and never fails the
request whose context is being built.
"""

from __future__ import annotations

import json
import logging

from continuum.compaction.v1 import resources_pb2 as pb
from continuum_compaction.errors import CompactionError
from continuum_compaction.request import manifest_json
from continuum_compaction.transcript_client import RuntimeEventOut, TranscriptClient

logger = logging.getLogger("continuum.compaction")

COMPACTION_START = "compaction_start"
COMPACTION_END = "compaction_end"
COMPACTION_MARKER = "compaction_marker"
CONTEXT_WINDOW = "context_window"


def trigger_name(mode: pb.TriggerMode.ValueType) -> str:
    """`request_start`, `mid_loop` or `manual`, as stored and shown."""
    return pb.TriggerMode.Name(mode).removeprefix("TRIGGER_MODE_").lower()


def outcome_name(outcome: pb.CompactionOutcome.ValueType) -> str:
    """`compacted`, `conflict`, ... as stored and shown."""
    return pb.CompactionOutcome.Name(outcome).removeprefix("COMPACTION_OUTCOME_").lower()


class Announcer:
    """Publishes compaction progress and the context window for one session on behalf of its owner."""

    def __init__(self, transcript: TranscriptClient, user: str, session_id: str) -> None:
        self._transcript = transcript
        self._user = user
        self._session_id = session_id

    async def _publish(self, *events: RuntimeEventOut) -> None:
        try:
            await self._transcript.publish_events(self._user, self._session_id, events)
        except CompactionError as error:
            logger.warning(
                "runtime event not published",
                extra={"session_id": self._session_id, "kinds": [e.kind for e in events], "reason": error.reason},
            )

    async def started(self, mode: pb.TriggerMode.ValueType, run_id: str, boundary: int) -> None:
        """Compaction began."""
        payload = {"trigger_mode": trigger_name(mode), "run_id": run_id, "boundary_before": boundary}
        await self._publish(RuntimeEventOut(COMPACTION_START, payload))

    async def finished(self, event: pb.CompactionEvent) -> None:
        """Compaction ended; a marker follows when a new summary took effect."""
        payload = {
            "trigger_mode": trigger_name(event.trigger_mode),
            "outcome": outcome_name(event.outcome),
            "boundary_before": event.boundary_before,
            "boundary_after": event.boundary_after,
            "estimated_tokens_before": event.estimated_tokens_before,
            "estimated_tokens_after": event.estimated_tokens_after,
            "event_id": event.event_id,
        }
        events = [RuntimeEventOut(COMPACTION_END, payload)]
        if event.outcome == pb.COMPACTION_OUTCOME_COMPACTED:
            marker = {
                "trigger_mode": trigger_name(event.trigger_mode),
                "boundary": event.boundary_after,
                "event_id": event.event_id,
            }
            events.append(RuntimeEventOut(COMPACTION_MARKER, marker))
        await self._publish(*events)

    async def context_window(self, manifest: pb.ContextManifest) -> None:
        """The estimated size of the request just built; `actual` is the runtime's to report later."""
        payload = {
            "estimated": manifest.estimated_total_tokens,
            "actual": None,
            "manifest": json.loads(manifest_json(manifest)),
        }
        await self._publish(RuntimeEventOut(CONTEXT_WINDOW, payload))
