"""docs/api.md cannot go stale: every route has a worked example there, and every example holds.

The examples run in document order against a live gateway (uvicorn) in front of empty transcript
and compaction services, so ids come out as written. Each answer must have the documented status,
headers and shape (`api_examples`), and its body must be valid under the OpenAPI document's schema
for that route and status; so must the documented body itself.

An id the services choose (a merge operation's) is taken from an answer's header: a documented
header value holding ``$NAME`` (``Location: /v1/session-merges/$OPERATION_ID``) captures that part of
the actual value, and later requests say ``$NAME`` (in the target, a header or the body) for it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
from api_examples import DOCS, HttpExample, WebSocketExample, body_differences, examples, is_elided
from gateway_testing import ALICE_TOKEN
from gateway_ws_testing import LiveGateway, live_gateway, receive_json
from websockets.asyncio.client import connect
from websockets.typing import Subprotocol

from continuum_gateway.auth import bearer_subprotocol
from continuum_gateway.follow import FOLLOW_SUBPROTOCOL
from continuum_runtime.server import GrpcService

EXAMPLES = examples(DOCS.read_text())
_VARIABLE = re.compile(r"\\\$([A-Z_]+)")


@pytest.fixture(scope="module")
async def served(
    transcript: GrpcService, compaction: GrpcService, merge: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LiveGateway]:
    """The gateway under uvicorn on a real socket, in front of the module's (empty) services."""
    data_dir = tmp_path_factory.mktemp("documented-gateway")
    async with live_gateway(
        data_dir,
        transcript.port,
        compaction_address=f"127.0.0.1:{compaction.port}",
        merge_address=f"127.0.0.1:{merge.port}",
    ) as gateway:
        yield gateway


def _operations(document: dict[str, Any]) -> dict[tuple[str, str], re.Pattern[str]]:
    """Every (method, path template) of the document, with a pattern matching its paths."""
    found = {}
    for template, item in document["paths"].items():
        pattern = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
        methods = [m.upper() for m in item if m in ("get", "post", "put", "patch", "delete")]
        if "x-websocket" in item:
            methods.append("WS")
        for method in methods:
            found[(method, template)] = pattern
    return found


def _operation_of(operations: dict[tuple[str, str], re.Pattern[str]], method: str, target: str) -> tuple[str, str]:
    """The operation an example calls: of the templates matching its path, the most literal."""
    path = target.split("?", 1)[0]
    matching = [key for key, pattern in operations.items() if key[0] == method and pattern.match(path)]
    assert matching, f"{method} {target} is no route of the document"
    return max(matching, key=lambda key: len(re.sub(r"\{[^}]+\}", "", key[1])))


async def _document(gateway: LiveGateway) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}") as client:
        document: dict[str, Any] = (await client.get("/v1/openapi.json")).json()
    return document


async def test_every_route_has_an_example(served: LiveGateway) -> None:
    operations = _operations(await _document(served))
    documented = set()
    for example in EXAMPLES:
        if isinstance(example, HttpExample):
            documented.add(_operation_of(operations, example.method, example.target))
        else:
            documented.add(_operation_of(operations, "WS", example.path))
    assert sorted(set(operations) - documented) == []


def _schema_errors(document: dict[str, Any], operation: tuple[str, str], status: int, body: Any) -> list[str]:
    method, template = operation
    responses = document["paths"][template][method.lower()]["responses"]
    response = responses.get(str(status), responses.get("default"))
    assert response is not None, f"{method} {template}: status {status} is not documented"
    schema = response["content"]["application/json"]["schema"]
    validator = jsonschema_rs.Draft202012Validator({**schema, "components": document["components"]})
    return [f"{'/'.join(map(str, error.instance_path))}: {error.message}" for error in validator.iter_errors(body)]


def _substituted(text: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        text = text.replace(f"${name}", value)
    return text


def _captured(documented: str, actual: str | None, variables: dict[str, str]) -> bool:
    """Whether `actual` matches the documented header value, whose ``$NAME`` parts it captures."""
    pattern = _VARIABLE.sub(lambda match: f"(?P<{match.group(1)}>[^/?]+)", re.escape(documented))
    found = re.fullmatch(pattern, actual or "")
    if found is None:
        return False
    variables.update(found.groupdict())
    return True


async def _run_http(
    client: httpx.AsyncClient, example: HttpExample, variables: dict[str, str]
) -> tuple[httpx.Response, list[str]]:
    headers = {name: _substituted(value, variables) for name, value in example.headers.items()}
    response = await client.request(
        example.method,
        _substituted(example.target, variables),
        headers=headers,
        content=_substituted(example.body, variables).encode() or None,
    )
    problems = []
    if response.status_code != example.status:
        problems.append(f"status {response.status_code}, documented {example.status}")
    for name, value in example.response_headers.items():
        if not _captured(value, response.headers.get(name), variables):
            problems.append(f"header {name}: {response.headers.get(name)!r}, documented {value!r}")
    problems += body_differences(example.response_body, response.text)
    return response, problems


async def _run_websocket(gateway: LiveGateway, example: WebSocketExample) -> tuple[list[Any], list[str]]:
    subprotocols = [Subprotocol(FOLLOW_SUBPROTOCOL), Subprotocol(bearer_subprotocol(ALICE_TOKEN))]
    url = f"ws://127.0.0.1:{gateway.port}{example.path}"
    received: list[Any] = []
    async with connect(url, subprotocols=subprotocols, open_timeout=10, compression=None) as websocket:
        for text in example.sent:
            await websocket.send(text)
        async with asyncio.timeout(30):
            while len(received) < len(example.received):
                message = await receive_json(websocket)
                if message["type"] != "heartbeat":
                    received.append(message)
    problems = []
    for index, (documented, actual) in enumerate(zip(example.received, received, strict=True)):
        problems += [f"message {index}: {p}" for p in body_differences(documented, json.dumps(actual))]
    return received, problems


async def test_the_examples_hold(served: LiveGateway) -> None:
    document = await _document(served)
    operations = _operations(document)
    failures = []
    variables = {"TOKEN": ALICE_TOKEN}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}", timeout=30) as client:
        for example in EXAMPLES:
            if isinstance(example, WebSocketExample):
                received, problems = await _run_websocket(served, example)
                if problems:
                    shown = "\n".join(json.dumps(m) for m in received)
                    failures.append(f"{example.label}:\n  " + "\n  ".join(problems) + f"\nreceived:\n{shown}")
                continue
            response, problems = await _run_http(client, example, variables)
            operation = _operation_of(operations, example.method, example.target)
            if response.headers.get("content-type") == "application/json":
                problems += [
                    f"answer: {p}" for p in _schema_errors(document, operation, response.status_code, response.json())
                ]
                try:
                    documented = json.loads(example.response_body)
                except ValueError:
                    documented = None  # not JSON: `_run_http` reported it
                if documented is not None and not is_elided(documented):
                    problems += [
                        f"example: {p}" for p in _schema_errors(document, operation, example.status, documented)
                    ]
            if problems:
                answer = (
                    json.dumps(response.json(), indent=2) if "json" in response.headers.get("content-type", "") else ""
                )
                failures.append(f"{example.label}:\n  " + "\n  ".join(problems) + f"\nanswer:\n{answer}")
    assert not failures, "\n\n".join(failures)
