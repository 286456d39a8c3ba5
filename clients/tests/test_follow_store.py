"""RecordStore, frame by frame: snapshot install, resume, chains, attempts, settlements, generations."""

from __future__ import annotations

import pytest
from follow_frames import (
    GEN,
    apply_all,
    baseline,
    batch,
    chunk,
    heartbeat,
    message,
    opened,
    prefix,
    ref,
    resume,
    resync,
    settlement,
    texts,
    watermark,
)

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_follow.store import (
    CHAIN_GAP,
    CHUNK_GAP,
    GENERATION_CHANGED,
    INVALID_SETTLEMENT,
    OUT_OF_ORDER,
    UNKNOWN_ATTEMPT,
    Cursor,
    Outcome,
    Prefix,
    RecordStore,
    Status,
)

APPLIED = Outcome.applied()


def live_store(seq: int = 5, *messages: pb.Message, prefixes: tuple[fpb.ActivePrefix, ...] = ()) -> RecordStore:
    """A store with a baseline installed and its stream live."""
    store = RecordStore()
    assert apply_all(store, baseline(seq, messages or [message(1, "hi")], prefixes=prefixes)) == [APPLIED] * (
        5 + len(prefixes)
    )
    return store


# Baseline


def test_a_baseline_is_invisible_until_its_end_then_installed_whole() -> None:
    store = live_store(5, message(1, "old"), prefixes=(prefix("k-old", 1, "abc", 3),))
    store.apply(batch(5, 6, upsert=["p-old"]))
    new = baseline(
        9,
        [message(7, "one"), message(8, "two")],
        prefixes=[prefix("k1", 2, "hel", 2)],
        state=fpb.RUN_STATE_RUNNING,
        prompts=["p1"],
        stream_generation=GEN + 1,
    )

    for frame in new[:-1]:
        assert store.apply(frame) == APPLIED
        # Nothing of the snapshot shows before its end.
        assert texts(store) == ["old"]
        assert list(store.prefixes) == ["k-old"]
        assert list(store.prompts) == ["p-old"]
        assert store.cursor == Cursor(GEN, 6)
        assert not store.live

    assert store.apply(new[-1]) == APPLIED
    assert texts(store) == ["one", "two"]
    assert store.prefixes == {"k1": Prefix("k1", 2, 2, "hel")}
    assert store.runtime_state.state == fpb.RUN_STATE_RUNNING
    assert list(store.prompts) == ["p1"]
    assert store.cursor == Cursor(GEN + 1, 9)
    assert store.durable_seq == 9
    assert store.live


@pytest.mark.parametrize(
    ("order", "bad_at"),
    [
        # Records before the snapshot began.
        ([0, 2, 1, 3, 4], 1),
        # The end without the runtime part.
        ([0, 1, 2, 4], 3),
        # A part twice.
        ([0, 1, 2, 2, 3, 4], 3),
    ],
)
def test_a_snapshot_out_of_order_is_a_resync(order: list[int], bad_at: int) -> None:
    store = live_store(5, message(1, "kept"))
    frames = baseline(9, [message(7, "new")], stream_generation=GEN + 1)

    outcomes = apply_all(store, [frames[i] for i in order[: bad_at + 1]])

    assert outcomes[-1] == Outcome.resync(OUT_OF_ORDER)
    assert texts(store) == ["kept"]
    assert store.cursor == Cursor(GEN, 5)


def test_a_suffix_frame_inside_a_baseline_is_a_resync() -> None:
    store = RecordStore()
    frames = baseline(3, [message(1, "a")])

    outcomes = apply_all(store, [*frames[:3], batch(3, 4)])

    assert outcomes[-1] == Outcome.resync(OUT_OF_ORDER)
    assert store.cursor is None
    assert not store.messages


def test_a_stream_that_ends_mid_baseline_leaves_the_previous_baseline() -> None:
    store = live_store(5, message(1, "kept"))
    apply_all(store, baseline(9, [message(7, "new")], stream_generation=GEN + 1)[:3])

    store.end_stream()
    # The next stream starts from scratch: the half snapshot of the last one is gone.
    outcomes = apply_all(store, baseline(10, [message(8, "fresh")], stream_generation=GEN + 1))

    assert outcomes == [APPLIED] * 5
    assert texts(store) == ["fresh"]


def test_frames_before_a_handshake_are_out_of_order() -> None:
    assert RecordStore().apply(batch(0, 1)) == Outcome.resync(OUT_OF_ORDER)


def test_an_unknown_frame_kind_is_ignored() -> None:
    store = live_store()

    assert store.apply(api.FollowResponse(stream_generation=GEN)).status is Status.IGNORED


# Resume


def test_a_resume_keeps_records_and_replaces_all_prefixes_at_the_first_other_frame() -> None:
    store = live_store(5, message(1, "kept"), prefixes=(prefix("gone", 1, "x", 1), prefix("k", 1, "he", 2)))
    store.end_stream()

    assert apply_all(store, resume([prefix("k", 1, "hello", 4), prefix("new", 1, "", 0)])) == [APPLIED] * 3
    # Collected, not yet installed: the old prefixes still show, all of them.
    assert set(store.prefixes) == {"gone", "k"}
    assert not store.live

    assert store.apply(batch(5, 6, [message(2, "more")])) == APPLIED
    assert store.prefixes == {"k": Prefix("k", 1, 4, "hello"), "new": Prefix("new", 1, 0, "")}
    assert texts(store) == ["kept", "more"]
    assert store.cursor == Cursor(GEN, 6)
    assert store.live


def test_a_resume_without_prefixes_clears_them_at_the_first_frame() -> None:
    store = live_store(5, prefixes=(prefix("k", 1, "he", 2),))
    store.end_stream()

    apply_all(store, [*resume(), heartbeat(5, 5)])

    assert store.prefixes == {}


@pytest.mark.parametrize("stream_generation", [GEN - 1, GEN + 1])
def test_a_resume_of_another_generation_is_a_resync(stream_generation: int) -> None:
    store = live_store()
    store.end_stream()

    assert apply_all(store, resume(stream_generation=stream_generation))[0] == Outcome.resync(GENERATION_CHANGED)


def test_a_resume_without_a_baseline_is_a_resync() -> None:
    assert RecordStore().apply(resume()[0]) == Outcome.resync(GENERATION_CHANGED)


# Batches and watermarks


def test_batches_chain_and_apply_everything() -> None:
    store = RecordStore(event_limit=2)
    apply_all(store, baseline(5, [message(1, "hi")], prompts=["p1"]))

    outcomes = apply_all(
        store,
        [
            batch(5, 6, [message(2, "a"), message(3, "b")], state=fpb.RUN_STATE_RUNNING, upsert=["p2"]),
            watermark(6, 7),
            batch(7, 8, resolve=["p1"], events=[1, 2, 3]),
        ],
    )

    assert outcomes == [APPLIED] * 3
    assert texts(store) == ["hi", "a", "b"]
    assert store.runtime_state.state == fpb.RUN_STATE_RUNNING
    assert list(store.prompts) == ["p2"]
    # Runtime events are bounded: only the last ones stay.
    assert [event.compaction_marker.event_id for event in store.events] == [2, 3]
    assert store.cursor == Cursor(GEN, 8)


@pytest.mark.parametrize(
    "frame",
    [batch(3, 5, [message(2, "x")]), batch(4, 5), watermark(3, 4), watermark(4, 5)],
    ids=["batch-at-applied", "batch-below", "watermark-below", "watermark-at-applied"],
)
def test_duplicates_are_ignored(frame: api.FollowResponse) -> None:
    store = live_store(5)

    assert store.apply(frame).status is Status.IGNORED
    assert store.cursor == Cursor(GEN, 5)
    assert texts(store) == ["hi"]


@pytest.mark.parametrize("frame", [batch(6, 7, [message(2, "x")]), watermark(4, 7)], ids=["batch", "watermark"])
def test_a_broken_chain_is_a_resync_for_a_fresh_baseline(frame: api.FollowResponse) -> None:
    store = live_store(5)

    outcome = store.apply(frame)

    assert outcome == Outcome.resync(CHAIN_GAP)
    assert not outcome.resumable
    assert texts(store) == ["hi"]
    # The stream is over for the store: later frames of it are refused too.
    assert store.apply(batch(5, 6)) == Outcome.resync(OUT_OF_ORDER)


def test_a_batch_upserts_messages_by_id() -> None:
    store = live_store(5, message(1, "hi"))

    store.apply(batch(5, 6, [message(1, "hi, edited")]))

    assert texts(store) == ["hi, edited"]


def test_tool_calls_and_results_are_joined_by_call_id() -> None:
    store = live_store(5, message(1, "result first", pb.MESSAGE_ROLE_TOOL, tool_call_id="c0"))

    store.apply(
        batch(
            5,
            6,
            [
                message(2, "", pb.MESSAGE_ROLE_ASSISTANT, tool_calls=["c1", "c2"]),
                message(3, "out", pb.MESSAGE_ROLE_TOOL, tool_call_id="c1"),
            ],
        )
    )

    assert store.tools["c1"].call_message_id == 2
    assert store.tools["c1"].result_message_id == 3
    assert store.tools["c2"].result_message_id is None
    call = store.tools["c1"].call
    assert call is not None and call.name == "shell"
    # A result whose call is older than the loaded page still has its record.
    assert (store.tools["c0"].call, store.tools["c0"].result_message_id) == (None, 1)


# Attempts and chunks


def test_chunks_apply_in_order_and_duplicates_are_ignored() -> None:
    store = live_store()

    outcomes = apply_all(store, [opened("k"), chunk("k", 1, 0, "he"), chunk("k", 1, 1, "llo"), chunk("k", 1, 0, "he")])

    assert [o.status for o in outcomes] == [Status.APPLIED] * 3 + [Status.IGNORED]
    assert store.prefixes["k"] == Prefix("k", 1, 2, "hello")


def test_a_chunk_ahead_of_the_next_index_is_a_gap() -> None:
    store = live_store()
    apply_all(store, [opened("k"), chunk("k", 1, 0, "he")])

    assert store.apply(chunk("k", 1, 2, "x")) == Outcome.resync(CHUNK_GAP)
    assert store.prefixes["k"].text == "he"


@pytest.mark.parametrize("frame", [chunk("unknown", 1, 0, "x"), chunk("k", 2, 0, "x")], ids=["key", "attempt"])
def test_a_chunk_of_an_attempt_never_opened_is_a_resync(frame: api.FollowResponse) -> None:
    store = live_store()
    store.apply(opened("k"))

    assert store.apply(frame) == Outcome.resync(UNKNOWN_ATTEMPT)


def test_a_retry_replaces_the_prefix_and_old_attempts_are_ignored() -> None:
    store = live_store()
    apply_all(store, [opened("k"), chunk("k", 1, 0, "first try")])

    assert store.apply(opened("k", 2)) == APPLIED
    assert store.prefixes["k"] == Prefix("k", 2, 0, "")
    assert store.apply(chunk("k", 1, 1, " more")).status is Status.IGNORED
    assert store.apply(opened("k", 1)).status is Status.IGNORED
    assert store.apply(opened("k", 2)).status is Status.IGNORED
    assert store.apply(chunk("k", 2, 0, "second")) == APPLIED
    assert store.prefixes["k"] == Prefix("k", 2, 1, "second")


def test_a_batch_settles_only_the_matching_attempt() -> None:
    store = live_store(5)
    apply_all(store, [opened("k", 2), chunk("k", 2, 0, "x"), opened("j")])

    store.apply(batch(5, 6, [message(2, "x", pb.MESSAGE_ROLE_ASSISTANT)], settles=ref("j", 7)))
    assert set(store.prefixes) == {"k", "j"}
    store.apply(batch(6, 7, [message(3, "x", pb.MESSAGE_ROLE_ASSISTANT)], settles=ref("k", 2)))
    assert set(store.prefixes) == {"j"}


# Settlements


def test_a_settlement_after_its_batch_marks_the_outcome_and_durability() -> None:
    store = live_store(5)
    apply_all(store, [opened("k"), batch(5, 6, [message(2, "part", pb.MESSAGE_ROLE_ASSISTANT)], settles=ref("k"))])

    outcome = store.apply(settlement("k", 1, 6, 2, fpb.SETTLEMENT_OUTCOME_INTERRUPTED))

    assert outcome == APPLIED
    assert store.settlements == {2: fpb.SETTLEMENT_OUTCOME_INTERRUPTED}
    assert store.durable_seq == 6


@pytest.mark.parametrize(
    "frame",
    [
        # Ahead of the applied batches: its batch never arrived.
        settlement("k", 1, 7, 2),
        # Its message is unknown.
        settlement("k", 1, 6, 99),
    ],
    ids=["ahead", "unknown-message"],
)
def test_an_invalid_settlement_is_a_resync(frame: api.FollowResponse) -> None:
    store = live_store(5)
    store.apply(batch(5, 6, [message(2, "x", pb.MESSAGE_ROLE_ASSISTANT)]))

    assert store.apply(frame) == Outcome.resync(INVALID_SETTLEMENT)
    assert store.settlements == {}


# Generations, resyncs, status


@pytest.mark.parametrize(
    "frame",
    [
        batch(5, 6, stream_generation=GEN + 1),
        heartbeat(5, 5, stream_generation=GEN - 1),
        opened("k", stream_generation=GEN + 1),
    ],
    ids=["batch", "heartbeat", "attempt"],
)
def test_a_frame_of_another_generation_is_a_resync(frame: api.FollowResponse) -> None:
    store = live_store(5)

    assert store.apply(frame) == Outcome.resync(GENERATION_CHANGED)
    assert store.cursor == Cursor(GEN, 5)


def test_a_snapshot_frame_of_another_generation_is_a_resync() -> None:
    store = RecordStore()
    frames = baseline(5)
    frames[2].stream_generation = GEN + 1

    assert apply_all(store, frames[:3])[-1] == Outcome.resync(GENERATION_CHANGED)


@pytest.mark.parametrize(
    ("reason", "resumable", "name"),
    [(fpb.RESYNC_REASON_OVERFLOW, True, "overflow"), (fpb.RESYNC_REASON_REWRITE, False, "rewrite")],
)
def test_a_resync_frame_ends_the_stream(reason: fpb.ResyncReason.ValueType, resumable: bool, name: str) -> None:
    store = live_store(5)

    # Even of an older stream generation: the stream it ends is the one being read.
    assert store.apply(resync(reason, resumable, stream_generation=GEN - 1)) == Outcome.resync(
        name, resumable=resumable
    )
    assert store.cursor == Cursor(GEN, 5)
    assert not store.live


def test_recovery_failure_shows_until_recovered() -> None:
    store = live_store(5)
    failure = fpb.RecoveryFailureFrame(reason="OperationalError", commit_seq=7, durable_seq=5, failed_attempts=2)

    store.apply(api.FollowResponse(stream_generation=GEN, recovery_failure=failure))
    assert store.recovery_failure is not None
    assert (store.recovery_failure.reason, store.recovery_failure.failed_attempts) == ("OperationalError", 2)
    store.apply(heartbeat(7, 6))
    assert store.recovery_failure is not None
    assert store.durable_seq == 6

    store.apply(api.FollowResponse(stream_generation=GEN, recovered=fpb.RecoveredFrame(durable_seq=7)))
    assert store.recovery_failure is None
    assert store.durable_seq == 7


def test_a_heartbeat_with_everything_durable_ends_a_recovery_failure() -> None:
    # The `recovered` frame may have been sent while this follower was reconnecting.
    store = live_store(5)
    failure = fpb.RecoveryFailureFrame(reason="x", commit_seq=7, durable_seq=5, failed_attempts=1)
    store.apply(api.FollowResponse(stream_generation=GEN, recovery_failure=failure))

    store.apply(heartbeat(7, 7))

    assert store.recovery_failure is None


def _piece(first: int, next_index: int, text: str, key: str = "k", attempt: int = 1) -> fpb.ActivePrefix:
    return fpb.ActivePrefix(attempt=ref(key, attempt), first_chunk_index=first, next_chunk_index=next_index, text=text)


def test_a_prefix_in_pieces_is_installed_whole_and_a_gap_between_pieces_is_a_resync() -> None:
    store = RecordStore()
    pieces = [_piece(0, 2, "ab"), _piece(2, 3, "c"), _piece(0, 1, "z", key="other")]
    assert all(o.status is Status.APPLIED for o in apply_all(store, baseline(3, prefixes=pieces)))
    assert store.prefixes["k"] == Prefix("k", 1, 3, "abc")
    assert store.prefixes["other"] == Prefix("other", 1, 1, "z")

    gapped = RecordStore()
    outcomes = apply_all(gapped, baseline(3, prefixes=[_piece(0, 2, "ab"), _piece(3, 4, "d")]))
    assert outcomes[-2] == Outcome.resync(CHUNK_GAP)
    assert gapped.cursor is None


def test_a_store_evicts_its_oldest_messages_beyond_its_limit() -> None:
    store = RecordStore(message_limit=3)
    apply_all(store, baseline(2, [message(1, "a"), message(2, "b")]))
    apply_all(store, [batch(2, 3, [message(3, "c"), message(4, "d"), message(5, "e")])])
    assert texts(store) == ["c", "d", "e"]
    assert store.has_older and store.history is not None
    assert (store.history.before_message_id, store.history.snapshot_sequence) == (3, 3)
    with pytest.raises(ValueError, match="at least one"):
        RecordStore(message_limit=0)


def test_a_snapshot_larger_than_the_store_keeps_its_newest_and_a_cursor_before_them() -> None:
    store = RecordStore(message_limit=2)
    apply_all(store, baseline(3, [message(1, "a"), message(2, "b"), message(3, "c")]))
    assert texts(store) == ["b", "c"]
    assert store.has_older and store.history is not None and store.history.before_message_id == 2
