"""gyre.rpc: a real grpc.aio server on a free port; the error boundary's status codes for each
method shape (unary, server-streaming, client-streaming)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gyre import errors, rpc

RAISES: dict[bytes, Exception] = {
    b"invalid": errors.InvalidArgument("reward is NaN"),
    b"missing": errors.NotFound("no execution e9"),
    b"stale": errors.StaleEpoch("d0", given=1, current=2),
    b"conflict": errors.Conflict("device not granted"),
    b"denied": errors.PermissionDenied("not the registered trainer"),
    b"large": errors.PayloadTooLarge("too big"),
    b"down": errors.Unavailable("engine gone"),
    b"bug": KeyError("oops"),
}
EXPECTED = {
    b"invalid": grpc.StatusCode.INVALID_ARGUMENT,
    b"missing": grpc.StatusCode.NOT_FOUND,
    b"stale": grpc.StatusCode.FAILED_PRECONDITION,
    b"conflict": grpc.StatusCode.FAILED_PRECONDITION,
    b"denied": grpc.StatusCode.PERMISSION_DENIED,
    b"large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    b"down": grpc.StatusCode.UNAVAILABLE,
    b"bug": grpc.StatusCode.INTERNAL,
}


class ToyServicer:
    """Raises the error its request names; otherwise echoes."""

    @rpc.error_boundary
    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request in RAISES:
            raise RAISES[request]
        return request

    @rpc.error_boundary
    async def server_stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        if request in RAISES:
            raise RAISES[request]
        yield request

    @rpc.error_boundary
    async def client_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        async for request in requests:
            if request in RAISES:
                raise RAISES[request]
        return b"done"


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server, port = rpc.create_server(port=0)
    servicer = ToyServicer()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(servicer.server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(servicer.client_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("toy.Toy", handlers),))
    health = rpc.add_health(server)
    await server.start()
    await rpc.set_serving(health, True)
    yield f"127.0.0.1:{port}"
    await rpc.stop(server, health, grace_s=1.0)


@pytest.mark.parametrize("request_bytes", list(EXPECTED))
async def test_error_boundary_maps_each_domain_error_to_its_status_in_unary_calls(
    address: str, request_bytes: bytes
) -> None:
    async with rpc.channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ch.unary_unary("/toy.Toy/Unary")(request_bytes)
    assert info.value.code() == EXPECTED[request_bytes]


async def test_error_boundary_keeps_the_domain_message_and_hides_nothing_useful(address: str) -> None:
    async with rpc.channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await ch.unary_unary("/toy.Toy/Unary")(b"stale")
        with pytest.raises(grpc.aio.AioRpcError) as bug:
            await ch.unary_unary("/toy.Toy/Unary")(b"bug")
        assert await ch.unary_unary("/toy.Toy/Unary")(b"ok") == b"ok"
    assert "current epoch is 2" in (stale.value.details() or "")
    assert "KeyError" in (bug.value.details() or "")


async def test_error_boundary_maps_errors_in_server_streaming_calls_after_items_were_sent(
    address: str,
) -> None:
    async with rpc.channel(address) as ch:
        call = ch.unary_stream("/toy.Toy/ServerStream")(b"missing")
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for item in call:
                received.append(item)
    assert received == [b"first"]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_error_boundary_maps_errors_in_client_streaming_calls(address: str) -> None:
    async def requests() -> AsyncIterator[bytes]:
        yield b"fine"
        yield b"invalid"

    async with rpc.channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ch.stream_unary("/toy.Toy/ClientStream")(requests())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_health_reports_serving_on_a_server_bound_to_a_free_port(address: str) -> None:
    async with rpc.channel(address) as ch:
        response = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_error_boundary_refuses_a_sync_method() -> None:
    def sync_method(request: bytes, context: object) -> bytes:
        return request

    with pytest.raises(TypeError, match="async"):
        rpc.error_boundary(sync_method)


@pytest.fixture
async def secured_address() -> AsyncIterator[str]:
    """The toy servicer behind a bearer token ("s3cret"), health open."""
    server, port = rpc.create_server(port=0, token="s3cret")
    servicer = ToyServicer()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(servicer.server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(servicer.client_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("toy.Toy", handlers),))
    health = rpc.add_health(server)
    await server.start()
    await rpc.set_serving(health, True)
    yield f"127.0.0.1:{port}"
    await rpc.stop(server, health, grace_s=1.0)


@pytest.mark.parametrize("token", ["", "wrong"])
async def test_a_call_without_the_right_token_is_unauthenticated_in_every_method_shape(
    secured_address: str, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(rpc.TOKEN_ENV, "s3cret")  # "" means no token even where the process has one

    async def requests() -> AsyncIterator[bytes]:
        yield b"fine"

    async with rpc.channel(secured_address, token=token) as ch:
        calls = [
            ch.unary_unary("/toy.Toy/Unary")(b"ok"),
            ch.stream_unary("/toy.Toy/ClientStream")(requests()),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            async for _ in ch.unary_stream("/toy.Toy/ServerStream")(b"ok"):
                pass
        assert streamed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open for probes.
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_call_with_the_token_passes_in_every_method_shape(secured_address: str) -> None:
    async def requests() -> AsyncIterator[bytes]:
        yield b"fine"

    async with rpc.channel(secured_address, token="s3cret") as ch:
        assert await ch.unary_unary("/toy.Toy/Unary")(b"ok") == b"ok"
        assert await ch.stream_unary("/toy.Toy/ClientStream")(requests()) == b"done"
        got = [item async for item in ch.unary_stream("/toy.Toy/ServerStream")(b"ok")]
        assert got == [b"first", b"ok"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ch.unary_unary("/toy.Toy/Unary")(b"missing")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # the error boundary still answers


async def test_the_channel_takes_the_process_token_from_the_environment(
    secured_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(rpc.TOKEN_ENV, "s3cret")
    async with rpc.channel(secured_address) as ch:
        assert await ch.unary_unary("/toy.Toy/Unary")(b"ok") == b"ok"
