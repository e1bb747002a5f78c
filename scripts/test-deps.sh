#!/usr/bin/env bash
# Installs the Debian packages some tests need when they are missing:
# pgbouncer (advisory locks through a transaction pooler), faketime
# (clock-skew fault tests), and patroni with etcd-server (the HA tests in
# internal/testing/hatest start etcd and three Patroni-managed PostgreSQL nodes;
# Debian's patroni package brings python3-etcd for its etcd DCS), and
# prometheus for its promtool (deploy/ checks the alert rules and the
# dashboard's queries with it), and python3-psycopg (internal/testing/crosslang runs
# the Python example client, examples/python, against Go; Debian's package
# installs into Debian's python3, which the tests also look for when the
# python3 on PATH lacks psycopg). The PostgreSQL server binaries themselves are
# looked up by the test harness (apt-get install postgresql).
set -euo pipefail

# shellcheck source=apt-quiet.sh
. "$(dirname "$0")/apt-quiet.sh"

need=()
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || need+=(pgbouncer)
command -v faketime >/dev/null 2>&1 || need+=(faketime)
{ command -v patroni >/dev/null 2>&1 || [ -x /usr/bin/patroni ]; } && command -v patronictl >/dev/null 2>&1 || need+=(patroni)
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v promtool >/dev/null 2>&1 || [ -x /usr/bin/promtool ] || need+=(prometheus)
python3 -c 'import psycopg' >/dev/null 2>&1 || /usr/bin/python3 -c 'import psycopg' >/dev/null 2>&1 || need+=(python3-psycopg)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: please install: ${need[*]} (Debian/Ubuntu: sudo apt-get install ${need[*]}); the tests that need them will fail until then" >&2
  exit 0
fi
echo "test-deps: installing ${need[*]}"
apt-get update -qq
rest=()
for p in "${need[@]}"; do [ "$p" = prometheus ] || rest+=("$p"); done
if [ ${#rest[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${rest[@]}" >/dev/null
fi
if [ ${#rest[@]} -lt ${#need[@]} ]; then
  # Debian's prometheus package for its promtool, without the server it also
  # ships (and without the exporters its recommends would bring).
  install_without_services --no-recommends prometheus -- prometheus
fi
