"""The publisher registry: one publisher per session however many callers bind it at once, and no
bookkeeping left behind per session once its bind is over."""

from __future__ import annotations

import asyncio
from pathlib import Path

from transcript_testing import create_session, running_transcript

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
