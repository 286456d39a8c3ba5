"""Renderer: the terminal text of `continuum follow`, and the client's backoff."""

from __future__ import annotations

import random
from collections.abc import Iterable

from follow_frames import GEN, baseline, batch, chunk, message, opened, ref, resync

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_follow import Backoff, Outcome, RecordStore, Renderer, Update
from continuum_follow.render import abbreviate


def feed(renderer: Renderer, store: RecordStore, frames: Iterable[api.FollowResponse]) -> str:
    """Apply frames and collect what the renderer writes."""
    return "".join(renderer.render(Update(frame, store.apply(frame), store)) for frame in frames)


def keyed(message_id: int, text: str, key: str, status: pb.MessageStatus.ValueType) -> pb.Message:
    """An assistant message committed for attempt `key`, as the server records it."""
    committed = message(message_id, text, pb.MESSAGE_ROLE_ASSISTANT, status=status)
    committed.metadata.update({"messageKey": key, "attempt": 1})
    return committed


def test_a_baseline_shows_roles_tool_calls_and_abbreviated_results() -> None:
    store, renderer = RecordStore(), Renderer()
    long_output = "line\n" * 100
    records = [
        message(1, "list the files"),
        message(2, "Sure.", pb.MESSAGE_ROLE_ASSISTANT, tool_calls=["c1"]),
        message(3, long_output, pb.MESSAGE_ROLE_TOOL, tool_call_id="c1"),
    ]

    out = feed(renderer, store, baseline(3, records, state=fpb.RUN_STATE_UNSPECIFIED))

    assert out == (
        f'user: list the files\nassistant: Sure.\n  → tool shell({{"cmd": "ls"}})\n  ← {abbreviate(long_output, 160)}\n'
    )
    assert abbreviate(long_output, 160).endswith("… (+340 chars)")


def test_streaming_text_is_appended_and_the_commit_completes_the_line() -> None:
    store, renderer = RecordStore(), Renderer()
    feed(renderer, store, baseline(3, [message(1, "hi")], state=fpb.RUN_STATE_UNSPECIFIED))

    pieces = [
        renderer.render(Update(frame, store.apply(frame), store))
        for frame in [opened("k"), chunk("k", 1, 0, "Hel"), chunk("k", 1, 1, "lo")]
    ]
    done = feed(
        renderer,
        store,
        [batch(3, 4, [keyed(2, "Hello!", "k", pb.MESSAGE_STATUS_COMPLETE)], settles=ref("k"))],
    )

    assert pieces == ["assistant: ", "Hel", "lo"]
    assert done == "!\n"


def test_retries_and_interruptions_are_marked() -> None:
    store, renderer = RecordStore(), Renderer()
    feed(renderer, store, baseline(3, [message(1, "hi")], state=fpb.RUN_STATE_UNSPECIFIED))

    out = feed(
        renderer,
        store,
        [
            opened("k"),
            chunk("k", 1, 0, "first"),
            opened("k", 2),
            chunk("k", 2, 0, "sec"),
            batch(3, 4, [keyed(2, "sec", "k", pb.MESSAGE_STATUS_INTERRUPTED)], settles=ref("k", 2)),
        ],
    )

    assert out == "assistant: first\nassistant [retry 1]: sec [interrupted]\n"


def test_resyncs_disconnects_and_run_states_are_dim_notes() -> None:
    store, renderer = RecordStore(), Renderer(color=True)
    feed(renderer, store, baseline(3, [message(1, "hi")], state=fpb.RUN_STATE_UNSPECIFIED))

    running = feed(renderer, store, [batch(3, 4, state=fpb.RUN_STATE_RUNNING)])
    overflow = feed(renderer, store, [resync(fpb.RESYNC_REASON_OVERFLOW, True)])
    disconnect = renderer.render(Update(None, Outcome.resync("disconnect", resumable=True), store))

    assert running == "\x1b[2m· running\x1b[0m\n"
    assert overflow == "\x1b[2m· resync (overflow); following again\x1b[0m\n"
    assert disconnect == "\x1b[2m· connection lost; following again\x1b[0m\n"
    failed = Update(None, Outcome.resync("disconnect", resumable=True), store, "UNAVAILABLE: Socket closed")
    assert renderer.render(failed) == "\x1b[2m· connection lost (UNAVAILABLE: Socket closed); following again\x1b[0m\n"


def test_a_new_baseline_shows_only_news_unless_the_shown_history_was_rewritten() -> None:
    store, renderer = RecordStore(), Renderer()
    feed(renderer, store, baseline(3, [message(1, "one"), message(2, "two")], state=fpb.RUN_STATE_UNSPECIFIED))

    same = feed(
        renderer,
        store,
        baseline(4, [message(1, "one"), message(2, "two"), message(3, "three")], state=fpb.RUN_STATE_UNSPECIFIED),
    )
    rewritten = feed(
        renderer, store, baseline(5, [message(1, "uno")], stream_generation=GEN + 1, state=fpb.RUN_STATE_UNSPECIFIED)
    )

    assert same == "user: three\n"
    assert rewritten == "· the history was rewritten; showing it again\nuser: uno\n"


def test_backoff_grows_is_capped_and_jittered_downwards() -> None:
    backoff = Backoff(initial_seconds=1.0, max_seconds=8.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(7)

    delays = [backoff.delay(failures, rng) for failures in range(6)]

    for failures, delay in enumerate(delays):
        base = min(8.0, 2.0**failures)
        assert base / 2 <= delay <= base
    assert Backoff(jitter=0.0).delay(0, rng) == Backoff().initial_seconds
