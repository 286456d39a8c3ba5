"""The execution gate: all-or-nothing claims over session trees, leases (on a clock the tests move),
refusals that say who holds a session until when, and real concurrency."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from clock_testing import ManualClock
from google.protobuf.duration_pb2 import Duration
from transcript_testing import TranscriptClient, refused, running_transcript

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.errors import error_details


@pytest.fixture
def clock() -> ManualClock:
    """Time that passes only when a test advances it."""
    return ManualClock()


@pytest.fixture
async def clocked(tmp_path: Path, database_url: str, clock: ManualClock) -> AsyncIterator[TranscriptClient]:
    """A transcript service whose leases run on `clock`."""
    async with running_transcript(tmp_path, database_url, clock) as client:
        yield client


async def _sessions(client: TranscriptClient, *ids: str, parent: str = "", owner: str = "alice") -> None:
    for session_id in ids:
        await client.stub.CreateSession(
            api.CreateSessionRequest(session_id=session_id, parent_session_id=parent), metadata=client.as_user(owner)
        )


def _acquire(
    client: TranscriptClient,
    ids: list[str],
    kind: int = pb.CLAIM_KIND_RUN,
    ttl: float = 30,
    holder: str = "h",
    owner: str = "alice",
) -> grpc.aio.UnaryUnaryCall[api.AcquireClaimsRequest, api.AcquireClaimsResponse]:
    duration = Duration()
    duration.FromMilliseconds(int(ttl * 1000))
    return client.stub.AcquireClaims(
        api.AcquireClaimsRequest(session_ids=ids, kind=kind, holder=holder, ttl=duration),  # type: ignore[arg-type]
        metadata=client.as_user(owner),
    )


def _release_holder(
    client: TranscriptClient, holder: str, kind: int, metadata: tuple[tuple[str, str], ...]
) -> grpc.aio.UnaryUnaryCall[api.ReleaseHolderClaimsRequest, api.ReleaseHolderClaimsResponse]:
    return client.stub.ReleaseHolderClaims(
        api.ReleaseHolderClaimsRequest(holder=holder, kind=kind),  # type: ignore[arg-type]
        metadata=metadata,
    )


async def test_run_claim_refuses_a_second_run_until_released(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "s")
    claim = (await _acquire(transcript, ["s"], holder="run-1")).claim
    assert claim.root_session_ids == ["s"] and claim.kind == pb.CLAIM_KIND_RUN
    details = await refused(_acquire(transcript, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")
    # The refusal names the holder and when its lease ends (RFC 3339, as the claim's expire_time).
    assert details.metadata == {
        "root_session_id": "s",
        "holder_kind": "CLAIM_KIND_RUN",
        "holder": "run-1",
        "expire_time": claim.expire_time.ToJsonString(),
    }
    released = await transcript.stub.ReleaseClaims(
        api.ReleaseClaimsRequest(claim_id=claim.claim_id), metadata=transcript.as_user("alice")
    )
    assert released.released
    again = await transcript.stub.ReleaseClaims(
        api.ReleaseClaimsRequest(claim_id=claim.claim_id), metadata=transcript.as_user("alice")
    )
    assert not again.released
    assert (await _acquire(transcript, ["s"])).claim.claim_id != claim.claim_id


async def test_busy_reasons_name_the_holder_and_its_lease(clocked: TranscriptClient, clock: ManualClock) -> None:
    await _sessions(clocked, "s")
    await _acquire(clocked, ["s"], kind=pb.CLAIM_KIND_COMPACTION, ttl=15, holder="compaction:pod-1")
    await refused(_acquire(clocked, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")
    details = await refused(
        _acquire(clocked, ["s"], kind=pb.CLAIM_KIND_MERGE), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_BUSY"
    )
    assert details.metadata == {
        "root_session_id": "s",
        "holder_kind": "CLAIM_KIND_COMPACTION",
        "holder": "compaction:pod-1",
        # The manual clock starts at 2024-01-01T00:00:00Z; the lease is 15 s.
        "expire_time": "2024-01-01T00:00:15Z",
    }


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


async def test_expired_leases_are_free_and_cannot_be_renewed(clocked: TranscriptClient, clock: ManualClock) -> None:
    transcript = clocked
    await _sessions(transcript, "s")
    stale = (await _acquire(transcript, ["s"], ttl=1)).claim
    clock.advance(0.999)
    await refused(_acquire(transcript, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")
    clock.advance(0.001)
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
async def test_concurrent_takeover_of_an_expired_lease_has_one_winner(
    clocked: TranscriptClient, clock: ManualClock
) -> None:
    await _sessions(clocked, "s")
    await _acquire(clocked, ["s"], ttl=1)
    clock.advance(1)
    results = await asyncio.gather(
        *[_acquire(clocked, ["s"], holder=f"h{i}") for i in range(20)], return_exceptions=True
    )
    assert sum(isinstance(r, api.AcquireClaimsResponse) for r in results) == 1


async def test_a_renewed_lease_outlives_its_first_expiry(clocked: TranscriptClient, clock: ManualClock) -> None:
    await _sessions(clocked, "s")
    claim = (await _acquire(clocked, ["s"], ttl=15, holder="compaction:pod-1")).claim
    for _ in range(4):
        # A heartbeat every 5 s keeps a 15 s lease alive for as long as the holder lives.
        clock.advance(5)
        renewed = await clocked.stub.RenewClaims(
            api.RenewClaimsRequest(claim_id=claim.claim_id, ttl=Duration(seconds=15)), metadata=clocked.as_user("alice")
        )
        details = await refused(
            _acquire(clocked, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING"
        )
        assert details.metadata["expire_time"] == renewed.claim.expire_time.ToJsonString()
    # The holder stops renewing (it crashed): the session is free once the last lease ends.
    clock.advance(14.999)
    await refused(_acquire(clocked, ["s"]), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")
    clock.advance(0.001)
    assert (await _acquire(clocked, ["s"], holder="run-2")).claim.holder == "run-2"


async def test_a_holder_releases_its_claims_of_one_kind_for_every_owner(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "a", "b")
    await _sessions(transcript, "c", "d", owner="bob")
    mine = [
        (await _acquire(transcript, ["a"], kind=pb.CLAIM_KIND_COMPACTION, holder="compaction:pod-1")).claim,
        (
            await _acquire(transcript, ["c"], kind=pb.CLAIM_KIND_COMPACTION, holder="compaction:pod-1", owner="bob")
        ).claim,
    ]
    # Another replica's claim, and a claim of another kind under the same name, are not this holder's.
    await _acquire(transcript, ["b"], kind=pb.CLAIM_KIND_COMPACTION, holder="compaction:pod-2")
    await _acquire(transcript, ["d"], kind=pb.CLAIM_KIND_MERGE, holder="compaction:pod-1", owner="bob")

    released = await _release_holder(transcript, "compaction:pod-1", pb.CLAIM_KIND_COMPACTION, transcript.system)

    assert sorted(released.claim_ids) == sorted(claim.claim_id for claim in mine)
    assert (await _acquire(transcript, ["a"])).claim.claim_id
    assert (await _acquire(transcript, ["c"], owner="bob")).claim.claim_id
    for session_id, owner in [("b", "alice"), ("d", "bob")]:
        await refused(
            _acquire(transcript, [session_id], owner=owner),
            grpc.StatusCode.FAILED_PRECONDITION,
            "SESSION_ALREADY_RUNNING",
        )
    again = await _release_holder(transcript, "compaction:pod-1", pb.CLAIM_KIND_COMPACTION, transcript.system)
    assert list(again.claim_ids) == []


async def test_a_user_releases_only_their_own_claims_of_a_holder(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "a")
    await _sessions(transcript, "c", owner="bob")
    own = (await _acquire(transcript, ["a"], holder="agent-1")).claim
    await _acquire(transcript, ["c"], holder="agent-1", owner="bob")

    released = await _release_holder(transcript, "agent-1", pb.CLAIM_KIND_RUN, transcript.as_user("alice"))

    assert list(released.claim_ids) == [own.claim_id]
    await refused(
        _acquire(transcript, ["c"], owner="bob"), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING"
    )


async def test_release_by_holder_input_is_validated(transcript: TranscriptClient) -> None:
    for holder, kind, field in [
        ("", pb.CLAIM_KIND_COMPACTION, "holder"),
        ("x" * 257, pb.CLAIM_KIND_COMPACTION, "holder"),
        ("compaction:pod-1", pb.CLAIM_KIND_UNSPECIFIED, "kind"),
    ]:
        details = await refused(
            _release_holder(transcript, holder, kind, transcript.system),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
        )
        assert [violation.field for violation in details.violations] == [field]


def _get_run(
    client: TranscriptClient, run_id: str, owner: str = "alice"
) -> grpc.aio.UnaryUnaryCall[api.GetRunRequest, api.GetRunResponse]:
    return client.stub.GetRun(api.GetRunRequest(run_id=run_id), metadata=client.as_user(owner))


async def test_a_run_id_resolves_to_its_live_claim_and_root_only(clocked: TranscriptClient, clock: ManualClock) -> None:
    transcript = clocked
    await _sessions(transcript, "root")
    await _sessions(transcript, "child", parent="root")
    claim = (await _acquire(transcript, ["child"], holder="run-1", ttl=5)).claim

    run = await _get_run(transcript, "run-1")
    assert run.root_session_id == "root"
    assert (run.claim.claim_id, run.claim.kind, list(run.claim.session_ids)) == (
        claim.claim_id,
        pb.CLAIM_KIND_RUN,
        ["child"],
    )
    # Another user, an unknown id, another kind's holder: no run.
    await refused(_get_run(transcript, "run-1", owner="mallory"), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    await refused(_get_run(transcript, "run-2"), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    await _sessions(transcript, "other")
    await _acquire(transcript, ["other"], kind=pb.CLAIM_KIND_MERGE, holder="merge-1")
    await refused(_get_run(transcript, "merge-1"), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    # A run that expired or was released is over.
    clock.advance(5)
    await refused(_get_run(transcript, "run-1"), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    again = (await _acquire(transcript, ["root"], holder="run-1")).claim
    assert (await _get_run(transcript, "run-1")).claim.claim_id == again.claim_id
    await transcript.stub.ReleaseClaims(
        api.ReleaseClaimsRequest(claim_id=again.claim_id), metadata=transcript.as_user("alice")
    )
    await refused(_get_run(transcript, "run-1"), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")


async def test_a_run_id_over_several_trees_names_no_session(transcript: TranscriptClient) -> None:
    await _sessions(transcript, "a", "b", "c")
    await _acquire(transcript, ["a", "b"], holder="wide")
    await refused(_get_run(transcript, "wide"), grpc.StatusCode.FAILED_PRECONDITION, "RUN_AMBIGUOUS")
    await _acquire(transcript, ["c"], holder="twice")
    await _sessions(transcript, "d")
    await _acquire(transcript, ["d"], holder="twice")
    await refused(_get_run(transcript, "twice"), grpc.StatusCode.FAILED_PRECONDITION, "RUN_AMBIGUOUS")
    bad = transcript.stub.GetRun(api.GetRunRequest(), metadata=transcript.as_user("alice"))
    details = await refused(bad, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    assert [violation.field for violation in details.violations] == ["run_id"]
