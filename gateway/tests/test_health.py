"""Liveness and readiness probes."""

from __future__ import annotations

import httpx
from gateway_testing import assert_error
from grpc_health.v1 import health_pb2

from continuum_gateway.upstream import TRANSCRIPT_SERVICE
from continuum_runtime.server import GrpcService


async def test_healthz_is_ok_even_without_upstreams(offline_gateway: httpx.AsyncClient) -> None:
    response = await offline_gateway.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_readyz_is_503_naming_the_unreachable_upstream(offline_gateway: httpx.AsyncClient) -> None:
    error = assert_error(await offline_gateway.get("/readyz"), 503, "UNAVAILABLE", "UPSTREAM_NOT_READY")
    assert error["details"][0]["metadata"] == {"transcript": "UNAVAILABLE"}
    assert error["message"] == "not ready: transcript is UNAVAILABLE"


async def test_readyz_follows_transcripts_health(gateway: httpx.AsyncClient, transcript: GrpcService) -> None:
    response = await gateway.get("/readyz")
    assert (response.status_code, response.json()) == (200, {"status": "ok", "upstreams": {"transcript": "SERVING"}})
    await transcript.health.set(TRANSCRIPT_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        error = assert_error(await gateway.get("/readyz"), 503, "UNAVAILABLE", "UPSTREAM_NOT_READY")
        assert error["details"][0]["metadata"] == {"transcript": "NOT_SERVING"}
    finally:
        await transcript.health.set(TRANSCRIPT_SERVICE, health_pb2.HealthCheckResponse.SERVING)
