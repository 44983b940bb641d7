#!/bin/sh
# HAProxy external check: the gRPC health protocol (grpc.health.v1) for streambatch.v1.Generation.
# HAProxy calls it as: <proxy addr> <proxy port> <server addr> <server port>. Exit 0 only on
# SERVING: a replica that is loading or draining answers NOT_SERVING and takes no new calls.
# grpcurl comes from the PATH HAProxy sets (`external-check path`).
exec grpcurl -plaintext -max-time 1 -d '{"service": "streambatch.v1.Generation"}' \
  "$3:$4" grpc.health.v1.Health/Check 2>/dev/null | grep -q '"SERVING"'
