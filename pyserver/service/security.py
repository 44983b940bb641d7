"""Transport security and access control: TLS / mutual TLS credentials, bearer-token auth, and
a guard that turns undecodable request frames into INVALID_ARGUMENT instead of INTERNAL.

Auth is an aio server interceptor: it sees the method name and metadata before the servicer
runs, so a refused call never reaches validation, the queue or the engine. Health checks are
exempt (load balancers and kubelets probe without credentials); everything else, reflection
included, needs a token when auth is on.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

# grpc's stubs type handlers for the sync server; the aio server hands us the same objects.
Handler = Any
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_GENERATION_PREFIX = "/streambatch.v1.Generation/"
TOKENS_ENV = "STREAMBATCH_AUTH_TOKENS"


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None
) -> grpc.ServerCredentials | None:
    """TLS when a certificate and key are given; mutual TLS (client certificate required and
    checked against client_ca) when client_ca is given too. None: plaintext."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not cert or not key:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    root = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=root, require_client_auth=root is not None
    )


def load_tokens(token_file: str | None) -> tuple[bytes, ...]:
    """Accepted bearer tokens: one per line in token_file (blank lines and # comments skipped),
    plus any in $STREAMBATCH_AUTH_TOKENS (comma-separated). Empty: auth is off."""
    tokens: list[str] = []
    if token_file:
        for line in Path(token_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.append(line)
    tokens += [t.strip() for t in os.environ.get(TOKENS_ENV, "").split(",") if t.strip()]
    return tuple(t.encode() for t in tokens)


class _Guard(grpc.aio.ServerInterceptor):
    """Base for interceptors that replace a method's behaviour but keep its shape."""

    @staticmethod
    def _refuse(handler: Handler, code: grpc.StatusCode, message: str) -> Any:
        async def unary_response(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(code, message)

        async def stream_response(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator; abort raises first

        ser = handler.response_serializer
        de = handler.request_deserializer
        if handler.stream_stream is not None:  # e.g. reflection
            return grpc.stream_stream_rpc_method_handler(
                stream_response, request_deserializer=de, response_serializer=ser
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                unary_response, request_deserializer=de, response_serializer=ser
            )
        return _same_shape(handler, unary_response, stream_response)


class BearerAuthInterceptor(_Guard):
    """`authorization: Bearer <token>` on every call but health checks; UNAUTHENTICATED
    otherwise. Every configured token is compared in constant time, so timing tells nothing
    about which token, or how much of one, matched."""

    def __init__(self, tokens: Iterable[bytes]) -> None:
        self._tokens = tuple(tokens)
        if not self._tokens:
            raise ValueError("bearer auth needs at least one token")

    def _authorized(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == "authorization":
                raw = value.encode() if isinstance(value, str) else value
                if raw[:7].lower() == b"bearer ":
                    presented = raw[7:].strip()
        ok = False
        for token in self._tokens:
            ok |= hmac.compare_digest(presented, token)
        return ok and bool(presented)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(_HEALTH_PREFIX):
            return handler
        if self._authorized(details.invocation_metadata):
            return handler
        return self._refuse(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            "authorization: send metadata 'authorization: Bearer <token>' with a valid token",
        )


class _Undecodable:
    """Stands in for a request whose bytes were not a valid message."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class MalformedFrameInterceptor(_Guard):
    """gRPC answers INTERNAL when a request frame fails to parse; that is the client's error,
    so it becomes INVALID_ARGUMENT here and the servicer never sees the frame."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        # Only our own service: health's Watch writes through the context instead of yielding,
        # and wrapping it as a generator broke client-side health checking.
        if not (details.method or "").startswith(_GENERATION_PREFIX):
            return handler
        if handler.request_streaming:
            return handler  # none of our methods stream requests; leave others as they are
        parse = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # DecodeError and friends: the bytes are the problem
                return _Undecodable(exc)

        inner_unary = handler.unary_unary
        inner_stream = handler.unary_stream
        message = "request: the bytes are not a valid message for this method"

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            assert inner_unary is not None
            return await inner_unary(request, context)

        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            assert inner_stream is not None
            async for msg in inner_stream(request, context):
                yield msg

        return _same_shape(handler, unary, stream, request_deserializer=tolerant)


def _same_shape(
    handler: Handler,
    unary: Callable[..., Any],
    stream: Callable[..., Any],
    *,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    deserializer = request_deserializer or handler.request_deserializer
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler  # client-streaming methods: not served here


__all__ = [
    "TOKENS_ENV",
    "BearerAuthInterceptor",
    "MalformedFrameInterceptor",
    "load_tokens",
    "server_credentials",
]
