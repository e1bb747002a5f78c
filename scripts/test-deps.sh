#!/usr/bin/env bash
# Installs the Debian packages some tests need when they are missing:
# pgbouncer (advisory locks through a transaction pooler), faketime
# (clock-skew fault tests), and patroni with etcd-server (the HA tests in
# internal/hatest start etcd and three Patroni-managed PostgreSQL nodes;
# Debian's patroni package brings python3-etcd for its etcd DCS). The
# PostgreSQL server binaries themselves are looked up by the test harness
# (apt-get install postgresql).
set -euo pipefail
need=()
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || need+=(pgbouncer)
command -v faketime >/dev/null 2>&1 || need+=(faketime)
{ command -v patroni >/dev/null 2>&1 || [ -x /usr/bin/patroni ]; } && command -v patronictl >/dev/null 2>&1 || need+=(patroni)
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: please install: ${need[*]} (Debian/Ubuntu: sudo apt-get install ${need[*]}); the tests that need them will fail until then" >&2
  exit 0
fi
echo "test-deps: installing ${need[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
