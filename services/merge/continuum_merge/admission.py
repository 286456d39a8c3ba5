"""Claiming the source trees and recording the cut the snapshot copies up to.

The claim (kind MERGE, holder `merge:<operation id>`) locks every source tree at once or none. While it
is held no turn runs in a source, so the cut read right after it (each tree's sessions and their last
message ids) is where the snapshot stops, however the sources change once it is released.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    generation (the snapshot refuses a session whose history was rewritten after the cut)."""

    root_session_id: str
    session_ids: tuple[str, ...]
    last_message_ids: dict[str, int]
    history_generations: dict[str, int] = field(default_factory=dict)


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
            {k: int(v) for k, v in item["lastMessageIds"].items()},
            {k: int(v) for k, v in item.get("historyGenerations", {}).items()},
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
    """Each source tree's sessions, last message ids and history generations, read while the claim is held."""
    cuts: list[TreeCut] = []
    for root in sources:
        session_ids = [session_id async for session_id in transcript.tree(user, root)]
        last = {session_id: await transcript.last_message_id(user, session_id) for session_id in session_ids}
        generations = {
            session_id: (await transcript.get_session(user, session_id)).history_generation
            for session_id in session_ids
        }
        cuts.append(TreeCut(root, tuple(session_ids), last, generations))
    return cuts
