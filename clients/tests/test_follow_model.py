"""Model-based test of Follow v2 (hypothesis stateful, seeded): random appends (visible and
invisible), attempts, chunks, commits, cancels, retries, edits, publisher restarts, and slow or
reconnecting followers against the real server and the real Follow client.

At every watermark each follower's installed view must equal a read of the durable store at that
sequence plus the open attempts' prefixes; chunks are applied exactly once (prefix texts match);
generations never go back; and resyncs never cause model requests (only the runtime makes them).
Order counts as much as content: frames must arrive in the order they were published, so a follower
never has to resync because its store found a gap or a frame out of place (a swapped or dropped
frame converges after such a resync, and only this check notices), and within one stream the
committed messages arrive in id order.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from deadline_testing import eventually, within
from follow_testing import FAST, Live, assistant, settings, sqlite_url, texts, user
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_follow import FollowClient, Status
from continuum_follow.store import (
    CHAIN_GAP,
    CHUNK_GAP,
    GENERATION_CHANGED,
    INVALID_SETTLEMENT,
    OUT_OF_ORDER,
    UNKNOWN_ATTEMPT,
)
from continuum_runtime.channels import open_channel
from continuum_runtime.server import GrpcService
from continuum_transcript.server import start

T = TypeVar("T")
FOLLOWERS = 3
# Resyncs the client's store decides itself because the frames it got do not chain: never right.
ORDER_VIOLATIONS = frozenset(
    {CHAIN_GAP, CHUNK_GAP, UNKNOWN_ATTEMPT, INVALID_SETTLEMENT, GENERATION_CHANGED, OUT_OF_ORDER}
)
KEYS = ("a", "b")


@dataclass
class OpenAttempt:
    """The model of an open sampling attempt."""

    attempt: int
    chunks: list[str] = field(default_factory=list)


class Watched:
    """A follower whose consumption can be paused (a slow reader) and whose stream can drop."""

    def __init__(self, client: FollowClient) -> None:
        self.client = client
        self.gate = asyncio.Event()
        self.gate.set()
        self.highest_generation = 0
        # Frames that did not fit where they came: (the store's resync reason, the frame's kind).
        self.out_of_order: list[tuple[str, str]] = []
        # Committed message ids as batches brought them, since the last baseline: ascending.
        self.arrived: list[int] = []
        self.task = asyncio.get_running_loop().create_task(self._consume())

    async def _consume(self) -> None:
        async for update in self.client.updates():
            cursor = self.client.store.cursor
            if cursor is not None:
                assert cursor.stream_generation >= self.highest_generation, "a follower's stream_generation went back"
                self.highest_generation = cursor.stream_generation
            if update.outcome.status is Status.RESYNC and update.outcome.reason in ORDER_VIOLATIONS:
                self.out_of_order.append((update.outcome.reason, update.kind))
            frame = update.frame
            if frame is not None and update.outcome.status is Status.APPLIED:
                if update.kind == "snapshot_end":
                    self.arrived = []
                elif update.kind == "batch":
                    self.arrived += [m.message_id for m in frame.batch.messages if not m.deleted]
            await self.gate.wait()


class FollowModel(RuleBasedStateMachine):
    """The runtime publishes at random; followers must always converge on the durable truth."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.directory = Path(tempfile.mkdtemp(prefix="follow-model-"))
        self.attempts: dict[str, OpenAttempt] = {}
        self.model_requests = 0
        self.attempts_opened = 0
        self.port = 0
        self.service: GrpcService | None = None
        self.session_id = "model"
        self.followers: list[Watched] = []
        self.user_messages: list[int] = []
        self.counter = 0

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run the event loop world until `coroutine` is done."""
        return self.loop.run_until_complete(coroutine)

    async def _start(self) -> None:
        config = settings(
            self.directory,
            sqlite_url(self.directory),
            port=self.port,
            follow_queue_bound=16,
            follow_replay_frames=16,
            follow_heartbeat_seconds=0.05,
        )
        self.service = await start(config)
        self.port = self.service.port

    @initialize()
    def start_everything(self) -> None:
        async def begin() -> None:
            await self._start()
            self.channel = open_channel(f"127.0.0.1:{self.port}")
            self.live = Live(self.service, api_grpc.TranscriptServiceStub(self.channel))  # type: ignore[arg-type]
            await self.live.stub.CreateSession(
                api.CreateSessionRequest(session_id=self.session_id), metadata=self.live.metadata
            )
            self.followers = [Watched(self.live.follower(self.session_id, backoff=FAST)) for _ in range(FOLLOWERS)]

        self.run(begin())

    # The runtime

    @rule(visible=st.booleans())
    def append(self, visible: bool) -> None:
        self.counter += 1
        if visible:
            ids = self.run(self.live.append(self.session_id, user(f"u{self.counter}")))
            self.user_messages += ids
        else:
            self.run(self.live.publish(self.session_id))

    @rule(
        state=st.sampled_from([fpb.RUN_STATE_IDLE, fpb.RUN_STATE_RUNNING, fpb.RUN_STATE_WAITING]),
        terminal=st.booleans(),
        then=st.integers(0, 3),
    )
    def runtime_state(self, state: int, terminal: bool, then: int) -> None:
        operation = api.BatchOperation(runtime_state=fpb.RuntimeState(state=state))  # type: ignore[arg-type]

        async def publish() -> list[list[int]]:
            # The runtime publishes on without waiting for the batch to be durable: behind a terminal
            # batch the next `then` batches wait for its barrier and reach followers in one burst.
            first = asyncio.ensure_future(self.live.publish(self.session_id, operation, terminal=terminal))
            more = [self.live.append(self.session_id, user(f"then {index}")) for index in range(then)]
            appended = await asyncio.gather(*more)
            await first
            return appended

        for ids in self.run(publish()):
            self.user_messages += ids
        self.user_messages.sort()

    @rule(key=st.sampled_from(KEYS))
    def open_or_retry(self, key: str) -> None:
        self._open(key)

    def _open(self, key: str) -> OpenAttempt:
        current = self.attempts.get(key)
        attempt = current.attempt + 1 if current else 1
        self.run(self.live.open(self.session_id, key, attempt))
        opened = self.attempts[key] = OpenAttempt(attempt)
        # Opening an attempt is the only thing that stands for a model request.
        self.model_requests += 1
        self.attempts_opened += 1
        return opened

    @rule(
        key=st.sampled_from(KEYS), pieces=st.lists(st.text("abc xyz", min_size=1, max_size=4), min_size=1, max_size=3)
    )
    def chunks(self, key: str, pieces: list[str]) -> None:
        # Streaming is where frame order matters most: a key with no open attempt opens one first
        # (rather than discarding the step), so every example streams.
        current = self.attempts.get(key) or self._open(key)
        self.run(self.live.chunks(self.session_id, key, current.attempt, len(current.chunks), *pieces))
        current.chunks += pieces

    def _open_key(self, pick: int) -> str:
        # Drawn independently of which attempts are open, so replaying an example draws the same data.
        return sorted(self.attempts)[pick % len(self.attempts)]

    @precondition(lambda self: bool(self.attempts))
    @rule(pick=st.integers(0, 1), cancel=st.booleans())
    def finish(self, pick: int, cancel: bool) -> None:
        key = self._open_key(pick)
        current = self.attempts.pop(key)
        if cancel:
            self.run(self.live.cancel(self.session_id, key, current.attempt))
        else:
            self.run(self.live.commit(self.session_id, key, current.attempt, assistant("".join(current.chunks) or "-")))

    @precondition(lambda self: bool(self.user_messages))
    @rule(pick=st.integers(0, 1_000))
    def edit(self, pick: int) -> None:
        # Drawn independently of the server's ids, so replaying an example draws the same data.
        target = self.user_messages[pick % len(self.user_messages)]
        request = api.EditUserMessageRequest(
            session_id=self.session_id, message_id=target, content=[pb.ContentPart(text="edited")]
        )

        async def edit() -> None:
            # The call must be created inside the loop it runs on.
            await self.live.stub.EditUserMessage(request, metadata=self.live.metadata)

        self.run(edit())
        self.user_messages = [m for m in self.user_messages if m <= target]
        self.attempts.clear()

    @rule()
    def restart_publisher(self) -> None:
        async def restart() -> None:
            assert self.service is not None
            await self.service.stop(grace=0)
            await self._start()
            # The runtime waits for its connection to come back before publishing again.
            await within(self.channel.channel_ready(), 20, "the runtime's channel to reach the restarted server")

        self.run(restart())
        self.attempts.clear()

    # The followers

    @rule(index=st.integers(0, FOLLOWERS - 1))
    def disconnect(self, index: int) -> None:
        self.followers[index].client.disconnect()

    @rule(index=st.integers(0, FOLLOWERS - 1), slow=st.booleans())
    def pace(self, index: int, slow: bool) -> None:
        gate = self.followers[index].gate
        gate.clear() if slow else gate.set()

    # The invariants, checked at a watermark

    @invariant()
    def followers_converge_on_the_durable_store(self) -> None:
        if not self.followers:
            return
        self.run(self._check_watermark())

    async def _check_watermark(self) -> None:
        for follower in self.followers:
            follower.gate.set()
        probe = await self.live.stub.PublishBatch(
            api.PublishBatchRequest(session_id=self.session_id, wait_durable=True), metadata=self.live.metadata
        )
        target = (probe.stream_generation, probe.seq)

        def caught_up() -> bool:
            for follower in self.followers:
                if follower.task.done():
                    raise AssertionError(f"a follower stopped following: {follower.task.exception()!r}")
            return all(
                (cursor := f.client.store.cursor) is not None
                and (cursor.stream_generation, cursor.seq) >= target
                and f.client.store.live
                for f in self.followers
            )

        await eventually(
            caught_up,
            what=lambda: f"followers at {target}: {[f.client.store.cursor for f in self.followers]}",
            seconds=20,
        )
        durable = await self.live.server_messages(self.session_id)
        expected_prefixes = {key: "".join(a.chunks) for key, a in self.attempts.items()}
        for index, follower in enumerate(self.followers):
            assert not follower.out_of_order, f"follower {index} got frames out of order: {follower.out_of_order}"
            assert follower.arrived == sorted(set(follower.arrived)), f"follower {index}: {follower.arrived}"
            store = follower.client.store
            mine = store.ordered_messages()
            assert mine == durable[-len(mine) :] if mine else not durable
            assert len(mine) >= min(len(durable), 32), "the installed view lost part of the last page"
            prefixes = {key: prefix.text for key, prefix in store.prefixes.items()}
            assert prefixes == expected_prefixes, (prefixes, expected_prefixes)
            assert texts(store) == [m.content[0].text if m.content else "" for m in mine]
        # Resyncs and re-follows never stand for model requests.
        assert self.model_requests == self.attempts_opened

    def teardown(self) -> None:
        async def end() -> None:
            for follower in self.followers:
                follower.client.stop()
            await within(
                asyncio.gather(*(f.task for f in self.followers), return_exceptions=True),
                20,
                "the followers to stop",
            )
            await self.channel.close()
            if self.service is not None:
                await self.service.stop(grace=0)

        if self.followers:
            self.run(end())
        self.loop.close()
        shutil.rmtree(self.directory, ignore_errors=True)


# Many real servers and streams per example: allow for a loaded CI machine.
@pytest.mark.timeout(900)
def test_followers_always_converge_on_the_durable_store() -> None:
    run_state_machine_as_test(
        FollowModel,
        settings=hypothesis_settings(
            max_examples=10,
            stateful_step_count=20,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
