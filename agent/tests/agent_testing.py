"""A real transcript, compaction (built-in offline summarizer) and agent on port 0, and helpers.

The agent runs its configured model (the offline script) unless a test hands it another one.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from compaction_testing import OWNER, Stack, running_stack
from google.protobuf import duration_pb2
from pydantic import SecretStr
from transcript_testing import SERVICE_TOKEN

from continuum.agent.v1 import agent_service_pb2 as api
from continuum.agent.v1 import agent_service_pb2_grpc as api_grpc
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_agent.model import AgentModel
from continuum_agent.server import start
from continuum_agent.settings import AgentSettings
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.server import GrpcService


def agent_settings(tmp_path: Path, transcript_port: int, compaction_port: int, **overrides: object) -> AgentSettings:
    """Settings of a test agent: fast renewal, a quick offline writer."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "agent",
        "port": 0,
        "service_token": SecretStr(SERVICE_TOKEN),
        "transcript_address": f"127.0.0.1:{transcript_port}",
        "compaction_address": f"127.0.0.1:{compaction_port}",
        "claim_ttl_seconds": 5.0,
        "claim_renew_seconds": 1.0,
        "offline_delta_seconds": 0.0,
    }
    values.update(overrides)
    return AgentSettings(**values)  # type: ignore[arg-type]


@dataclass
class AgentStack:
    """The three services and a client of each, acting for `OWNER`."""

    services: Stack
    stub: api_grpc.AgentServiceStub
    service: GrpcService
    settings: AgentSettings
    workdir: Path

    def user(self, name: str = OWNER) -> tuple[tuple[str, str], ...]:
        """Call metadata acting for `name`."""
        return call_metadata(SERVICE_TOKEN, name)

    async def new_session(self, session_id: str, working_directory: Path | None = None, owner: str = OWNER) -> None:
        """A chat session over `working_directory` (the stack's work directory by default)."""
        directory = str(working_directory if working_directory is not None else self.workdir)
        await self.services.transcript.stub.CreateSession(
            tapi.CreateSessionRequest(
                session_id=session_id, kind=tpb.SESSION_KIND_CHAT, title="t", working_directory=directory
            ),
            metadata=self.user(owner),
        )

    async def start_turn(self, session_id: str, text: str, client_request_id: str = "") -> api.StartTurnResponse:
        """StartTurn for `OWNER`."""
        response: api.StartTurnResponse = await self.stub.StartTurn(
            api.StartTurnRequest(session_id=session_id, text=text, client_request_id=client_request_id),
            metadata=self.user(),
        )
        return response

    async def stop_turn(self, session_id: str) -> bool:
        """StopTurn for `OWNER`."""
        response: api.StopTurnResponse = await self.stub.StopTurn(
            api.StopTurnRequest(session_id=session_id), metadata=self.user()
        )
        return response.stopped

    async def messages(self, session_id: str) -> list[tpb.Message]:
        """The session's whole live history."""
        response = await self.services.transcript.stub.ListMessagesAfter(
            tapi.ListMessagesAfterRequest(session_id=session_id, page_size=1000), metadata=self.user()
        )
        return list(response.messages)

    async def try_claim(
        self, session_id: str, holder: str = "probe", ttl_seconds: int = 5, kind: int = tpb.CLAIM_KIND_RUN
    ) -> str | None:
        """Take a claim of `kind` (RUN unless given) on the session if it is free (its id), None when
        someone holds it."""
        try:
            response = await self.services.transcript.stub.AcquireClaims(
                tapi.AcquireClaimsRequest(
                    session_ids=[session_id],
                    kind=kind,  # type: ignore[arg-type]
                    holder=holder,
                    ttl=duration_pb2.Duration(seconds=ttl_seconds),
                ),
                metadata=self.user(),
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return None
            raise
        claim_id: str = response.claim.claim_id
        return claim_id

    async def release(self, claim_id: str) -> None:
        """Release a claim taken by `try_claim`."""
        await self.services.transcript.stub.ReleaseClaims(
            tapi.ReleaseClaimsRequest(claim_id=claim_id), metadata=self.user()
        )

    async def wait_idle(self, session_id: str, within_seconds: float = 30.0) -> None:
        """Wait until the session's RUN claim is free again (the turn ended and released it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_seconds
        while loop.time() < deadline:
            claim_id = await self.try_claim(session_id)
            if claim_id is not None:
                await self.release(claim_id)
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"session {session_id} still claimed after {within_seconds} s")


@asynccontextmanager
async def running_agent(
    tmp_path: Path,
    database_url: str,
    model: AgentModel | None = None,
    compaction_overrides: dict[str, object] | None = None,
    **overrides: object,
) -> AsyncIterator[AgentStack]:
    """Transcript, compaction and the agent, all started over `database_url`."""
    compaction: dict[str, Any] = {"trigger_ratio": 0.9, "context_window_tokens": 128_000, "recent_turns": 2}
    compaction.update(compaction_overrides or {})
    workdir = tmp_path / "work"
    workdir.mkdir()
    async with running_stack(tmp_path, database_url, configured_provider=True, **compaction) as services:
        settings = agent_settings(tmp_path, services.transcript.service.port, services.service.port, **overrides)
        service = await start(settings, model)
        channel = open_channel(f"127.0.0.1:{service.port}")
        try:
            yield AgentStack(services, api_grpc.AgentServiceStub(channel), service, settings, workdir)
        finally:
            await channel.close()
            await service.stop(grace=0)


@asynccontextmanager
async def replica(stack: AgentStack, data_dir: Path, **overrides: object) -> AsyncIterator[AgentStack]:
    """Another agent process over the same transcript and compaction (a second replica, or the first
    one restarted), with its own data dir."""
    settings = agent_settings(
        data_dir, stack.services.transcript.service.port, stack.services.service.port, **overrides
    )
    service = await start(settings)
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        yield AgentStack(stack.services, api_grpc.AgentServiceStub(channel), service, settings, stack.workdir)
    finally:
        await channel.close()
        await service.stop(grace=0)


def _read_port(path: Path) -> int | None:
    return int(path.read_text()) if path.exists() else None


async def _published_port(path: Path, process: asyncio.subprocess.Process) -> int:
    for _ in range(600):
        port = await asyncio.to_thread(_read_port, path)
        if port is not None:
            return port
        assert process.returncode is None, "the agent exited while starting"
        await asyncio.sleep(0.05)
    raise AssertionError("the agent did not publish its port")


@asynccontextmanager
async def agent_process(
    services: Stack, data_dir: Path, workdir: Path, **environment: str
) -> AsyncIterator[tuple[AgentStack, asyncio.subprocess.Process]]:
    """`python -m continuum_agent serve` in a process of its own over `services`; `environment` adds
    AGENT_* variables. Killed at the end if it still runs."""
    variables = {
        **os.environ,
        "AGENT_PORT": "0",
        "AGENT_DATA_DIR": str(data_dir),
        "AGENT_SERVICE_TOKEN": SERVICE_TOKEN,
        "AGENT_TRANSCRIPT_ADDRESS": f"127.0.0.1:{services.transcript.service.port}",
        "AGENT_COMPACTION_ADDRESS": f"127.0.0.1:{services.service.port}",
        **environment,
    }
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "continuum_agent", "serve", env=variables)
    try:
        port = await _published_port(data_dir / "run" / "agent.port", process)
        channel = open_channel(f"127.0.0.1:{port}")
        try:
            # No in-process service or settings: the process is reached through its stub only.
            yield AgentStack(services, api_grpc.AgentServiceStub(channel), None, None, workdir), process  # type: ignore[arg-type]
        finally:
            await channel.close()
    finally:
        if process.returncode is None:
            process.kill()
            await asyncio.wait_for(process.wait(), 10)
