"""Execution gate: all-or-nothing leases on session trees, keyed by each tree's root."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy import RowMapping, delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.transcript.v1 import resources_pb2 as pb
from continuum_runtime.database import insert_ignoring_conflicts
from continuum_transcript import sessions
from continuum_transcript.errors import ClaimNotFound, RunAmbiguous, RunNotFound, SessionAlreadyRunning, SessionBusy
from continuum_transcript.tables import execution_claims


@dataclass(frozen=True)
class HeldClaim:
    """A claim as its holder sees it."""

    claim_id: str
    kind: int
    holder: str
    session_ids: list[str]
    root_session_ids: list[str]
    expire_ms: int


async def acquire(
    connection: AsyncConnection,
    owner: str,
    session_ids: list[str],
    kind: int,
    holder: str,
    ttl_ms: int,
    now_ms: int,
) -> HeldClaim:
    """Lock every named session's tree at `now_ms`, or none (the caller's transaction rolls back
    on refusal).

    Roots are taken in id order so two acquirers of overlapping sets cannot deadlock. Each row is
    one conditional upsert: it inserts a free root or takes over an expired lease, and its row
    count says whether this caller now holds the tree.
    """
    roots = sorted({(await sessions.load(connection, owner, sid))["root_session_id"] for sid in session_ids})
    claim_id = uuid.uuid4().hex
    expire = now_ms + ttl_ms
    for root in roots:
        values = {
            "root_session_id": root,
            "claim_id": claim_id,
            "kind": kind,
            "holder": holder,
            "owner": owner,
            "session_ids": session_ids,
            "root_count": len(roots),
            "acquire_ms": now_ms,
            "expire_ms": expire,
        }
        statement = insert_ignoring_conflicts(connection, execution_claims).values(values)
        statement = statement.on_conflict_do_update(
            index_elements=[execution_claims.c.root_session_id],
            set_={k: v for k, v in values.items() if k != "root_session_id"},
            where=execution_claims.c.expire_ms <= now_ms,
        )
        if (await connection.execute(statement)).rowcount != 1:
            await _refuse(connection, root, kind)
    return HeldClaim(claim_id, kind, holder, session_ids, roots, expire)


async def _refuse(connection: AsyncConnection, root: str, kind: int) -> None:
    current = (
        (await connection.execute(select(execution_claims).where(execution_claims.c.root_session_id == root)))
        .mappings()
        .one()
    )
    holder_kind = pb.ClaimKind.Name(current["kind"])
    expire_time = Timestamp()
    expire_time.FromMilliseconds(current["expire_ms"])
    # The holder (a run id for a turn) lets compaction bind a queued manual compaction to that run;
    # the lease's end (RFC 3339) tells a caller when a crashed holder stops blocking the session.
    details = {
        "root_session_id": root,
        "holder_kind": holder_kind,
        "holder": current["holder"],
        "expire_time": expire_time.ToJsonString(),
    }
    if kind == pb.CLAIM_KIND_RUN:
        raise SessionAlreadyRunning("the session is already running or busy", metadata=details)
    raise SessionBusy(f"the session is held by a {holder_kind} claim", metadata=details)


async def _rows(connection: AsyncConnection, owner: str, claim_id: str) -> list[RowMapping]:
    query = select(execution_claims).where(execution_claims.c.claim_id == claim_id, execution_claims.c.owner == owner)
    return list((await connection.execute(query.order_by(execution_claims.c.root_session_id))).mappings())


async def renew(connection: AsyncConnection, owner: str, claim_id: str, ttl_ms: int, now_ms: int) -> HeldClaim:
    """Extend a claim that is live at `now_ms`. A claim that expired (even partly) is lost:
    CLAIM_NOT_HELD."""
    rows = await _rows(connection, owner, claim_id)
    renewed = await connection.execute(
        update(execution_claims)
        .where(
            execution_claims.c.claim_id == claim_id,
            execution_claims.c.owner == owner,
            execution_claims.c.expire_ms > now_ms,
        )
        .values(expire_ms=now_ms + ttl_ms)
    )
    if not rows or renewed.rowcount != rows[0]["root_count"]:
        raise ClaimNotFound("the claim expired or was released", metadata={"claim_id": claim_id})
    first = rows[0]
    return HeldClaim(
        claim_id,
        first["kind"],
        first["holder"],
        list(first["session_ids"]),
        [row["root_session_id"] for row in rows],
        now_ms + ttl_ms,
    )


async def release(connection: AsyncConnection, owner: str, claim_id: str) -> bool:
    """Free every tree the claim holds; False when nothing was held any more."""
    result = await connection.execute(
        delete(execution_claims).where(execution_claims.c.claim_id == claim_id, execution_claims.c.owner == owner)
    )
    return bool(result.rowcount)


async def release_holder(connection: AsyncConnection, owner: str | None, holder: str, kind: int) -> list[str]:
    """Free every claim of `kind` that `holder` took (of `owner`'s sessions, or of everyone's when
    None); the ids of the claims released."""
    condition = (execution_claims.c.holder == holder) & (execution_claims.c.kind == kind)
    if owner is not None:
        condition &= execution_claims.c.owner == owner
    deleted = await connection.execute(delete(execution_claims).where(condition).returning(execution_claims.c.claim_id))
    return sorted(set(deleted.scalars()))


async def run(connection: AsyncConnection, owner: str, run_id: str, now_ms: int) -> HeldClaim:
    """The live RUN claim `owner` took as `run_id`, over exactly one tree: RUN_NOT_FOUND when none is
    live at `now_ms` (ended, expired, another user's), RUN_AMBIGUOUS when the id names several claims
    or a claim over several trees."""
    query = select(execution_claims).where(
        execution_claims.c.holder == run_id,
        execution_claims.c.kind == pb.CLAIM_KIND_RUN,
        execution_claims.c.owner == owner,
        execution_claims.c.expire_ms > now_ms,
    )
    # Two rows are enough to tell one tree from several.
    rows = list((await connection.execute(query.limit(2))).mappings())
    if not rows:
        raise RunNotFound("no live run has this id", metadata={"run_id": run_id})
    if len(rows) > 1 or rows[0]["root_count"] != 1:
        raise RunAmbiguous("the run id does not name one session tree", metadata={"run_id": run_id})
    (row,) = rows
    return HeldClaim(
        row["claim_id"],
        row["kind"],
        row["holder"],
        list(row["session_ids"]),
        [row["root_session_id"]],
        row["expire_ms"],
    )
