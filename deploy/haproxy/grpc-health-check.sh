#!/bin/sh
# HAProxy external check: the gRPC health protocol (grpc.health.v1) for streambatch.v1.Generation.
# HAProxy calls it as: <proxy addr> <proxy port> <server addr> <server port>. Exit 0 only on
# SERVING: a replica that is loading or draining answers NOT_SERVING (a draining one still
# serves what arrives until it is marked down: its accept window, docs/api.md "Shutdown").
# The proto comes from this folder, so the check works with --reflection false and with
# --auth-token-file (health is exempt from tokens). Plaintext: for TLS replicas add -cacert.
# grpcurl comes from the PATH HAProxy sets (`external-check path`).
here=$(dirname "$0")
exec grpcurl -plaintext -max-time 2 -import-path "$here" -proto health.proto \
  -d '{"service": "streambatch.v1.Generation"}' "$3:$4" grpc.health.v1.Health/Check \
  2>/dev/null | grep -q '"SERVING"'
