"""A killed agent (SIGKILL) blocks its session only until the RUN claim's lease ends; a live one renews it."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from agent_testing import agent_process
from compaction_testing import running_stack

TTL_SECONDS = 2.0


async def test_a_killed_agents_claim_lapses_within_its_lease(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, configured_provider=True) as services:
        workdir = tmp_path / "work"
        workdir.mkdir()
        environment = {
            "AGENT_CLAIM_TTL_SECONDS": str(TTL_SECONDS),
            "AGENT_CLAIM_RENEW_SECONDS": "0.5",
            # Slow enough that the turn is still writing when it is killed.
            "AGENT_OFFLINE_DELTA_SECONDS": "1",
        }
        async with agent_process(services, tmp_path / "agent", workdir, **environment) as (agent, process):
            await agent.new_session("s1")
            await agent.start_turn("s1", "hello")
            # Renewed: still held well past one lease.
            await asyncio.sleep(TTL_SECONDS * 2)
            assert await agent.try_claim("s1") is None

            process.send_signal(signal.SIGKILL)
            await asyncio.wait_for(process.wait(), 10)
            killed_at = time.monotonic()
            await agent.wait_idle("s1", within_seconds=TTL_SECONDS + 5)
            freed_after = time.monotonic() - killed_at

    assert freed_after < TTL_SECONDS + 2
