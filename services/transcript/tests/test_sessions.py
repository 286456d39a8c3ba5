"""Sessions over the real gRPC server, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask
from transcript_testing import TranscriptClient, refused, running_transcript

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api


async def test_create_assigns_an_id_and_reads_back(transcript: TranscriptClient) -> None:
    alice = transcript.as_user("alice")
    created = await transcript.stub.CreateSession(
        api.CreateSessionRequest(title="fix the build", model="m1", working_directory="/src"), metadata=alice
    )
    assert created.created
    session = created.session
    assert session.session_id and session.owner == "alice" and session.root_session_id == session.session_id
    assert session.kind == pb.SESSION_KIND_CHAT and session.history_generation == 1
    got = await transcript.stub.GetSession(api.GetSessionRequest(session_id=session.session_id), metadata=alice)
    assert got.session == session


async def test_caller_supplied_id_is_idempotent(transcript: TranscriptClient) -> None:
    alice = transcript.as_user("alice")
    request = api.CreateSessionRequest(session_id="s-1", title="a")
    first = await transcript.stub.CreateSession(request, metadata=alice)
    again = await transcript.stub.CreateSession(request, metadata=alice)
    assert first.created and not again.created and again.session == first.session
    await refused(
        transcript.stub.CreateSession(api.CreateSessionRequest(session_id="s-1", title="b"), metadata=alice),
        grpc.StatusCode.ALREADY_EXISTS,
        "SESSION_ALREADY_EXISTS",
    )
    await refused(
        transcript.stub.CreateSession(request, metadata=transcript.as_user("bob")),
        grpc.StatusCode.ALREADY_EXISTS,
        "SESSION_ALREADY_EXISTS",
    )


async def test_a_deleted_sessions_id_is_not_used_again_and_its_owner_is_told_why(transcript: TranscriptClient) -> None:
    alice, bob = transcript.as_user("alice"), transcript.as_user("bob")
    request = api.CreateSessionRequest(session_id="gone", title="a")
    await transcript.stub.CreateSession(request, metadata=alice)
    await transcript.stub.DeleteSession(api.DeleteSessionRequest(session_id="gone"), metadata=alice)
    # Even the very same request: the id stays the deleted session's.
    mine = await refused(
        transcript.stub.CreateSession(request, metadata=alice), grpc.StatusCode.ALREADY_EXISTS, "SESSION_ALREADY_EXISTS"
    )
    assert "deleted session of yours" in mine.message
    # Anyone else only learns that the id is taken.
    theirs = await refused(
        transcript.stub.CreateSession(request, metadata=bob), grpc.StatusCode.ALREADY_EXISTS, "SESSION_ALREADY_EXISTS"
    )
    assert "deleted" not in theirs.message


async def test_other_users_session_is_permission_denied_before_not_found(transcript: TranscriptClient) -> None:
    alice, bob = transcript.as_user("alice"), transcript.as_user("bob")
    created = await transcript.stub.CreateSession(api.CreateSessionRequest(session_id="mine"), metadata=alice)
    await refused(
        transcript.stub.GetSession(api.GetSessionRequest(session_id="mine"), metadata=bob),
        grpc.StatusCode.PERMISSION_DENIED,
        "SESSION_PERMISSION_DENIED",
    )
    await transcript.stub.DeleteSession(api.DeleteSessionRequest(session_id="mine"), metadata=alice)
    await refused(
        transcript.stub.GetSession(api.GetSessionRequest(session_id="mine"), metadata=bob),
        grpc.StatusCode.PERMISSION_DENIED,
        "SESSION_PERMISSION_DENIED",
    )
    await refused(
        transcript.stub.GetSession(api.GetSessionRequest(session_id="mine"), metadata=alice),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )
    deleted = await transcript.stub.GetSession(
        api.GetSessionRequest(session_id="mine", include_deleted=True), metadata=alice
    )
    assert deleted.session.HasField("delete_time") and deleted.session.session_id == created.session.session_id


async def test_children_share_the_root_and_delete_covers_the_tree(transcript: TranscriptClient) -> None:
    alice = transcript.as_user("alice")
    await transcript.stub.CreateSession(api.CreateSessionRequest(session_id="root"), metadata=alice)
    child = await transcript.stub.CreateSession(
        api.CreateSessionRequest(session_id="child", parent_session_id="root", kind=pb.SESSION_KIND_SUBTASK),
        metadata=alice,
    )
    grandchild = await transcript.stub.CreateSession(
        api.CreateSessionRequest(session_id="grandchild", parent_session_id="child"), metadata=alice
    )
    assert child.session.root_session_id == "root" and grandchild.session.root_session_id == "root"
    await transcript.stub.CreateSession(api.CreateSessionRequest(session_id="other"), metadata=alice)
    deleted = await transcript.stub.DeleteSession(api.DeleteSessionRequest(session_id="root"), metadata=alice)
    assert sorted(deleted.deleted_session_ids) == ["child", "grandchild", "root"]
    assert deleted.event_id > 0
    listed = await transcript.stub.ListSessions(api.ListSessionsRequest(), metadata=alice)
    assert [s.session_id for s in listed.sessions] == ["other"]
    again = await transcript.stub.DeleteSession(api.DeleteSessionRequest(session_id="root"), metadata=alice)
    assert list(again.deleted_session_ids) == [] and again.event_id == 0


async def test_list_pages_newest_first_with_bound_tokens(transcript: TranscriptClient) -> None:
    alice = transcript.as_user("alice")
    for index in range(7):
        await transcript.stub.CreateSession(api.CreateSessionRequest(session_id=f"s{index}"), metadata=alice)
    await transcript.stub.CreateSession(api.CreateSessionRequest(session_id="bobs"), metadata=transcript.as_user("bob"))
    seen: list[str] = []
    token = ""
    while True:
        page = await transcript.stub.ListSessions(
            api.ListSessionsRequest(page_size=3, page_token=token), metadata=alice
        )
        seen += [s.session_id for s in page.sessions]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == [f"s{i}" for i in range(7)] and len(seen) == 7
    first = await transcript.stub.ListSessions(api.ListSessionsRequest(page_size=3), metadata=alice)
    await refused(
        transcript.stub.ListSessions(
            api.ListSessionsRequest(page_size=3, page_token=first.next_page_token, parent_session_id="s1"),
            metadata=alice,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PAGE_TOKEN_INVALID",
    )
    await refused(
        transcript.stub.ListSessions(api.ListSessionsRequest(page_token="garbage!"), metadata=alice),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PAGE_TOKEN_INVALID",
    )


async def test_update_changes_only_masked_fields(transcript: TranscriptClient) -> None:
    alice = transcript.as_user("alice")
    await transcript.stub.CreateSession(
        api.CreateSessionRequest(session_id="u", title="old", model="m"), metadata=alice
    )
    changed = pb.Session(session_id="u", title="new", model="ignored", memory_injection_disabled=True)
    changed.metadata.update({"sessionMergeOperationId": "op-1"})
    updated = await transcript.stub.UpdateSession(
        api.UpdateSessionRequest(
            session=changed, update_mask=FieldMask(paths=["title", "memory_injection_disabled", "metadata"])
        ),
        metadata=alice,
    )
    assert updated.session.title == "new" and updated.session.model == "m"
    assert updated.session.memory_injection_disabled
    assert updated.session.metadata["sessionMergeOperationId"] == "op-1"
    await refused(
        transcript.stub.UpdateSession(
            api.UpdateSessionRequest(session=changed, update_mask=FieldMask(paths=["owner"])), metadata=alice
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )


async def test_bad_input_is_refused_and_changes_nothing(transcript: TranscriptClient) -> None:
    alice = transcript.as_user("alice")
    bad_requests = [
        api.CreateSessionRequest(session_id="has space"),
        api.CreateSessionRequest(session_id="x" * 65),
        api.CreateSessionRequest(title="t" * 1001),
        api.CreateSessionRequest(title="nul\x00"),
        api.CreateSessionRequest(kind=99),  # type: ignore[arg-type]
        api.CreateSessionRequest(parent_session_id="missing"),
    ]
    for request in bad_requests[:5]:
        details = await refused(
            transcript.stub.CreateSession(request, metadata=alice), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
        )
        assert details.violations, "a violation names the field"
    await refused(
        transcript.stub.CreateSession(bad_requests[5], metadata=alice), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"
    )
    await refused(
        transcript.stub.ListSessions(api.ListSessionsRequest(page_size=-1), metadata=alice),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )
    listed = await transcript.stub.ListSessions(api.ListSessionsRequest(), metadata=alice)
    assert list(listed.sessions) == []


async def test_calls_need_the_service_credential_and_an_acting_user(transcript: TranscriptClient) -> None:
    await refused(
        transcript.stub.ListSessions(api.ListSessionsRequest(), metadata=(("authorization", "Bearer wrong"),)),
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
    )
    await refused(
        transcript.stub.ListSessions(api.ListSessionsRequest()), grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"
    )
    await refused(
        transcript.stub.ListSessions(api.ListSessionsRequest(), metadata=transcript.system),
        grpc.StatusCode.UNAUTHENTICATED,
        "ACTING_USER_REQUIRED",
    )


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_rpc_spans_are_exported_when_an_exporter_is_configured(
    tmp_path: Path, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_transcript(tmp_path, database_url, trace_exporter="console") as client:
        await client.stub.CreateSession(
            api.CreateSessionRequest(session_id="traced", title="secret title"), metadata=client.as_user("alice")
        )
    printed = capsys.readouterr().out
    assert "TranscriptService/CreateSession" in printed
    assert "secret title" not in printed
