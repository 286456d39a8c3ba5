"""Readiness probes `continuum up` runs against a started component."""

from __future__ import annotations

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from continuum_cli.components import Protocol

PROBE_TIMEOUT_SECONDS = 1.0


def probe(protocol: Protocol, host: str, port: int) -> str | None:
    """None when the component at host:port is ready, otherwise why not (for the timeout message)."""
    if protocol is Protocol.GRPC:
        return _grpc_health(f"{host}:{port}")
    return _http_ready(f"http://{host}:{port}")


def _grpc_health(address: str) -> str | None:
    # Service "" is the server's overall status, which the runtime sets SERVING once every servicer is registered.
    # Local probes must not go through an HTTP(S)_PROXY the operator's shell may export.
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_SECONDS)
        except grpc.RpcError as error:
            return f"gRPC health check failed: {error.code().name}"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return f"gRPC health status {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
    return None


def _http_ready(base_url: str) -> str | None:
    try:
        with httpx.Client(trust_env=False, timeout=PROBE_TIMEOUT_SECONDS) as client:
            response = client.get(f"{base_url}/readyz")
    except httpx.HTTPError as error:
        return f"GET /readyz failed: {type(error).__name__}"
    if response.status_code != httpx.codes.OK:
        return f"GET /readyz answered {response.status_code}"
    return None
