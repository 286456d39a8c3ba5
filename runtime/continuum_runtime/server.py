"""gRPC server bootstrap: grpc.aio on a chosen (or free) port, health, reflection, guarded methods,
keepalive suited to Kubernetes, and a graceful stop (NOT_SERVING first, then drain)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.sdk.trace import TracerProvider

from continuum_runtime.guard import GuardedServer
from continuum_runtime.settings import ServiceSettings

logger = logging.getLogger("continuum.server")

Cleanup = Callable[[], Awaitable[None]]

# Container allocations between two young-generation collections (CPython's default is 700).
YOUNG_COLLECTION_THRESHOLD = 10_000


@dataclass
class GrpcService:
    """A started server, its bound port and what to close after it stops."""

    name: str
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    # Run after the server stopped, last first: list what a service opened in the order it opened it
    # (its database first, the tasks that use it last), so the tasks stop before the database closes.
    cleanups: list[Cleanup] = field(default_factory=list)
    # Run before the server stops, e.g. to end long-lived streams so they need no grace period.
    drains: list[Cleanup] = field(default_factory=list)

    async def stop(self, grace: float) -> None:
        """Report NOT_SERVING, drain streams, let calls in flight finish within `grace`, close."""
        await self.health.enter_graceful_shutdown()
        for drain in self.drains:
            await drain()
        await self.server.stop(grace)
        for cleanup in reversed(self.cleanups):
            await cleanup()
        logger.info("server stopped", extra={"service": self.name})


def keepalive_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel options for long-lived streams behind Kubernetes load balancers."""
    return [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Without this a second server silently shares the port and splits the traffic.
        ("grpc.so_reuseport", 0),
    ]


async def start_server(
    name: str,
    settings: ServiceSettings,
    *,
    register: Callable[[GuardedServer], Sequence[str]],
    tracer_provider: TracerProvider | None,
    cleanups: Sequence[Cleanup] = (),
    drains: Sequence[Cleanup] = (),
    untraced_streams: Sequence[str] = (),
    complete_cancelled_calls: bool = False,
) -> GrpcService:
    """Build and start the server; `register` adds servicers (every method guarded, see
    `GuardedServer`, also for `complete_cancelled_calls`) and returns their full service names."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if tracer_provider is not None:
        untraced = filters.any_of(
            filters.health_check(),
            filters.service_prefix("grpc.reflection"),
            # The interceptor fails to detach its context when a long-lived stream is cancelled
            # (every follower disconnect), and a span per stream says little.
            *(filters.method_name(name) for name in untraced_streams),
        )
        interceptors.append(
            aio_server_interceptor(tracer_provider=tracer_provider, filter_=filters.negate(untraced))  # type: ignore[no-untyped-call]
        )
    server = grpc.aio.server(interceptors=interceptors, options=keepalive_options(settings.grpc_max_message_bytes))
    guarded = GuardedServer(
        server, settings.service_token.get_secret_value(), complete_cancelled_calls=complete_cancelled_calls
    )
    service_names = list(register(guarded))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {settings.host}:{settings.port}")
    await server.start()
    for service_name in ["", *service_names]:
        await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("server started", extra={"service": name, "port": port})
    return GrpcService(name, server, port, health_servicer, list(cleanups), list(drains))


def write_port_file(data_dir: Path, name: str, port: int) -> Path:
    """Publish the bound port so a supervisor (`continuum up`) can find a service on port 0."""
    run_dir = data_dir / "run"
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = run_dir / f"{name}.port"
    scratch = path.with_suffix(".tmp")
    scratch.unlink(missing_ok=True)
    with os.fdopen(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        handle.write(str(port))
    scratch.replace(path)
    return path


def settle_garbage_collector() -> None:
    """Tune the cyclic garbage collector for a started service process.

    Everything allocated while starting (modules, descriptors, the engine, compiled statements)
    lives as long as the process: frozen, it is no longer traversed by every full collection. And
    a request's objects live across a few awaits: with CPython's default young threshold (700)
    most of them are caught in flight and promoted to older generations, which then fill up and
    trigger full collections; a higher threshold lets them die young. Together they took the
    collector's share of the server's CPU in the append benchmark from ~17% to ~6%.
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run a service process (`main`, which awaits `serve`) on uvloop, libuv's asyncio event loop.

    Every RPC wakes the loop several times (gRPC's completion queue, the database socket, the
    handler's own tasks); libuv's loop does each wakeup and socket write in less CPU than the
    standard loop, and asyncpg's protocol is built for it: about 7% fewer instructions per append
    batch in the transcript server.
    """
    uvloop.run(main)


async def serve(service: GrpcService, settings: ServiceSettings) -> None:
    """What `python -m <service> serve` does once started: settle the collector, publish the port,
    run until signalled."""
    settle_garbage_collector()
    write_port_file(settings.data_dir, service.name, service.port)
    await serve_until_signalled(service, settings.shutdown_grace_seconds)


async def serve_until_signalled(service: GrpcService, grace: float) -> None:
    """Run until SIGINT or SIGTERM, then stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("stopping", extra={"service": service.name})
    await service.stop(grace)
