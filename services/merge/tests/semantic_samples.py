"""The labelled semantic sample set of seed 000 §9 (small, synthetic, in the repo; importable as
`semantic_samples`).

Each sample is a few source sessions and the facts a handoff of them must carry, labelled with the
section and status a faithful extraction files them under and the words that show the fact was kept.
The structural run (offline provider) checks sections, statuses and that every fact's original text is
reachable through evidence; the evaluation run (an OpenAI-compatible endpoint) reports which facts the
details and the brief carry. The two kinds of result are reported apart: the first is not a semantic
acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SAMPLES", "Fact", "Message", "Sample"]


@dataclass(frozen=True)
class Message:
    """One message of a source session (record ids count per session from 1)."""

    session: str
    role: str
    text: str


@dataclass(frozen=True)
class Fact:
    """A fact the handoff must carry: where its original is, how it is filed, which words show it."""

    name: str
    # A phrase of the original message the fact comes from (its evidence must resolve to it).
    quote: str
    section: str
    status: str
    # Words (any case) an item about the fact contains, for the evaluation run.
    keywords: tuple[str, ...]


@dataclass(frozen=True)
class Sample:
    name: str
    messages: tuple[Message, ...]
    facts: tuple[Fact, ...]
    # Text that must never appear in any item (e.g. an attachment the model could not read).
    never: tuple[str, ...] = ()
    # (session, record index in `messages`) pairs that are a second version of an earlier record.
    versions: tuple[tuple[int, int], ...] = ()


CONTINUATION = Sample(
    name="continuation: A renamed name to displayName and validated it; B's front end still reads name",
    messages=(
        Message("A", "user", "Rename the response field name to displayName in api/users.py; keep the old tests."),
        Message("A", "assistant", "Changed api/users.py: the users response field name is now displayName."),
        Message("A", "tool", "$ pytest tests/test_users.py -q\n3 passed in 0.41s"),
        Message("B", "user", "Build the profile header in web/Header.tsx from the users API."),
        Message("B", "assistant", "web/Header.tsx shows user.name as the profile title."),
        Message("B", "assistant", "TODO: integrate the header with the users API and retest; integration is open."),
    ),
    facts=(
        Fact("A changed the field", "field name is now displayName", "changes", "completed", ("displayName",)),
        Fact("A's validation", "3 passed", "validation_failures", "completed", ("pytest", "passed")),
        Fact("B reads name", "shows user.name", "changes", "recorded", ("name", "Header")),
        Fact("open integration", "TODO: integrate", "conflicts_todos", "pending", ("integrat",)),
    ),
)

SAMPLES: tuple[Sample, ...] = (
    CONTINUATION,
    Sample(
        name="a user constraint",
        messages=(
            Message("A", "user", "Important: do not change the public gRPC contract; only internal code may move."),
            Message("A", "assistant", "Understood, the contract stays as it is."),
        ),
        facts=(
            Fact("the constraint", "do not change the public gRPC", "goals_constraints", "recorded", ("contract",)),
        ),
    ),
    Sample(
        name="a failing subtask tail",
        messages=(
            Message("A", "user", "Run the migration tests in the subtask."),
            Message("A", "tool", "$ make test-migrations\nFAILED tests/test_migrate.py::test_upgrade - KeyError: 'v3'"),
        ),
        facts=(Fact("the failure", "KeyError: 'v3'", "validation_failures", "failed", ("fail",)),),
    ),
    Sample(
        name="two conflicting sides",
        messages=(
            Message("A", "assistant", "Decided: the cache TTL is 60 seconds, set in config/cache.yaml."),
            Message("B", "assistant", "Decided: the cache TTL is 300 seconds, set in config/cache.yaml."),
        ),
        facts=(
            Fact("A's side", "TTL is 60 seconds", "conflicts_todos", "conflict", ("60",)),
            Fact("B's side", "TTL is 300 seconds", "conflicts_todos", "conflict", ("300",)),
        ),
    ),
    Sample(
        name="an unverified claim",
        messages=(Message("A", "assistant", "The login bug should be fixed now, I did not run anything."),),
        facts=(Fact("the claim", "should be fixed now", "validation_failures", "unverified", ("login",)),),
    ),
    Sample(
        name="two versions of one record",
        messages=(
            Message("A", "assistant", "Plan v1: ship the export feature on Monday."),
            Message("A", "assistant", "Plan v2: ship the export feature on Friday after review."),
        ),
        facts=(
            Fact("first version", "on Monday", "artifacts", "recorded", ("Monday",)),
            Fact("second version", "on Friday", "artifacts", "recorded", ("Friday",)),
        ),
        versions=((0, 1),),
    ),
    Sample(
        name="a repeated merge (a source that is an earlier merge's target)",
        messages=(
            Message("C", "assistant", "Merged earlier: A and B agreed the API returns ISO dates."),
            Message("C", "user", "Now add pagination to GET /items."),
        ),
        facts=(
            Fact("earlier agreement", "ISO dates", "changes", "recorded", ("ISO",)),
            Fact("new goal", "add pagination", "goals_constraints", "recorded", ("pagination",)),
        ),
    ),
    Sample(
        name="an unknown attachment",
        messages=(Message("A", "user", "See the attached design.bin for the layout."),),
        facts=(Fact("the attachment is referenced", "attached design.bin", "artifacts", "unknown", ("design",)),),
        never=("SECRET-ATTACHMENT-BYTES",),
    ),
)
