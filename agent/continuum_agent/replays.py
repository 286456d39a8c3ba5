"""StartTurn retries found in transcript: after the agent restarted, or at another replica.

The user message of a turn started with a client_request_id keeps it in its metadata
(`{"runId": ..., "clientRequestId": ...}`): that message is the record of the request, so the agent
keeps no table of its own. A retry looks among the session's latest messages, newest first, at most
`lookback_messages` messages and `lookback_user_messages` USER messages (a retry comes soon after its
request; the bound keeps the lookup's cost independent of the history's length). A USER message sent
as a stub (its body over transcript's inline limit) is read whole to see its metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_agent.clients import Upstreams
from continuum_agent.errors import ClientRequestIdReused
from continuum_agent.model import message_text

# Transcript's largest page.
MAX_PAGE_SIZE = 200


@dataclass(frozen=True)
class Started:
    """What StartTurn answers."""

    run_id: str
    user_message_id: int


@dataclass(frozen=True)
class Lookback:
    """How far back a retry is looked for."""

    messages: int
    user_messages: int


async def find_started(
    upstreams: Upstreams, user: str, session_id: str, text: str, client_request_id: str, lookback: Lookback
) -> Started | None:
    """The turn `client_request_id` started in the session, if its user message is within `lookback`.

    `ClientRequestIdReused` when that message holds another text.
    """
    before = 0
    scanned = users = 0
    while scanned < lookback.messages:
        page = await upstreams.latest_messages(
            user, session_id, before, min(MAX_PAGE_SIZE, lookback.messages - scanned)
        )
        for message in reversed(page.messages):
            scanned += 1
            if message.role != tpb.MESSAGE_ROLE_USER:
                continue
            users += 1
            if message.body_deferred:
                message = await upstreams.get_message(user, session_id, message.message_id)
            fields = message.metadata.fields
            if "clientRequestId" in fields and fields["clientRequestId"].string_value == client_request_id:
                if message_text(message) != text:
                    raise ClientRequestIdReused("client_request_id was used for another text")
                return Started(fields["runId"].string_value, message.message_id)
            if users == lookback.user_messages:
                return None
        if not page.has_older or not page.messages:
            return None
        before = page.messages[0].message_id
    return None
