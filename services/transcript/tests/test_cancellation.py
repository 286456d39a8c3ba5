"""Calls that clients cancel midway: their work completes or rolls back; nothing stays held."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

from transcript_testing import all_messages, create_session, running_transcript, user

from continuum.transcript.v1 import transcript_service_pb2 as api


async def test_appends_cancelled_at_random_points_leave_the_database_usable(tmp_path: Path, database_url: str) -> None:
    """Cancelled while binding a publisher, persisting or waiting for durability: on SQLite's one
    connection a handler stopped between two statements once left the write lock held for a minute, so
    the next CreateSession failed with "database is locked". Every cancelled batch is whole or absent."""
    async with running_transcript(tmp_path, database_url) as client:
        rng = random.Random(5)
        alice = client.as_user("alice")
        sessions: list[str] = []
        for round_number in range(30):
            # Each create is its own RPC on the shared connection: it fails if a lock was left behind.
            batch = [await create_session(client, f"s{round_number}-{n}", owner="alice") for n in range(4)]
            sessions += batch
            calls = [
                client.stub.AppendMessages(
                    api.AppendMessagesRequest(session_id=session_id, messages=[user("x" * 1000)] * 20), metadata=alice
                )
                for session_id in batch
            ]
            await asyncio.sleep(rng.random() * 0.02)
            for call in calls:
                call.cancel()
            for call in calls:
                with contextlib.suppress(asyncio.CancelledError):
                    await call
        for session_id in sessions:
            stored = await all_messages(client.stub, alice, session_id)
            assert len(stored) in (0, 20), (session_id, len(stored))
        session_id = await create_session(client, "after", owner="alice")
        response = await asyncio.wait_for(
            client.stub.AppendMessages(
                api.AppendMessagesRequest(session_id=session_id, messages=[user("still works")]), metadata=alice
            ),
            timeout=30,
        )
        assert len(response.message_ids) == 1
