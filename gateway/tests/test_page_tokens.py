"""Page tokens cannot be forged: random and mutated tokens against every list RPC and route.

A token either continues the listing it was issued for, or is refused as INVALID_ARGUMENT with the
reason PAGE_TOKEN_INVALID and a BadRequest naming the field (HTTP 400). Never INTERNAL, never data.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from gateway_testing import ALICE_TOKEN, SERVICE_TOKEN, bearer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transcript_testing import assistant, user

from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum.compaction.v1 import compaction_service_pb2_grpc as capi_grpc
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details
from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
SESSION = "tokens-a"
OTHER_SESSION = "tokens-b"


@dataclass
class Listings:
    """Stubs, and a real next-page token of every listing (for mutation and cross-use)."""

    transcript: api_grpc.TranscriptServiceStub
    compaction: capi_grpc.CompactionServiceStub
    tokens: dict[str, str]


@pytest.fixture(scope="module")
async def listings(transcript: GrpcService, compaction: GrpcService) -> AsyncIterator[Listings]:
    transcript_channel = open_channel(f"127.0.0.1:{transcript.port}")
    compaction_channel = open_channel(f"127.0.0.1:{compaction.port}")
    stub = api_grpc.TranscriptServiceStub(transcript_channel)
    cstub = capi_grpc.CompactionServiceStub(compaction_channel)
    alice = call_metadata(SERVICE_TOKEN, "alice")
    for session_id in (SESSION, OTHER_SESSION):
        await stub.CreateSession(api.CreateSessionRequest(session_id=session_id), metadata=alice)
        for turn in range(3):
            messages = [user(f"question {turn}"), assistant(f"answer {turn}")]
            await stub.AppendMessages(
                api.AppendMessagesRequest(session_id=session_id, messages=messages), metadata=alice
            )
            await cstub.CompactNow(capi.CompactNowRequest(session_id=session_id), metadata=alice)
    for gone in ("tokens-gone-1", "tokens-gone-2"):  # two outbox events to page through
        await stub.CreateSession(api.CreateSessionRequest(session_id=gone), metadata=alice)
        await stub.DeleteSession(api.DeleteSessionRequest(session_id=gone), metadata=alice)
    sessions = await stub.ListSessions(api.ListSessionsRequest(page_size=1), metadata=alice)
    after = await stub.ListMessagesAfter(api.ListMessagesAfterRequest(session_id=SESSION, page_size=1), metadata=alice)
    events = await stub.ListSessionEvents(api.ListSessionEventsRequest(page_size=1), metadata=alice)
    compactions = await cstub.ListCompactionEvents(
        capi.ListCompactionEventsRequest(session_id=SESSION, page_size=1), metadata=alice
    )
    tokens = {
        "sessions": sessions.next_page_token,
        "messages": after.next_page_token,
        "events": events.next_page_token,
        "compactions": compactions.next_page_token,
    }
    try:
        yield Listings(stub, cstub, {name: token for name, token in tokens.items() if token})
    finally:
        await transcript_channel.close()
        await compaction_channel.close()


def _old_style(cursor: Any) -> str:
    """A token of the unsigned format this service once issued, with any cursor at all."""
    body = json.dumps({"c": cursor, "p": "0123456789abcdef"}).encode()
    return base64.urlsafe_b64encode(body).decode().rstrip("=")


def _mutations(token: str) -> st.SearchStrategy[str]:
    """Tokens near a real one: a character changed, cut, extended, halves swapped."""
    position = st.integers(min_value=0, max_value=max(len(token) - 1, 0))
    replaced = st.tuples(position, st.characters(codec="ascii")).map(
        lambda pc: token[: pc[0]] + pc[1] + token[pc[0] + 1 :]
    )
    cut = position.map(lambda p: token[:p])
    extended = st.text(min_size=1, max_size=8).map(lambda tail: token + tail)
    halves = st.just(".".join(reversed(token.split(".", 1))))
    return st.one_of(replaced, cut, extended, halves)


JSON_CURSORS = st.one_of(
    st.just("abc"),
    st.just([1, 2]),
    st.just(1e29),
    st.just(-1),
    st.just(None),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers()),
)


def _tokens(real: dict[str, str]) -> st.SearchStrategy[str]:
    base = [
        st.text(max_size=64),
        st.binary(max_size=48).map(lambda raw: base64.urlsafe_b64encode(raw).decode()),
        JSON_CURSORS.map(_old_style),
        st.sampled_from(sorted(real.values())),  # a real token, but possibly of another listing
    ]
    return st.one_of(*base, *(_mutations(token) for token in real.values()))


# Every list RPC and route, each as (name of its own listing, call with a token).
Call = Callable[[Listings, httpx.AsyncClient, str], Awaitable[tuple[str, Any]]]


async def _grpc(call: Awaitable[Any]) -> tuple[str, Any]:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        details = error_details(error)
        return details.code.name, (details.reason, [v.field for v in details.violations])
    return "OK", None


async def _http(response: Awaitable[httpx.Response]) -> tuple[str, Any]:
    answered = await response
    if answered.status_code == 200:
        return "OK", None
    error = answered.json()["error"]
    info = [d for d in error["details"] if d["@type"].endswith("ErrorInfo")]
    fields = [v["field"] for d in error["details"] if d["@type"].endswith("BadRequest") for v in d["fieldViolations"]]
    return f"HTTP {answered.status_code} {error['status']}", (info[0]["reason"] if info else "", fields)


ALICE_GRPC = call_metadata(SERVICE_TOKEN, "alice")
CALLS: dict[str, tuple[str, Call]] = {
    "ListSessions": (
        "sessions",
        lambda ls, gw, t: _grpc(ls.transcript.ListSessions(api.ListSessionsRequest(page_token=t), metadata=ALICE_GRPC)),
    ),
    "ListMessagesAfter": (
        "messages",
        lambda ls, gw, t: _grpc(
            ls.transcript.ListMessagesAfter(
                api.ListMessagesAfterRequest(session_id=SESSION, page_token=t), metadata=ALICE_GRPC
            )
        ),
    ),
    "ListSessionEvents": (
        "events",
        lambda ls, gw, t: _grpc(
            ls.transcript.ListSessionEvents(api.ListSessionEventsRequest(page_token=t), metadata=ALICE_GRPC)
        ),
    ),
    "ListCompactionEvents": (
        "compactions",
        lambda ls, gw, t: _grpc(
            ls.compaction.ListCompactionEvents(
                capi.ListCompactionEventsRequest(session_id=SESSION, page_token=t), metadata=ALICE_GRPC
            )
        ),
    ),
    "GET /v1/sessions": (
        "sessions",
        lambda ls, gw, t: _http(gw.get("/v1/sessions", headers=ALICE, params={"pageToken": t})),
    ),
    "GET /v1/sessions/{id}/messages": (
        "messages",
        lambda ls, gw, t: _http(gw.get(f"/v1/sessions/{SESSION}/messages", headers=ALICE, params={"pageToken": t})),
    ),
    "GET /v1/sessions/{id}/compaction/events": (
        "compactions",
        lambda ls, gw, t: _http(
            gw.get(f"/v1/sessions/{SESSION}/compaction/events", headers=ALICE, params={"pageToken": t})
        ),
    ),
}


async def test_every_listing_continues_with_its_own_token(listings: Listings, gateway: httpx.AsyncClient) -> None:
    assert set(listings.tokens) == {"sessions", "messages", "events", "compactions"}
    for name, (own, call) in CALLS.items():
        assert await call(listings, gateway, listings.tokens[own]) == ("OK", None), name


async def test_a_token_of_another_listing_or_session_is_refused(listings: Listings, gateway: httpx.AsyncClient) -> None:
    for name, (own, call) in CALLS.items():
        for other, token in listings.tokens.items():
            if other == own:
                continue
            outcome = await call(listings, gateway, token)
            assert outcome[1][0] == "PAGE_TOKEN_INVALID", (name, other, outcome)
    # The same listing for another session: the parameters differ, so the token does too.
    outcome = await _grpc(
        listings.transcript.ListMessagesAfter(
            api.ListMessagesAfterRequest(session_id=OTHER_SESSION, page_token=listings.tokens["messages"]),
            metadata=ALICE_GRPC,
        )
    )
    assert outcome == ("INVALID_ARGUMENT", ("PAGE_TOKEN_INVALID", ["page_token"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_random_and_mutated_tokens_never_fail_the_service(
    listings: Listings, gateway: httpx.AsyncClient, data: st.DataObject
) -> None:
    token = data.draw(_tokens(listings.tokens), label="token")
    for name, (own, call) in CALLS.items():
        kind, detail = await call(listings, gateway, token)
        if kind == "OK":
            # Only the genuine token of this very listing continues it (or none: the first page).
            assert token in ("", listings.tokens[own]), (name, token)
        elif name.startswith("GET"):
            assert kind == "HTTP 400 INVALID_ARGUMENT", (name, token, kind, detail)
            assert detail[0] in ("PAGE_TOKEN_INVALID", "INVALID_ARGUMENT"), (name, token, detail)
        else:
            assert (kind, detail) == ("INVALID_ARGUMENT", ("PAGE_TOKEN_INVALID", ["page_token"])), (name, token)
