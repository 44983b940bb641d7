#!/bin/sh
# Renders haproxy.cfg and runs HAProxy in the foreground (docker-compose.yml's balancer).
#   REPLICAS="host:port host:port ..."  one server line each; or
#   REPLICAS_DNS=name:port REPLICA_SLOTS=N  every address Docker's DNS gives for the name (a
#   scaled compose service), re-resolved as replicas come and go.
set -eu
servers=""
if [ -n "${REPLICAS:-}" ]; then
  i=0
  for replica in $REPLICAS; do
    servers="${servers}  server r${i} ${replica}\n"
    i=$((i + 1))
  done
else
  servers="  server-template r 1-${REPLICA_SLOTS:-3} ${REPLICAS_DNS:?set REPLICAS or REPLICAS_DNS} resolvers docker init-addr none\n"
fi
sed -e "s|@LISTEN@|0.0.0.0:${LISTEN_PORT:-8080}|" -e "s|@STATS@|0.0.0.0:${STATS_PORT:-8404}|" \
    -e "s|@CHECK@|/etc/haproxy/grpc-health-check.sh|" -e "s|@PATH@|/usr/local/bin:/usr/bin:/bin|" \
    -e "s|@SERVERS@|${servers}|" /etc/haproxy/haproxy.cfg.in > /tmp/haproxy.cfg
if [ -z "${REPLICAS:-}" ]; then
  printf 'resolvers docker\n  nameserver dns 127.0.0.11:53\n  hold valid 5s\n' >> /tmp/haproxy.cfg
fi
exec haproxy -W -db -f /tmp/haproxy.cfg
