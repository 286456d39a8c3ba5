"""Claiming the source trees and recording the cut the snapshot copies up to.

The claim (kind MERGE, holder `merge:<operation id>`) locks every source tree at once or none. While it
is held no turn runs in a source, so the cut read right after it (each tree's sessions and their last
message ids) is where the snapshot stops, however the sources change once it is released.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from continuum_merge.transcript_client import HeldClaim, TranscriptClient

HOLDER_PREFIX = "merge:"
# Re-claims after the tree set changed under a claim, before the operation pauses SOURCE_BUSY.
MAX_RECLAIMS = 2


def holder(operation_id: str) -> str:
    """The claim holder of an operation: the same for every run, so any run can release it."""
    return HOLDER_PREFIX + operation_id


@dataclass(frozen=True)
class TreeCut:
    """One source tree at admission: its sessions (root first), each one's last message id and history
    generation (a history rewritten after the cut is not copied)."""

    root_session_id: str
    session_ids: tuple[str, ...]
    last_message_ids: dict[str, int]
    history_generations: dict[str, int]


class TreeChanged(Exception):
    """The claim does not lock exactly the source roots (a source stopped being a root meanwhile)."""


def cut_json(cuts: Sequence[TreeCut]) -> str:
    """The stored form of a cut."""
    return json.dumps(
        [
            {
                "rootSessionId": cut.root_session_id,
                "sessionIds": list(cut.session_ids),
                "lastMessageIds": cut.last_message_ids,
                "historyGenerations": cut.history_generations,
            }
            for cut in cuts
        ],
        sort_keys=True,
    )


def parse_cut(stored: str) -> list[TreeCut]:
    """Read a stored cut."""
    return [
        TreeCut(
            item["rootSessionId"],
            tuple(item["sessionIds"]),
            {key: int(value) for key, value in item["lastMessageIds"].items()},
            {key: int(value) for key, value in item["historyGenerations"].items()},
        )
        for item in json.loads(stored)
    ]


async def claim_sources(
    transcript: TranscriptClient, user: str, operation_id: str, sources: Sequence[str], ttl_seconds: float
) -> HeldClaim:
    """Claim every source tree (all or nothing; `SourceBusy` when one is busy). When the claim does not
    lock exactly the sources as roots, release it and claim again, at most `MAX_RECLAIMS` times, then
    `TreeChanged` with nothing held."""
    expected = tuple(sorted(sources))
    for _ in range(MAX_RECLAIMS + 1):
        claim = await transcript.acquire_merge_claim(user, sources, holder(operation_id), ttl_seconds)
        if tuple(sorted(claim.root_session_ids)) == expected:
            return claim
        await transcript.release_claim(user, claim.claim_id)
    raise TreeChanged(operation_id)


async def read_cut(transcript: TranscriptClient, user: str, sources: Sequence[str]) -> list[TreeCut]:
    """Each source tree's sessions and last message ids, read while the claim is held."""
    cuts: list[TreeCut] = []
    for root in sources:
        sessions = [session async for session in transcript.tree(user, root)]
        last = {session.session_id: await transcript.last_message_id(user, session.session_id) for session in sessions}
        generations = {session.session_id: session.history_generation for session in sessions}
        cuts.append(TreeCut(root, tuple(session.session_id for session in sessions), last, generations))
    return cuts
