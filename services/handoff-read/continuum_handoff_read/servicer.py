"""HandoffReadService handlers: the acting user, input checks, the binding, then the answer.

Handlers raise HandoffReadError; the runtime's interceptor maps it to a status. None sets codes.
Everything a call does after its input checks (transcript, merge, the package) shares one deadline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeAlias

import grpc

from continuum.handoff_read.v1 import handoff_read_service_pb2 as api
from continuum.handoff_read.v1 import handoff_read_service_pb2_grpc as api_grpc
from continuum_handoff_read import binding, tool
from continuum_handoff_read.binding import Binder
from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import BadRequest, BudgetExceeded
from continuum_handoff_read.files import IntactFiles
from continuum_handoff_read.reference import ReferenceBuilder
from continuum_handoff_read.scanners import Scanners
from continuum_runtime.auth import acting_user
from continuum_runtime.clock import Clock

Context: TypeAlias = grpc.aio.ServicerContext
logger = logging.getLogger("continuum.handoff_read")

# The tool's arguments as the model wrote them, at most (the contract's limit).
MAX_ARGUMENTS_BYTES = 8 * 1024
# Run ids are the holders of RUN claims; transcript allows this many characters.
MAX_RUN_ID_CHARS = 256
# A reference entry's largest budget: well above the 2048 a request's entry gets, and a bound on the answer.
MAX_REFERENCE_TOKENS = 32 * 1024


class HandoffReadServicer(api_grpc.HandoffReadServiceServicer):
    """The gRPC face of handoff-read."""

    def __init__(
        self,
        binder: Binder,
        references: ReferenceBuilder,
        cursor_key: bytes,
        deadline_seconds: float,
        clock: Clock,
        scanners: Scanners | None = None,
    ) -> None:
        self._binder = binder
        self._references = references
        # Authenticates the package reader's cursors.
        self._cursor_key = cursor_key
        self._deadline_seconds = deadline_seconds
        self._clock = clock
        # Manifests already hashed whole, shared by every call of this process (re-hashed once changed).
        self._intact = IntactFiles()
        # The scanner processes searches borrow (none: every search scans in its call's thread).
        self._scanners = scanners

    async def GetHandoffReference(
        self, request: api.GetHandoffReferenceRequest, context: Context
    ) -> api.GetHandoffReferenceResponse:
        user = acting_user(context)
        session_id = binding.session_id(request.session_id, "session_id")
        operation_id = binding.operation_id(request.merge_operation_id, "merge_operation_id")
        if not 1 <= request.max_tokens <= MAX_REFERENCE_TOKENS:
            raise BadRequest("max_tokens", f"must be between 1 and {MAX_REFERENCE_TOKENS}")
        try:
            async with asyncio.timeout(self._deadline_seconds):
                bound = await self._binder.for_session(user, session_id, operation_id)
                return await self._references.response(bound, request.max_tokens)
        except TimeoutError as error:
            raise BudgetExceeded("the reference entry could not be built within the call's deadline") from error

    async def ExecuteHandoffRead(
        self, request: api.ExecuteHandoffReadRequest, context: Context
    ) -> api.ExecuteHandoffReadResponse:
        user = acting_user(context)
        if not request.run_id or len(request.run_id) > MAX_RUN_ID_CHARS:
            raise BadRequest("run_id", f"must name the run (1-{MAX_RUN_ID_CHARS} characters)")
        if not request.arguments_json:
            raise BadRequest("arguments_json", "must hold the tool call's arguments")
        if len(request.arguments_json.encode()) > MAX_ARGUMENTS_BYTES:
            raise BadRequest("arguments_json", f"must be at most {MAX_ARGUMENTS_BYTES} bytes")
        # One deadline for the whole call: the binding's checks and the package reads spend it together.
        deadline = Deadline(self._clock, self._deadline_seconds)
        try:
            async with asyncio.timeout(deadline.remaining()):
                bound = await self._binder.for_run(user, request.run_id)
        except TimeoutError as error:
            raise BudgetExceeded("the binding could not be verified within the call's deadline") from error
        try:
            # Blocking file reads in a worker thread; the reader checks the deadline between buffers
            # and files, and stops at its next check once this call is cancelled.
            result = await asyncio.to_thread(
                tool.execute,
                bound.package_dir,
                bound.package_version,
                request.arguments_json,
                cursor_key=self._cursor_key,
                deadline=deadline,
                intact=self._intact,
                scanners=self._scanners,
            )
        except asyncio.CancelledError:
            deadline.cancel()
            raise
        response = api.ExecuteHandoffReadResponse(
            entries=[api.HandoffReadEntry(ref=e.ref, kind=e.kind, text=e.text) for e in result.entries],
            complete=result.complete,
            next_cursor=result.next_cursor,
            warning=result.warning,
            package_version=bound.package_version,
        )
        if result.image is not None:
            response.image.media_type = result.image.media_type
            response.image.data = result.image.data
        return response
