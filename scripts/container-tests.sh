#!/usr/bin/env bash
# Runs the packages of CONTAINER_PKGS with the test harness's testcontainers
# path, for real, on a machine without a Docker engine or a registry (CI):
# a private engine in a fresh temporary directory (scripts/docker-engine.sh:
# Debian's docker.io, the PostgreSQL and reaper images built here), then
# go test -race with PGFENCE_TEST_SERVER=testcontainers, so that a container
# that cannot be had fails the tests instead of falling back to local
# binaries. It fails too when the engine saw no PostgreSQL container start.
# The engine is stopped, by its pid, however this ends.
set -euo pipefail
cd "$(dirname "$0")/.."

# The packages whose tests run on containers, space-separated. Add a package
# here (or pass CONTAINER_PKGS in the environment).
CONTAINER_PKGS=${CONTAINER_PKGS:-./internal/testing/pgserver/ ./pgfencetest/}
PG_IMAGE=pgfence/postgres-test:15

now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
timings=()
phase_done() { # NAME START
	timings+=("$(printf '%-22s %s' "$1" "$(took "$2")")")
	echo "container-tests: $1: $(took "$2")"
}

dir=$(mktemp -d "${TMPDIR:-/tmp}/pgfence-docker.XXXXXX")
cleanup() {
	local rc=$? t0
	t0=$(now)
	bash scripts/docker-engine.sh stop "$dir" || rc=1
	if grep -q " $dir/" /proc/mounts; then
		echo "container-tests: $dir kept: something is still mounted under it" >&2
	else
		rm -rf "$dir"
	fi
	phase_done "engine stop" "$t0"
	echo "container-tests: timings:"
	printf '  %s\n' "${timings[@]}"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

t0=$(now)
bash scripts/docker-engine.sh start "$dir"
phase_done "engine install+start" "$t0"

t0=$(now)
bash scripts/docker-engine.sh images "$dir"
phase_done "images" "$t0"

export DOCKER_HOST="unix://$dir/docker.sock"
export TESTCONTAINERS_DOCKER_SOCKET_OVERRIDE="$dir/docker.sock" # what the reaper gets mounted
export TESTCONTAINERS_HOST_OVERRIDE=localhost                    # DSNs on loopback, never a bridge address
export PGFENCE_TEST_IMAGE=$PG_IMAGE
export PGFENCE_TEST_SERVER=testcontainers # a failed container is an error, not a fallback
unset PGFENCE_TEST_DATABASE_URL            # a DSN would come first

since=$(($(date +%s) - 1))
t0=$(now)
echo "container-tests: go test -race -count=1 -v $CONTAINER_PKGS (image $PG_IMAGE)"
# -v: a passing package's output, pgserver's line naming its container
# included, is shown too.
# shellcheck disable=SC2086 # one word per package
go test -race -count=1 -v $CONTAINER_PKGS 2>&1 | tee "$dir/go-test.log"
phase_done "tests" "$t0"
echo "container-tests: what the test binaries said about their servers:"
grep -h -o 'pgserver: testcontainers: .*' "$dir/go-test.log" | sed 's/^/  /' || echo "  nothing"

upto=$(($(date +%s) + 1))
started=$(docker events --since "$since" --until "$upto" --filter type=container --filter event=start \
	--format '{{.Actor.Attributes.image}} {{.ID}}')
echo "container-tests: containers the engine started during the tests:"
if [ -n "$started" ]; then
	echo "$started" | awk '{ printf "  %s %.12s\n", $1, $2 }'
else
	echo "  none"
fi
n=$(echo "$started" | awk -v img="$PG_IMAGE" '$1 == img' | grep -c . || true)
if [ "$n" -eq 0 ]; then
	echo "container-tests: FAIL: no $PG_IMAGE container started: the tests did not take the container path" >&2
	exit 1
fi
echo "container-tests: $n $PG_IMAGE container(s) started"
