"""TLS, mutual TLS, bearer-token auth, reflection off, and no prompt or completion text in the
logs: one `streambatch serve` process with all of it on, reached over real TLS on loopback."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from streambatch.v1 import generation_pb2_grpc as pb_grpc

from integration.certs import make_pki
from integration.helpers import free_port, health_status, request, spawn_server, stop, wait_serving

pytestmark = pytest.mark.engine

TOKEN = "s3cret-token-for-tests"
SECRET_PROMPT = "Repeat exactly: zebra quartz marmalade 4417"


def _channel(target: str, pki, cert=None, key=None):  # type: ignore[no-untyped-def]
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    return grpc.secure_channel(target, creds)


def _code(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_mtls_bearer_auth_no_reflection_and_clean_logs(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text("# one token per line\nother-token\n" + TOKEN + "\n")
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = spawn_server(
        port,
        log,
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
        "--auth-token-file",
        str(tokens),
        "--reflection",
        "false",
        "--log-level",
        "DEBUG",
    )
    try:
        good = _channel(target, pki, pki.client_cert, pki.client_key)
        # Health is exempt from auth: the wait needs no token.
        wait_serving(good, proc, log)
        s = pb_grpc.GenerationStub(good)
        call = lambda **kw: s.Complete(request("Say hi.", max_tokens=2), timeout=60, **kw)  # noqa: E731

        # Transport: plaintext, TLS without a client certificate, and a certificate from
        # another CA are all refused before any RPC runs.
        plain = pb_grpc.GenerationStub(grpc.insecure_channel(target))
        assert _code(lambda: plain.Complete(request(max_tokens=1), timeout=10)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        no_cert = pb_grpc.GenerationStub(_channel(target, pki))
        assert _code(lambda: no_cert.Complete(request(max_tokens=1), timeout=10)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        rogue = pb_grpc.GenerationStub(_channel(target, pki, pki.rogue_cert, pki.rogue_key))
        assert _code(lambda: rogue.Complete(request(max_tokens=1), timeout=10)) == (
            grpc.StatusCode.UNAVAILABLE
        )

        # Auth: missing, malformed and wrong tokens are UNAUTHENTICATED, on both RPC shapes.
        assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: call(metadata=(("authorization", TOKEN),))) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        assert _code(lambda: call(metadata=(("authorization", "Bearer " + TOKEN[:-1]),))) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        stream = s.Generate(request(max_tokens=2), timeout=60)
        assert _code(lambda: list(stream)) == grpc.StatusCode.UNAUTHENTICATED
        assert health_status(good) == health_pb2.HealthCheckResponse.SERVING

        # The right token over mTLS works, for streaming too.
        auth = (("authorization", "Bearer " + TOKEN),)
        secret = s.Complete(request(SECRET_PROMPT, max_tokens=12), timeout=60, metadata=auth)
        assert secret.tokens
        streamed = list(s.Generate(request("Count to three.", max_tokens=4), metadata=auth))
        assert streamed[-1].usage.completion_tokens == 4

        # Reflection is off: grpcurl's first call is UNIMPLEMENTED even with a token.
        refl = reflection_pb2_grpc.ServerReflectionStub(good)
        ask = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        assert _code(lambda: list(refl.ServerReflectionInfo(ask, metadata=auth, timeout=10))) == (
            grpc.StatusCode.UNIMPLEMENTED
        )
    finally:
        stop(proc)
    # Neither the prompt nor the completion appears in a DEBUG-level log of the whole run.
    text = log.read_text(errors="replace")
    assert "serving" in text, "the server log was not written"
    assert "zebra" not in text and "marmalade" not in text, "prompt text leaked into the logs"
    if secret.text.strip():
        assert secret.text.strip() not in text, "completion text leaked into the logs"
    assert TOKEN not in text, "a bearer token leaked into the logs"
