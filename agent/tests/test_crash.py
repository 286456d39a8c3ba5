"""A killed agent (SIGKILL) blocks its session only until the RUN claim's lease ends; a live one renews it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from agent_testing import AgentStack
from compaction_testing import running_stack
from transcript_testing import SERVICE_TOKEN

from continuum.agent.v1 import agent_service_pb2_grpc as api_grpc
from continuum_runtime.channels import open_channel

TTL_SECONDS = 2.0


def _read_port(path: Path) -> int | None:
    return int(path.read_text()) if path.exists() else None


async def _port_file(path: Path, process: asyncio.subprocess.Process) -> int:
    for _ in range(600):
        port = await asyncio.to_thread(_read_port, path)
        if port is not None:
            return port
        assert process.returncode is None, "the agent exited while starting"
        await asyncio.sleep(0.05)
    raise AssertionError("the agent did not publish its port")


async def test_a_killed_agents_claim_lapses_within_its_lease(tmp_path: Path, database_url: str) -> None:
    async with running_stack(tmp_path, database_url, configured_provider=True) as services:
        data_dir = tmp_path / "agent"
        workdir = tmp_path / "work"
        workdir.mkdir()
        environment = {
            **os.environ,
            "AGENT_PORT": "0",
            "AGENT_DATA_DIR": str(data_dir),
            "AGENT_SERVICE_TOKEN": SERVICE_TOKEN,
            "AGENT_TRANSCRIPT_ADDRESS": f"127.0.0.1:{services.transcript.service.port}",
            "AGENT_COMPACTION_ADDRESS": f"127.0.0.1:{services.service.port}",
            "AGENT_CLAIM_TTL_SECONDS": str(TTL_SECONDS),
            "AGENT_CLAIM_RENEW_SECONDS": "0.5",
            # Slow enough that the turn is still writing when it is killed.
            "AGENT_OFFLINE_DELTA_SECONDS": "1",
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "continuum_agent", "serve", env=environment
        )
        try:
            port = await _port_file(data_dir / "run" / "agent.port", process)
            channel = open_channel(f"127.0.0.1:{port}")
            agent = AgentStack(services, api_grpc.AgentServiceStub(channel), None, None, workdir)  # type: ignore[arg-type]
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
            await channel.close()
        finally:
            if process.returncode is None:
                process.kill()
                await asyncio.wait_for(process.wait(), 10)

    assert freed_after < TTL_SECONDS + 2
