# Sourced by test-deps.sh and bench-deps.sh (not run on its own).
#
# install_without_services [--no-recommends] SERVICE... -- PACKAGE... installs
# Debian packages whose postinst would start a server this project never
# uses as a service (the tests and the bench start their own, on ports of
# their own): service starts are denied while they install (a policy-rc.d of
# our own, unless the machine has one) and SERVICE... are disabled and
# stopped afterwards, so no stray server listens on a default port.
install_without_services() {
  local recommends=() services=()
  if [ "${1:-}" = --no-recommends ]; then
    recommends=(--no-install-recommends)
    shift
  fi
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    services+=("$1")
    shift
  done
  shift # --
  local own_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
  fi
  local rc=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${recommends[@]}" "$@" >/dev/null || rc=$?
  [ -n "$own_policy" ] && rm -f /usr/sbin/policy-rc.d
  [ "$rc" -eq 0 ] || return "$rc"
  local svc
  for svc in "${services[@]}"; do
    if [ -d /run/systemd/system ]; then
      systemctl disable --now "$svc.service" >/dev/null 2>&1 || true
    else
      deb-systemd-helper disable "$svc.service" >/dev/null 2>&1 || true
      service "$svc" stop >/dev/null 2>&1 || true
    fi
    update-rc.d "$svc" disable >/dev/null 2>&1 || true
  done
}
