"""Truncated tool results: flagged once when stored, shown by history reads and Follow frames."""

from __future__ import annotations

import json

import pytest
from transcript_testing import Follower, TranscriptClient, assistant, create_session, tool, user

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_transcript.truncation import reports_truncation

ALICE = "alice"
TRUNCATED = json.dumps({"matches": ["a.py:1"], "truncated": True})


async def _stored(client: TranscriptClient, session_id: str) -> list[pb.Message]:
    page = await client.stub.ListMessagesAfter(
        api.ListMessagesAfterRequest(session_id=session_id), metadata=client.as_user(ALICE)
    )
    return list(page.messages)


def _tool_with_metadata(text: str, **metadata: str | bool) -> pb.NewMessage:
    message = tool("call-1", text)
    message.metadata.update(metadata)
    return message


async def test_a_truncated_json_result_is_flagged_and_other_metadata_kept(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    sent = [
        user("search"),
        assistant("searching", "call-1"),
        _tool_with_metadata(TRUNCATED, approvalMark="approved", resultTruncated=False),
        tool("call-1", "plain text output ... [output truncated]"),
        tool("call-1", json.dumps({"truncated": False, "lines": 3})),
        tool("call-1", json.dumps([{"truncated": True}])),
        tool("call-1", json.dumps({"truncated": "true"})),
        tool("call-1", json.dumps({"result": {"truncated": True}})),
        tool("call-1", '{"truncated": true'),
        user(TRUNCATED),
    ]
    response = await transcript.stub.AppendMessages(
        api.AppendMessagesRequest(session_id=sid, messages=sent), metadata=transcript.as_user(ALICE)
    )
    stored = await _stored(transcript, sid)
    assert [m.message_id for m in stored] == list(response.message_ids)
    flagged = stored[2]
    assert flagged.result_truncated
    assert dict(flagged.metadata) == {"approvalMark": "approved", "resultTruncated": True}
    assert flagged.content[0].text == TRUNCATED
    for message in stored[:2] + stored[3:]:
        assert not message.result_truncated, message.content[0].text
        assert "resultTruncated" not in message.metadata, message.content[0].text
    got = await transcript.stub.GetMessage(
        api.GetMessageRequest(session_id=sid, message_id=flagged.message_id), metadata=transcript.as_user(ALICE)
    )
    assert got.message.result_truncated


async def test_follow_frames_carry_the_flag(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    await transcript.stub.AppendMessages(
        api.AppendMessagesRequest(session_id=sid, messages=[assistant("run", "call-1"), tool("call-1", TRUNCATED)]),
        metadata=transcript.as_user(ALICE),
    )
    follower = Follower(transcript, sid)
    snapshot = await follower.until("snapshot_end")
    (records,) = [f.snapshot_records for f in snapshot if f.WhichOneof("frame") == "snapshot_records"]
    assert [m.result_truncated for m in records.messages] == [False, True]

    operations = [
        api.BatchOperation(message=assistant("again", "call-2")),
        api.BatchOperation(message=tool("call-2", "\n " + TRUNCATED)),
        api.BatchOperation(message=tool("call-2", "not json")),
    ]
    await transcript.stub.PublishBatch(
        api.PublishBatchRequest(session_id=sid, operations=operations), metadata=transcript.as_user(ALICE)
    )
    batch = (await follower.until("batch"))[-1].batch
    assert [m.result_truncated for m in batch.messages] == [False, True, False]
    assert batch.messages[1].metadata["resultTruncated"] is True
    follower.close()
    assert [m.result_truncated for m in await _stored(transcript, sid)] == [False, True, False, True, False]


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (['{"truncated": true}'], True),
        (['{"a": 1,', ' "truncated": true}'], True),  # the text parts together are the result
        (['{"\\u0074runcated": true}'], True),  # an escaped key is the same key
        (['{"truncated": true, "x": NaN}'], False),  # not JSON
        (['{"truncated": 1}'], False),
        (["[]"], False),
        (["truncated: true"], False),
        ([], False),
    ],
)
def test_what_counts_as_a_truncated_result(texts: list[str], expected: bool) -> None:
    assert reports_truncation([{"text": t} for t in texts]) is expected
