"""The publisher registry: one publisher per session however many callers bind it at once, and no
bookkeeping left behind per session once its bind is over."""

from __future__ import annotations

import asyncio
from pathlib import Path

from clock_testing import ManualClock
from deadline_testing import eventually
from transcript_testing import create_session, running_transcript

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum_runtime.clock import SystemClock
from continuum_runtime.database import Database
from continuum_transcript.registry import PublisherRegistry


async def test_concurrent_callers_share_one_bind_and_the_bind_locks_do_not_accumulate(
    tmp_path: Path, database_url: str
) -> None:
    async with running_transcript(tmp_path, database_url) as transcript:
        session_ids = [await create_session(transcript, f"s{n}") for n in range(20)]
        database = Database(database_url, schema="transcript")
        registry = PublisherRegistry(database, transcript.settings, SystemClock())
        try:
            # Three callers per session at once: each session is bound once, all three get its publisher.
            found = await asyncio.gather(*(registry.get("alice", sid) for sid in session_ids for _ in range(3)))
            for index, session_id in enumerate(session_ids):
                trio = found[3 * index : 3 * index + 3]
                assert all(publisher is trio[0] for publisher in trio)
                assert trio[0].session_id == session_id
            # Nothing of those binds is kept: a process that binds many sessions does not grow with them.
            assert not registry._binding and not registry._binders
        finally:
            await registry.shutdown(1.0)
            await database.dispose()


async def test_the_reaper_keeps_nothing_of_a_publisher_closed_by_anything_else(
    tmp_path: Path, database_url: str
) -> None:
    async with running_transcript(tmp_path, database_url) as transcript:
        for session_id in ("deleted", "quiet"):
            await create_session(transcript, session_id)
        database = Database(database_url, schema="transcript")
        # Reaping after half a second of idleness, checked every half second.
        settings = transcript.settings.model_copy(update={"publisher_idle_seconds": 0.5})
        registry = PublisherRegistry(database, settings, SystemClock())
        try:
            deleted = await registry.get("alice", "deleted")
            quiet = await registry.get("alice", "quiet")
            registry.start()
            await eventually(lambda: set(registry._idle_since) == {deleted, quiet}, what="both noted as idle")
            # Closed by its session's deletion, not by the reaper.
            registry.end_sessions(["deleted"])
            await eventually(lambda: quiet.closed, what="the quiet publisher reaped")
            assert not registry._idle_since
        finally:
            await registry.shutdown(1.0)
            await database.dispose()


async def test_an_attempt_its_runtime_abandoned_stops_keeping_its_publisher(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(tmp_path, database_url) as transcript:
        await create_session(transcript, "s")
        database = Database(database_url, schema="transcript")
        # An attempt's age is the clock's; the reaper looks every second of real time.
        clock = ManualClock()
        settings = transcript.settings.model_copy(update={"publisher_idle_seconds": 1.0})
        registry = PublisherRegistry(database, settings, clock)
        try:
            publisher = await registry.get("alice", "s")
            ref = fpb.AttemptRef(message_key="m", attempt=1)
            publisher.open_attempt(ref)
            publisher.append_chunks(ref, 0, ["partial "])
            registry.start()
            clock.advance(0.5)
            publisher.append_chunks(ref, 1, ["output"])  # the runtime is alive
            clock.advance(0.9)
            # Two looks at an attempt that showed a chunk 0.9 s ago (of the clock): kept, not even idle.
            looks = registry.reaper_passes
            await eventually(lambda: registry.reaper_passes >= looks + 2, what="two looks of the reaper")
            assert publisher not in registry._idle_since and not publisher.closed
            # A second without a chunk: the attempt counts as abandoned, and after the idle period the
            # publisher is reaped. The unsaved text goes with it, as the runtime's crash left it; the
            # session's next publisher has no such attempt.
            clock.advance(0.1)
            await eventually(lambda: publisher.closed, what="the publisher of the abandoned attempt reaped")
            rebound = await registry.get("alice", "s")
            assert rebound is not publisher and not rebound.attempts
        finally:
            await registry.shutdown(1.0)
            await database.dispose()
