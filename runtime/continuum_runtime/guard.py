"""Every call to a service's methods passes one guard: the service-credential check and the single
domain-error → status mapping.

The guard wraps each method's handler once, when the servicer is registered, rather than in server
interceptors: grpc.aio runs an interceptor chain as coroutines for every call, and the error mapping
had to rebuild a method handler per call. Health and reflection are registered on the server
itself, unguarded, so probes and tools work without a credential.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeAlias

import grpc
from grpc_status import rpc_status

from continuum_runtime.auth import bearer_matches
from continuum_runtime.cancellation import run_to_completion
from continuum_runtime.errors import ServiceError, Unauthenticated, internal_status

logger = logging.getLogger("continuum.rpc")

Handler: TypeAlias = grpc.RpcMethodHandler


async def abort_with(context: grpc.aio.ServicerContext, error: ServiceError | None) -> None:
    """End the call with `error`'s status, or a bare INTERNAL for anything unexpected."""
    status = error.to_status() if error is not None else internal_status()
    converted = rpc_status.to_status(status)
    await context.abort(converted.code, converted.details, trailing_metadata=converted.trailing_metadata)


class GuardedServer:
    """What a service registers its servicers on (the generated `add_*_to_server` functions): the
    server, with every method guarded.

    The guard refuses a call that does not present the service credential, turns `ServiceError`
    into its status and anything else into a bare INTERNAL. With `complete_cancelled_calls`, a unary
    call whose client went away still runs to its end (its answer dropped): for a service whose unary
    calls are short database writes (transcript), where a handler stopped between two statements
    would leave a transaction open. Services whose unary calls do long work (a model call, a package
    read) leave it off, so a cancel stops that work.
    """

    def __init__(self, server: grpc.aio.Server, token: str, *, complete_cancelled_calls: bool = False) -> None:
        self._server = server
        self._token = token
        self._complete = complete_cancelled_calls
        self._services: set[str] = set()

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Add generic handlers whose methods are guarded."""
        for handler in handlers:
            if isinstance(handler, grpc.ServiceRpcHandler):
                self._services.add(handler.service_name())
        self._server.add_generic_rpc_handlers([_GuardedHandler(handler, self._guard) for handler in handlers])

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        """A service's methods by name, served through a generic handler.

        grpc.aio keeps one pending request per registered method and waits on all of them with
        `asyncio.wait` for every call: with transcript's 29 methods that was ~3% of the append
        path's instructions. The generated code adds the same handlers as a generic handler first,
        so a service already added that way is not added again.
        """
        if service not in self._services:
            self.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, handlers)])

    def _guard(self, handler: Handler, method: str) -> Handler:
        token, complete = self._token, self._complete
        if handler.unary_unary is not None or handler.stream_unary is not None:
            inner = handler.unary_unary or handler.stream_unary
            # A request stream belongs to its call: only a single-request call runs on once cancelled.
            complete = complete and handler.unary_unary is not None

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if not bearer_matches(context.invocation_metadata(), token):
                    await _refuse(context, method)
                try:
                    if complete:
                        return await run_to_completion(inner(request, context), expected=(grpc.aio.AbortError,))
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as error:
                    await abort_with(context, _log_failure(method, error))

            return _rebuild(handler, unary)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if not bearer_matches(context.invocation_metadata(), token):
                await _refuse(context, method)
            try:
                async for response in inner_stream(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await abort_with(context, _log_failure(method, error))

        return _rebuild(handler, streaming)


class _GuardedHandler(grpc.GenericRpcHandler):
    """A generic handler whose method handlers are guarded, each wrapped once on first use."""

    def __init__(self, inner: grpc.GenericRpcHandler, guard: Callable[[Handler, str], Handler]) -> None:
        self._inner = inner
        self._guard = guard
        # Only methods the inner handler serves are kept: bounded by the service's methods.
        self._guarded: dict[str, Handler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method: str = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is None:
            found = self._inner.service(handler_call_details)
            if found is None:
                return None
            guarded = self._guarded[method] = self._guard(found, method)
        return guarded


async def _refuse(context: grpc.aio.ServicerContext, method: str) -> None:
    logger.warning("rejected call without service credential", extra={"method": method})
    await abort_with(context, Unauthenticated("a valid service credential is required"))


def _log_failure(method: str, error: BaseException) -> ServiceError | None:
    if isinstance(error, ServiceError):
        # Nested: a metadata key must never collide with a LogRecord attribute.
        logger.info("rpc refused", extra={"method": method, "reason": error.reason, "ids": error.metadata})
        return error
    logger.error("rpc failed", extra={"method": method}, exc_info=error)
    return None


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
