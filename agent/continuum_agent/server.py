"""Wiring: upstream clients, model, loop, runner and the gRPC server."""

from __future__ import annotations

from continuum.agent.v1 import agent_service_pb2_grpc as api_grpc
from continuum_agent import SERVICE_NAME
from continuum_agent.clients import Upstreams
from continuum_agent.model import AgentModel, open_model
from continuum_agent.runner import TurnRunner
from continuum_agent.servicer import AgentServicer
from continuum_agent.settings import AgentSettings
from continuum_agent.turn import TurnLoop
from continuum_runtime.clock import Clock, SystemClock
from continuum_runtime.guard import GuardedServer
from continuum_runtime.server import GrpcService, start_server
from continuum_runtime.telemetry import tracer_provider

FULL_SERVICE_NAME = "continuum.agent.v1.AgentService"


async def start(settings: AgentSettings, model: AgentModel | None = None, clock: Clock | None = None) -> GrpcService:
    """Start the agent. `model` replaces the configured one; `clock` the system clock (tests)."""
    clock = clock or SystemClock()
    upstreams = Upstreams(settings)
    model = model or open_model(settings.provider, settings.offline_delta_seconds, settings.chunk_max_chars)
    runner = TurnRunner(settings, upstreams, TurnLoop(settings, upstreams, model, clock))
    servicer = AgentServicer(runner)

    def register(server: GuardedServer) -> list[str]:
        api_grpc.add_AgentServiceServicer_to_server(servicer, server)
        return [FULL_SERVICE_NAME]

    service = await start_server(
        SERVICE_NAME,
        settings,
        register=register,
        tracer_provider=tracer_provider(SERVICE_NAME, settings.trace_exporter),
        # Running turns stop before the server does (answers stored as interrupted, claims released).
        drains=[runner.stop_all],
        cleanups=[upstreams.close, model.aclose],
    )
    return service
