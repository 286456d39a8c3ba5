"""The execution gate: all-or-nothing claims over session trees, leases, and real concurrency."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from transcript_testing import TranscriptClient, refused

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.errors import error_details


async def _sessions(client: TranscriptClient, *ids: str, parent: str = "") -> None:
    for session_id in ids:
        await client.stub.CreateSession(
            api.CreateSessionRequest(session_id=session_id, parent_session_id=parent), metadata=client.as_user("alice")
        )


def _acquire(
    client: TranscriptClient, ids: list[str], kind: int = pb.CLAIM_KIND_RUN, ttl: float = 30, holder: str = "h"
) -> grpc.aio.UnaryUnaryCall[api.AcquireClaimsRequest, api.AcquireClaimsResponse]:
    duration = Duration()
    duration.FromMilliseconds(int(ttl * 1000))
    return client.stub.AcquireClaims(
        api.AcquireClaimsRequest(session_ids=ids, kind=kind, holder=holder, ttl=duration),  # type: ignore[arg-type]
        metadata=client.as_user("alice"),
    )


async def test_run_claim_refuses_a_second_run_until_released(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "s")
    claim = (await _acquire(transcript, ["s"], holder="run-1")).claim
    assert claim.root_session_ids == ["s"] and claim.kind == pb.CLAIM_KIND_RUN
    details = await refused(_acquire(transcript, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")
    assert details.metadata["holder_kind"] == "CLAIM_KIND_RUN"
    released = await transcript.stub.ReleaseClaims(
        api.ReleaseClaimsRequest(claim_id=claim.claim_id), metadata=transcript.as_user("alice")
    )
    assert released.released
    again = await transcript.stub.ReleaseClaims(
        api.ReleaseClaimsRequest(claim_id=claim.claim_id), metadata=transcript.as_user("alice")
    )
    assert not again.released
    assert (await _acquire(transcript, ["s"])).claim.claim_id != claim.claim_id


async def test_busy_reasons_name_the_holder_kind(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "s")
    await _acquire(transcript, ["s"], kind=pb.CLAIM_KIND_COMPACTION)
    await refused(_acquire(transcript, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")
    details = await refused(
        _acquire(transcript, ["s"], kind=pb.CLAIM_KIND_MERGE), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_BUSY"
    )
    assert details.metadata["holder_kind"] == "CLAIM_KIND_COMPACTION"


async def test_a_claim_covers_the_whole_tree(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "root")
    await _sessions(transcript, "child", parent="root")
    claim = (await _acquire(transcript, ["child"])).claim
    assert list(claim.root_session_ids) == ["root"]
    await refused(_acquire(transcript, ["root"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")


async def test_all_or_nothing(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "a", "b", "c")
    await _acquire(transcript, ["b"])
    await refused(
        _acquire(transcript, ["a", "b", "c"], kind=pb.CLAIM_KIND_MERGE),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SESSION_BUSY",
    )
    # Nothing of the refused set was kept: a and c are still free.
    both = (await _acquire(transcript, ["c", "a"])).claim
    assert list(both.root_session_ids) == ["a", "c"]


async def test_expired_leases_are_free_and_cannot_be_renewed(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "s")
    stale = (await _acquire(transcript, ["s"], ttl=1)).claim
    await asyncio.sleep(1.2)
    await refused(
        transcript.stub.RenewClaims(
            api.RenewClaimsRequest(claim_id=stale.claim_id, ttl=Duration(seconds=30)),
            metadata=transcript.as_user("alice"),
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "CLAIM_NOT_HELD",
    )
    fresh = (await _acquire(transcript, ["s"])).claim
    renewed = await transcript.stub.RenewClaims(
        api.RenewClaimsRequest(claim_id=fresh.claim_id, ttl=Duration(seconds=60)), metadata=transcript.as_user("alice")
    )
    assert renewed.claim.expire_time.ToMilliseconds() > fresh.expire_time.ToMilliseconds()
    # The stale holder's release must not free the new holder's claim.
    stale_release = await transcript.stub.ReleaseClaims(
        api.ReleaseClaimsRequest(claim_id=stale.claim_id), metadata=transcript.as_user("alice")
    )
    assert not stale_release.released
    await refused(_acquire(transcript, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")


async def test_claim_input_is_validated(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "s")
    for ids, kind, ttl in [
        ([], pb.CLAIM_KIND_RUN, 30),
        (["s"], pb.CLAIM_KIND_UNSPECIFIED, 30),
        (["s"], pb.CLAIM_KIND_RUN, 0),
    ]:
        await refused(
            _acquire(transcript, ids, kind=kind, ttl=ttl), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
        )
    await refused(_acquire(transcript, ["missing"]), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
    other = transcript.stub.AcquireClaims(
        api.AcquireClaimsRequest(session_ids=["s"], kind=pb.CLAIM_KIND_RUN, holder="h", ttl=Duration(seconds=5)),
        metadata=transcript.as_user("mallory"),
    )
    await refused(other, grpc.StatusCode.PERMISSION_DENIED, "SESSION_PERMISSION_DENIED")
    assert (await _acquire(transcript, ["s"])).claim.claim_id


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_concurrent_acquirers_never_both_hold(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "a", "b", "c", "d")
    for round_number in range(5):
        # Overlapping sets from many clients at once; every tree must end with at most one holder.
        sets = [["a", "b"], ["b", "c"], ["c", "d"], ["d", "a"], ["a", "c"], ["b", "d"]] * 3
        calls = [_acquire(transcript, s, holder=f"r{round_number}-{i}") for i, s in enumerate(sets)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        winners = [r.claim for r in results if isinstance(r, api.AcquireClaimsResponse)]
        losers = [r for r in results if not isinstance(r, api.AcquireClaimsResponse)]
        held = [root for claim in winners for root in claim.root_session_ids]
        assert len(held) == len(set(held)), "two claims hold the same tree"
        assert winners, "someone must win"
        for loser in losers:
            assert isinstance(loser, grpc.aio.AioRpcError)
            assert error_details(loser).reason == "SESSION_ALREADY_RUNNING"
        for claim in winners:
            await transcript.stub.ReleaseClaims(
                api.ReleaseClaimsRequest(claim_id=claim.claim_id), metadata=transcript.as_user("alice")
            )


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_concurrent_takeover_of_an_expired_lease_has_one_winner(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "s")
    await _acquire(transcript, ["s"], ttl=1)
    await asyncio.sleep(1.2)
    results = await asyncio.gather(
        *[_acquire(transcript, ["s"], holder=f"h{i}") for i in range(20)], return_exceptions=True
    )
    assert sum(isinstance(r, api.AcquireClaimsResponse) for r in results) == 1
