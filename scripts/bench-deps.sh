#!/usr/bin/env bash
# Installs the peers `make bench` compares pgfence with when they are
# missing: etcd-server (P1) and redis-server (P2, and P3 the durable Redis).
# The bench starts its own etcd and Redis servers on loopback ports of its
# own; the services the Debian packages ship are kept from starting and
# disabled afterwards (install_without_services), so no stray server listens
# on the default ports.
# Without root or apt-get it only says what to install: the bench then
# records those peers as "not measured" and runs everything else.
set -euo pipefail
# shellcheck source=apt-quiet.sh
. "$(dirname "$0")/apt-quiet.sh"

need=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || need+=(redis-server)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "bench-deps: please install: ${need[*]} (Debian/Ubuntu: sudo apt-get install ${need[*]}); until then the bench reports those peers as not measured" >&2
  exit 0
fi
echo "bench-deps: installing ${need[*]}"
apt-get update -qq
install_without_services --no-recommends etcd redis-server -- "${need[@]}"
