"""Every method registered through GuardedServer needs the service credential and maps its errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from continuum_runtime.auth import call_metadata
from continuum_runtime.errors import InvalidArgument, error_details
from continuum_runtime.guard import GuardedServer

TOKEN = "guard-test-token"


async def ok(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"ok:" + request


async def refuses(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise InvalidArgument("name", "is wrong")


async def fails(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise ValueError("a programming error")


async def streams(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    raise InvalidArgument("cursor", "is wrong")


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    guarded = GuardedServer(server, TOKEN)
    handlers = {
        "Ok": grpc.unary_unary_rpc_method_handler(ok),
        "Refuses": grpc.unary_unary_rpc_method_handler(refuses),
        "Fails": grpc.unary_unary_rpc_method_handler(fails),
        "Streams": grpc.unary_stream_rpc_method_handler(streams),
    }
    # What the generated add_*_to_server functions do: a generic handler, then the same methods by name.
    guarded.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Generated", handlers)])
    guarded.add_registered_method_handlers("test.Generated", handlers)
    # A service added by name only is served (and guarded) all the same.
    guarded.add_registered_method_handlers("test.Named", {"Ok": grpc.unary_unary_rpc_method_handler(ok)})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as opened:
            yield opened
    finally:
        await server.stop(None)


async def failure(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    return raised.value


@pytest.mark.parametrize("service", ["test.Generated", "test.Named"])
async def test_a_call_without_the_service_credential_is_refused(channel: grpc.aio.Channel, service: str) -> None:
    method = channel.unary_unary(f"/{service}/Ok")
    assert await method(b"x", metadata=call_metadata(TOKEN)) == b"ok:x"
    for metadata in [(), call_metadata("wrong")]:
        refused = await failure(method(b"x", metadata=metadata))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_details(refused).reason == "UNAUTHENTICATED"


async def test_a_stream_without_the_service_credential_is_refused(channel: grpc.aio.Channel) -> None:
    call = channel.unary_stream("/test.Generated/Streams")(b"x", metadata=call_metadata("wrong"))
    refused = await failure(call.read())
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_service_errors_become_their_status_and_anything_else_a_bare_internal(
    channel: grpc.aio.Channel,
) -> None:
    metadata = call_metadata(TOKEN)
    refused = await failure(channel.unary_unary("/test.Generated/Refuses")(b"x", metadata=metadata))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(refused).violations[0].field == "name"
    failed = await failure(channel.unary_unary("/test.Generated/Fails")(b"x", metadata=metadata))
    assert failed.code() == grpc.StatusCode.INTERNAL
    assert failed.details() == "internal error"
    call = channel.unary_stream("/test.Generated/Streams")(b"x", metadata=metadata)
    assert await call.read() == b"first"
    ended = await failure(call.read())
    assert ended.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(ended).violations[0].field == "cursor"


async def test_an_unknown_method_is_unimplemented(channel: grpc.aio.Channel) -> None:
    unknown = await failure(channel.unary_unary("/test.Generated/Missing")(b"x", metadata=call_metadata(TOKEN)))
    assert unknown.code() == grpc.StatusCode.UNIMPLEMENTED
