"""Client side of the CLI: `streambatch generate` and `streambatch info`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc

# What a client of a replicated streambatch should use (docs/deploy.md): a call refused before
# it got response headers (a replica draining or gone: UNAVAILABLE; a full queue:
# RESOURCE_EXHAUSTED, after the server's grpc-retry-pushback-ms) is sent again, up to 5 times;
# behind a balancer the retry reaches another replica. A call that has streamed is never
# retried (gRPC commits it at the first response headers).
SERVICE_CONFIG = json.dumps(
    {
        # Under sustained refusals retries stop once they are more than a tenth of calls.
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
        "methodConfig": [
            {
                "name": [{"service": "streambatch.v1.Generation"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
                },
            }
        ],
    }
)
CHANNEL_OPTIONS = (("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1))


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when --tls-ca is given (plus a client certificate for mTLS); a bearer
    token from --token rides on every call. Calls retry per SERVICE_CONFIG."""
    if not args.tls_ca:
        if args.token:
            raise SystemExit("--token needs --tls-ca: tokens are not sent over plaintext")
        return grpc.insecure_channel(args.target, options=CHANNEL_OPTIONS)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca).read_bytes(),
        private_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        certificate_chain=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
    )
    if args.token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(args.token)
        )
    return grpc.secure_channel(args.target, creds, options=CHANNEL_OPTIONS)


def generate(args: argparse.Namespace) -> int:
    if args.raw:
        request = pb.GenerateRequest(text=args.prompt)
    else:
        request = pb.GenerateRequest(
            chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=args.prompt)])
        )
    request.sampling.max_tokens = args.max_tokens
    request.sampling.temperature = args.temperature
    request.sampling.top_p = args.top_p
    request.priority = args.priority
    with open_channel(args) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            last = None
            for msg in stub.Generate(request, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                last = msg
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if last is not None:
        t, u = last.timings, last.usage
        print(
            f"[{pb.FinishReason.Name(last.finish_reason)}; {u.prompt_tokens} prompt + "
            f"{u.completion_tokens} completion tokens; ttft {t.ttft_ms:.0f} ms, "
            f"total {t.total_ms:.0f} ms"
            + (f"; preempted {t.preemptions}x" if t.preemptions else "")
            + "]",
            file=sys.stderr,
        )
    return 0


def info(args: argparse.Namespace) -> int:
    with open_channel(args) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(server, indent=2))
    print(json_format.MessageToJson(load, indent=2, always_print_fields_with_no_presence=True))
    return 0
