#!/usr/bin/env bash
# Installs the peers `make bench` compares pgfence with when they are
# missing: etcd-server (P1) and redis-server (P2, and P3 the durable Redis).
# The bench starts its own etcd and Redis servers on loopback ports of its
# own; the services the Debian packages ship are kept from starting (a
# policy-rc.d of our own while installing, unless the machine has one) and
# disabled afterwards, so no stray server listens on the default ports.
# Without root or apt-get it only says what to install: the bench then
# records those peers as "not measured" and runs everything else.
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || need+=(redis-server)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "bench-deps: please install: ${need[*]} (Debian/Ubuntu: sudo apt-get install ${need[*]}); until then the bench reports those peers as not measured" >&2
  exit 0
fi
echo "bench-deps: installing ${need[*]}"
own_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  own_policy=1
fi
rc=0
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; } || rc=$?
[ -n "$own_policy" ] && rm -f /usr/sbin/policy-rc.d
[ "$rc" -eq 0 ] || exit "$rc"
for svc in etcd redis-server; do
  if [ -d /run/systemd/system ]; then
    systemctl disable --now "$svc.service" >/dev/null 2>&1 || true
  else
    service "$svc" stop >/dev/null 2>&1 || true
  fi
  update-rc.d "$svc" disable >/dev/null 2>&1 || true
done
