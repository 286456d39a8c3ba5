"""The OpenAPI document and the reference page: served without a token, complete, in the proto3 JSON mapping."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_testing import gateway_settings, serving, unused_address
from google.rpc import error_details_pb2

from continuum.compaction.v1 import resources_pb2 as compaction_resources
from continuum_gateway.app import create_app
from continuum_gateway.proto_comments import ProtoComments
from continuum_gateway.proto_schema import Direction, SchemaBuilder
from continuum_gateway.routing import Resource


@pytest.fixture(scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway whose upstreams are absent: the reference needs none. With a merge address, so the
    document has every route a gateway can serve."""
    settings = gateway_settings(tmp_path_factory.mktemp("gw"), unused_address(), merge_address=unused_address())
    async with serving(create_app(settings)) as client:
        yield client


@pytest.fixture(scope="module")
async def document(gateway: httpx.AsyncClient) -> dict[str, Any]:
    """The served document."""
    response = await gateway.get("/v1/openapi.json")
    assert response.status_code == 200, response.text
    served: dict[str, Any] = response.json()
    return served


def _component(document: dict[str, Any], name: str) -> dict[str, Any]:
    schema: dict[str, Any] = document["components"]["schemas"][name]
    return schema


async def test_every_route_of_the_app_is_in_the_document(document: dict[str, Any], tmp_path: Path) -> None:
    assert document["openapi"] == "3.1.0"
    app = create_app(gateway_settings(tmp_path, unused_address(), merge_address=unused_address()))
    routes = {
        (method.lower(), route.path)
        for route in app.routes
        if isinstance(route, Resource)
        for method in route.operations
    }
    documented = {
        (method, path)
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "post", "patch", "delete")
    }
    assert documented == routes
    assert "x-websocket" in document["paths"]["/v1/sessions/{session_id}/follow"]
    operation_ids = [
        op["operationId"]
        for item in document["paths"].values()
        for k, op in item.items()
        if k in ("get", "post", "patch", "delete")
    ]
    assert len(operation_ids) == len(set(operation_ids))


async def test_requests_and_responses_follow_the_proto3_json_mapping(document: dict[str, Any]) -> None:
    session = _component(document, "continuum.transcript.v1.Session")
    properties = session["properties"]
    # camelCase names, int64 as strings, enums by name, timestamps, Struct as an object.
    assert properties["historyGeneration"]["type"] == "string"
    assert properties["historyGeneration"]["pattern"] == "^-?[0-9]+$"
    assert properties["kind"]["$ref"] == "#/components/schemas/continuum.transcript.v1.SessionKind"
    assert "SESSION_KIND_CHAT" in _component(document, "continuum.transcript.v1.SessionKind")["enum"]
    assert properties["createTime"]["format"] == "date-time"
    assert properties["metadata"]["type"] == "object"
    # OUTPUT_ONLY is readOnly; a response carries every field without presence.
    assert properties["owner"]["readOnly"] is True
    assert {"sessionId", "owner", "title", "historyGeneration"} <= set(session["required"])
    assert "createTime" not in session["required"]  # a message field: only when set
    # Descriptions are the contracts' comments.
    assert properties["owner"]["description"] == "The user who owns the session; only that user may read or change it."
    # Requests: REQUIRED fields are required (a repeated one needs an item); path fields are left out.
    append = _component(document, "continuum.transcript.v1.AppendMessagesRequest-Input")
    assert append["required"] == ["messages"]
    assert append["properties"]["messages"]["minItems"] == 1
    assert "sessionId" not in append["properties"]
    new_message = _component(document, "continuum.transcript.v1.NewMessage-Input")
    assert new_message["required"] == ["role"]
    # int64 in a request may be a number too.
    edit = _component(document, "continuum.transcript.v1.EditUserMessageRequest-Input")
    assert edit["properties"]["expectedHistoryGeneration"]["type"] == ["string", "integer"]
    # A oneof: at most one of its fields.
    part = _component(document, "continuum.transcript.v1.ContentPart-Input")
    assert part["not"] == {"anyOf": [{"required": ["text", "attachment"]}]}
    # PATCH's body is the session, without the id the path gives.
    patch = document["paths"]["/v1/sessions/{session_id}"]["patch"]
    assert patch["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("Session-Input")
    assert "sessionId" not in _component(document, "continuum.transcript.v1.Session-Input")["properties"]
    mask = next(p for p in patch["parameters"] if p["name"] == "updateMask")
    assert (mask["in"], mask["required"]) == ("query", True)


async def test_parameters_and_responses_are_described(document: dict[str, Any]) -> None:
    page = document["paths"]["/v1/sessions/{session_id}/messages:page"]["get"]
    parameters = {p["name"]: p for p in page["parameters"]}
    assert parameters["session_id"]["in"] == "path"
    assert parameters["direction"]["schema"] == {"type": "string", "enum": ["older", "newer"]}
    assert parameters["anchor"]["schema"]["format"] == "int64"
    assert parameters["pageSize"]["schema"]["type"] == "integer"
    create = document["paths"]["/v1/sessions"]["post"]
    assert set(create["responses"]) >= {"200", "201", "400", "401", "408", "413", "default"}
    assert create["responses"]["201"]["headers"]["Location"]["required"] is True
    assert create["responses"]["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    outline = document["paths"]["/session-history/outline"]["get"]
    schema = outline["responses"]["200"]["content"]["application/json"]["schema"]
    assert "generation" in schema["properties"]
    assert "streamGeneration" not in schema["properties"]
    assert schema["properties"]["status"]["enum"] == ["unspecified", "ok", "stale", "unsupported"]
    assert [p["name"] for p in outline["parameters"] if p["in"] == "header"] == ["X-Continuum-Capabilities"]
    assert document["paths"]["/healthz"]["get"]["security"] == []
    # The error reasons a client can meet are listed with the error body.
    assert "INVALID_JSON" in _component(document, "continuum.gateway.v1.ErrorReason")["enum"]


async def test_merge_routes_say_what_they_answer_and_conflicts_carry_the_operation(document: dict[str, Any]) -> None:
    active = document["paths"]["/v1/session-merges:active"]["get"]["responses"]
    assert "content" in active["200"]
    assert "content" not in active["204"]
    start = document["paths"]["/v1/session-merges"]["post"]
    assert set(start["responses"]) >= {"200", "201", "400", "403", "404", "409", "default"}
    assert start["responses"]["201"]["headers"]["Location"]["required"] is True
    resume = document["paths"]["/v1/session-merges/{operation_id}:resume"]["post"]
    assert [p["name"] for p in resume["parameters"]] == ["operation_id"]
    body = resume["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert "operationId" not in _component(document, body)["properties"]
    assert "MERGE_ACTIVE_EXISTS" in _component(document, "continuum.merge.v1.ErrorReason")["enum"]
    details = _component(document, "ErrorStatus")["properties"]["details"]["items"]["anyOf"]
    [operation] = [d for d in details if "progress" in d.get("properties", {})]
    assert operation["properties"]["@type"] == {"const": "type.googleapis.com/continuum.merge.v1.MergeOperation"}
    assert operation["required"][0] == "@type"


async def test_a_gateway_without_merge_documents_no_merge_route(tmp_path: Path) -> None:
    async with serving(create_app(gateway_settings(tmp_path, unused_address()))) as client:
        document = (await client.get("/v1/openapi.json")).json()
    assert not [path for path in document["paths"] if path.startswith("/v1/session-merges")]


def test_maps_durations_and_well_known_types() -> None:
    schemas = SchemaBuilder(ProtoComments.load())
    schemas.message(error_details_pb2.ErrorInfo.DESCRIPTOR, Direction.OUTPUT)
    info = schemas.components["google.rpc.ErrorInfo"]
    assert info["properties"]["metadata"] == {"type": "object", "additionalProperties": {"type": "string"}}
    schemas.message(compaction_resources.CompactionEvent.DESCRIPTOR, Direction.OUTPUT)
    event = schemas.components["continuum.compaction.v1.CompactionEvent"]
    assert event["properties"]["duration"]["pattern"] == "^-?[0-9]+(\\.[0-9]{1,9})?s$"


async def test_the_reference_page_is_served_without_a_token_or_anything_from_elsewhere(
    gateway: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    response = await gateway.get("/v1/reference")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    page = response.text
    # Every operation and schema is on the page.
    for item in document["paths"].values():
        for method, operation in item.items():
            if method in ("get", "post", "patch", "delete"):
                assert f'id="{operation["operationId"]}"' in page
    assert 'id="schema-continuum.transcript.v1.Session"' in page
    assert "The user who owns the session; only that user may read or change it." in page
    assert "continuum.follow.v1" in page
    # Self-contained: no script, and nothing loaded from another host.
    assert "<script" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    # Comment text is escaped, not markup.
    assert "<li><code>MESSAGE_ROLE_USER</code></li>" in page
