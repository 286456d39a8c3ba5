"""Liveness and readiness probes."""

from __future__ import annotations

import httpx
import pytest
from gateway_testing import assert_error
from grpc_health.v1 import health_pb2

from continuum_gateway.upstream import COMPACTION_SERVICE, TRANSCRIPT_SERVICE
from continuum_runtime.server import GrpcService

SERVING = {"transcript": "SERVING", "compaction": "SERVING"}


async def test_healthz_is_ok_even_without_upstreams(offline_gateway: httpx.AsyncClient) -> None:
    response = await offline_gateway.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_readyz_is_503_naming_the_unreachable_upstreams(offline_gateway: httpx.AsyncClient) -> None:
    error = assert_error(await offline_gateway.get("/readyz"), 503, "UNAVAILABLE", "UPSTREAM_NOT_READY")
    assert error["details"][0]["metadata"] == {"transcript": "UNAVAILABLE", "compaction": "UNAVAILABLE"}
    assert error["message"] == "not ready: compaction is UNAVAILABLE, transcript is UNAVAILABLE"


@pytest.mark.parametrize(
    ("upstream", "service_name"), [("transcript", TRANSCRIPT_SERVICE), ("compaction", COMPACTION_SERVICE)]
)
async def test_readyz_follows_each_upstreams_health(
    gateway: httpx.AsyncClient, transcript: GrpcService, compaction: GrpcService, upstream: str, service_name: str
) -> None:
    response = await gateway.get("/readyz")
    assert (response.status_code, response.json()) == (200, {"status": "ok", "upstreams": SERVING})
    service = {"transcript": transcript, "compaction": compaction}[upstream]
    await service.health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        error = assert_error(await gateway.get("/readyz"), 503, "UNAVAILABLE", "UPSTREAM_NOT_READY")
        assert error["details"][0]["metadata"] == {**SERVING, upstream: "NOT_SERVING"}
        assert error["message"] == f"not ready: {upstream} is NOT_SERVING"
    finally:
        await service.health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    assert (await gateway.get("/readyz")).status_code == 200
