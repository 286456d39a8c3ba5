"""Schemathesis drives every route of the gateway's own OpenAPI document against a live gateway.

The gateway runs under uvicorn in front of real transcript and compaction services. For each
operation, Hypothesis draws requests from the document, valid ones and invalid ones, half of them
aimed at a session (and message) that exist so that the handlers run past the lookup. Every
response must be below 500 and agree with the document: a documented status, content type, headers
and body schema. Deterministic: derandomized, a fixed number of examples, no example database.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import schemathesis
from gateway_testing import ALICE_TOKEN, bearer
from gateway_ws_testing import LiveGateway, live_gateway
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Per operation and generation mode; 21 operations x 2 modes x this stays well under a minute.
EXAMPLES = 20


@pytest.fixture(scope="module")
async def served(
    transcript: GrpcService, compaction: GrpcService, merge: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LiveGateway]:
    """The gateway under uvicorn on a real socket, in front of the module's services."""
    data_dir = tmp_path_factory.mktemp("fuzzed-gateway")
    async with live_gateway(
        data_dir,
        transcript.port,
        compaction_address=f"127.0.0.1:{compaction.port}",
        merge_address=f"127.0.0.1:{merge.port}",
    ) as gateway:
        yield gateway


async def _existing(base_url: str) -> dict[str, str]:
    """A session of Alice's with two messages and her unfinished merge (of two other sessions):
    path parameters that reach past the lookups."""
    async with httpx.AsyncClient(base_url=base_url, headers=ALICE, timeout=30) as client:
        session_ids = []
        for _ in range(3):
            session_ids.append(f"fuzz-{uuid.uuid4().hex[:12]}")
            created = await client.post("/v1/sessions", json={"sessionId": session_ids[-1]})
            assert created.status_code == 201, created.text
        messages = [
            {"role": "MESSAGE_ROLE_USER", "content": [{"text": "hello"}]},
            {"role": "MESSAGE_ROLE_ASSISTANT", "content": [{"text": "hi"}]},
        ]
        appended = await client.post(f"/v1/sessions/{session_ids[0]}/messages", json={"messages": messages})
        assert appended.status_code == 200, appended.text
        active = await client.get("/v1/session-merges:active")
        if active.status_code == 204:
            body = {"sourceSessionIds": session_ids[1:], "primarySessionId": session_ids[1]}
            active = await client.post("/v1/session-merges", json={**body, "idempotencyKey": uuid.uuid4().hex})
        assert active.status_code in (200, 201), active.text
    return {
        "session_id": session_ids[0],
        "message_id": appended.json()["messageIds"][0],
        "operation_id": active.json()["operation"]["progress"]["operationId"],
    }


def _fuzz(operation: Any, base_url: str, existing: dict[str, str]) -> int:
    """Run the operation's examples (blocking); the number of requests made."""
    fixed = {name: value for name, value in existing.items() if name in operation.path_parameters}
    # The outline names its session in the query; an update needs a mask transcript accepts.
    query = {"sessionId": existing["session_id"], "updateMask": "title,workingDirectory"}
    fixed_query = {name: value for name, value in query.items() if name in operation.query}
    strategies = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategies.append(operation.as_strategy(generation_mode=mode))
        if fixed or fixed_query:
            strategies.append(
                operation.as_strategy(generation_mode=mode, path_parameters=fixed, query=fixed_query or None)
            )
    calls = 0

    @given(case=st.one_of(strategies))
    @settings(
        max_examples=EXAMPLES * 2,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    def run(case: schemathesis.Case[Any]) -> None:
        nonlocal calls
        calls += 1
        case.call_and_validate(base_url=base_url, headers=ALICE, checks=CHECKS, timeout=30)

    run()
    return calls


async def test_every_route_agrees_with_the_document(served: LiveGateway) -> None:
    base_url = f"http://127.0.0.1:{served.port}"
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        document = (await client.get("/v1/openapi.json")).json()
    schema = schemathesis.openapi.from_dict(document)
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operations.append(result.ok())
    assert {f"{o.method.upper()} {o.path}" for o in operations} >= {
        "POST /v1/sessions",
        "PATCH /v1/sessions/{session_id}",
        "POST /v1/sessions/{session_id}/messages/{message_id}:edit",
        "GET /session-history/outline",
        "POST /v1/sessions/{session_id}/compaction:compactNow",
        "POST /v1/session-merges",
        "GET /v1/session-merges:active",
        "POST /v1/session-merges/{operation_id}:resume",
    }
    for operation in operations:
        existing = await _existing(base_url)
        # The services answer on this loop; the blocking client and Hypothesis run beside it.
        calls = await asyncio.to_thread(_fuzz, operation, base_url, existing)
        assert calls > 0, f"{operation.label}: no request was made"
