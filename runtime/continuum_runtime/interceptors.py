"""Server interceptors: service-credential check and the single domain-error → status mapping."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from grpc_status import rpc_status

from continuum_runtime.auth import bearer_matches
from continuum_runtime.cancellation import run_to_completion
from continuum_runtime.errors import ServiceError, Unauthenticated, internal_status

logger = logging.getLogger("continuum.rpc")

# Health and reflection answer without a credential so probes and tools work.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Handler: TypeAlias = grpc.RpcMethodHandler
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]


async def abort_with(context: grpc.aio.ServicerContext, error: ServiceError | None) -> None:
    """End the call with `error`'s status, or a bare INTERNAL for anything unexpected."""
    status = error.to_status() if error is not None else internal_status()
    converted = rpc_status.to_status(status)
    await context.abort(converted.code, converted.details, trailing_metadata=converted.trailing_metadata)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not present the service credential."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        method: str = details.method
        if method.startswith(OPEN_SERVICES) or bearer_matches(details.invocation_metadata, self._token):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        logger.warning("rejected call without service credential", extra={"method": method})
        refusal = Unauthenticated("a valid service credential is required")
        return _replace_behaviour(handler, refusal)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns `ServiceError` into its status and anything else into a bare INTERNAL.

    With `complete_cancelled_calls`, a unary call whose client went away still runs to its end (its
    answer dropped): for a service whose unary calls are short database writes (transcript), where a
    handler stopped between two statements would leave a transaction open. Services whose unary calls
    do long work (a model call, a package read) leave it off, so a cancel stops that work.
    """

    def __init__(self, *, complete_cancelled_calls: bool = False) -> None:
        self._complete = complete_cancelled_calls

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        return _wrap(handler, details.method, complete=self._complete)


def _log_failure(method: str, error: BaseException) -> ServiceError | None:
    if isinstance(error, ServiceError):
        # Nested: a metadata key must never collide with a LogRecord attribute.
        logger.info("rpc refused", extra={"method": method, "reason": error.reason, "ids": error.metadata})
        return error
    logger.error("rpc failed", extra={"method": method}, exc_info=error)
    return None


def _wrap(handler: Handler, method: str, *, complete: bool) -> Handler:
    if handler.unary_unary is not None or handler.stream_unary is not None:
        inner = handler.unary_unary or handler.stream_unary
        # A request stream belongs to its call: only a single-request call runs on once cancelled.
        complete = complete and handler.unary_unary is not None

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if complete:
                    return await run_to_completion(
                        inner(request, context), expected=(ServiceError, grpc.aio.AbortError)
                    )
                return await inner(request, context)
            except Exception as error:
                if isinstance(error, grpc.aio.AbortError):
                    raise
                await abort_with(context, _log_failure(method, error))

        return _rebuild(handler, unary)

    inner_stream = handler.unary_stream or handler.stream_stream

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in inner_stream(request, context):
                yield response
        except Exception as error:
            if isinstance(error, grpc.aio.AbortError):
                raise
            await abort_with(context, _log_failure(method, error))

    return _rebuild(handler, streaming)


def _replace_behaviour(handler: Handler, error: ServiceError) -> Handler:
    if handler.unary_unary is not None or handler.stream_unary is not None:

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await abort_with(context, error)

        return _rebuild(handler, refuse)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await abort_with(context, error)
        yield None  # pragma: no cover - abort raises

    return _rebuild(handler, refuse_stream)


def _rebuild(handler: Handler, behaviour: Callable[..., Any]) -> Handler:
    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    factory = factories[(handler.request_streaming, handler.response_streaming)]
    return factory(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
