#!/usr/bin/env bash
# A private Docker engine for the container tests (scripts/container-tests.sh),
# on a machine with a Docker client but no engine and no registry (CI): Debian's
# docker.io, and the two images the tests need built from Debian packages and
# from this repository instead of pulled.
#
#   docker-engine.sh start DIR    install docker.io when dockerd is missing (root,
#                                 apt-get), start dockerd on unix://DIR/docker.sock
#                                 with everything of its own under DIR, wait until
#                                 it answers
#   docker-engine.sh images DIR   build pgfence/postgres-test:15 and
#                                 pgfence/reaper-test:1 into it unless present
#   docker-engine.sh stop DIR     stop that dockerd by the pid in DIR/dockerd.pid
#
# The engine never listens on /var/run/docker.sock: other test runs on the
# machine would take the container path. Its network stays on the machine:
# --iptables=false (no NAT rules, containers reach nothing outside),
# --ip-forward=false (the machine's forwarding setting is left alone) and
# --ip=127.0.0.1 (published ports listen on loopback only). Use it with
#   DOCKER_HOST=unix://DIR/docker.sock TESTCONTAINERS_HOST_OVERRIDE=localhost
set -euo pipefail

PG_IMAGE=pgfence/postgres-test:15
REAPER_IMAGE=pgfence/reaper-test:1
# testcontainers-go v0.45 has no setting for its reaper's image: it runs
# config.ReaperDefaultImage, read below from the module's source, so the
# reaper image is tagged with that name too (in this engine only).
RYUK_CONFIG=internal/config/config.go

usage() {
	echo "usage: $0 start|images|stop DIR" >&2
	exit 2
}

[ $# -eq 2 ] || usage
cmd=$1
dir=$(realpath -m "$2")
cd "$(dirname "$0")/.."
sock=$dir/docker.sock
pidfile=$dir/dockerd.pid
log=$dir/dockerd.log

say() { echo "docker-engine: $*"; }
die() {
	echo "docker-engine: $*" >&2
	exit 1
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
dk() { docker -H "unix://$sock" "$@"; }
answers() { dk version >/dev/null 2>&1; }

# pid prints the pid of this DIR's dockerd if it runs: the pid of the pidfile,
# and only if that process is a dockerd started with this DIR's socket.
pid() {
	[ -s "$pidfile" ] || return 1
	local p
	p=$(cat "$pidfile")
	[ -r "/proc/$p/cmdline" ] || return 1
	local cmdline
	cmdline=$(tr '\0' ' ' <"/proc/$p/cmdline")
	case "$cmdline" in
	*dockerd*"unix://$sock "*) echo "$p" ;;
	*) return 1 ;;
	esac
}

# apt_install PACKAGE... installs Debian packages, without recommends, and
# without starting the services docker and containerd (docker.io's postinst
# would start a dockerd on /var/run/docker.sock).
apt_install() {
	if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
		die "please install $* (Debian/Ubuntu: sudo apt-get install $*)"
	fi
	# shellcheck source-path=SCRIPTDIR source=apt-quiet.sh
	. scripts/apt-quiet.sh
	if [ -z "${apt_updated:-}" ]; then
		apt-get update -qq
		apt_updated=1
	fi
	install_without_services --no-recommends docker containerd -- "$@"
}

start() {
	if p=$(pid); then
		answers || die "dockerd $p of $dir runs but does not answer (see $log)"
		say "dockerd $p already answers on unix://$sock"
		env_hint
		return
	fi
	if ! command -v dockerd >/dev/null 2>&1; then
		local t0
		t0=$(now)
		say "installing docker.io (dockerd, containerd, runc) with apt-get"
		apt_install docker.io
		command -v dockerd >/dev/null 2>&1 || die "docker.io installed but no dockerd on PATH"
		say "installed docker.io in $(since "$t0")"
	fi
	command -v docker >/dev/null 2>&1 || die "no docker client on PATH"
	mkdir -p "$dir/data" "$dir/exec"
	echo '{}' >"$dir/daemon.json" # the machine's /etc/docker/daemon.json is not ours
	[ -e "$dir/created-docker0" ] || ip link show docker0 >/dev/null 2>&1 || touch "$dir/created-docker0"
	if ! launch overlay2; then
		say "overlay2 failed (last lines of $log below); falling back to vfs (slower, more disk)"
		tail -n 5 "$log" | sed 's/^/  /'
		launch vfs || {
			tail -n 20 "$log" >&2
			die "dockerd did not start with vfs either (log: $log)"
		}
	fi
	env_hint
}

# launch DRIVER starts dockerd and waits up to 60 s until it answers.
launch() {
	local driver=$1 t0 p
	t0=$(now)
	rm -f "$pidfile"
	echo "== $(date -Is) dockerd --storage-driver=$driver" >>"$log"
	dockerd \
		--host "unix://$sock" \
		--data-root "$dir/data" \
		--exec-root "$dir/exec" \
		--pidfile "$pidfile" \
		--config-file "$dir/daemon.json" \
		--storage-driver "$driver" \
		--iptables=false \
		--ip-forward=false \
		--ip 127.0.0.1 \
		</dev/null >>"$log" 2>&1 &
	p=$!
	for _ in $(seq 300); do
		if ! kill -0 "$p" 2>/dev/null; then
			wait "$p" || true
			return 1
		fi
		if answers; then
			say "dockerd $p ($driver) answers on unix://$sock after $(since "$t0")"
			return 0
		fi
		sleep 0.2
	done
	say "dockerd $p ($driver) does not answer after 60 s; stopping it"
	kill -TERM "$p" 2>/dev/null || true
	wait "$p" || true
	return 1
}

env_hint() {
	echo "export DOCKER_HOST=unix://$sock TESTCONTAINERS_HOST_OVERRIDE=localhost"
}

images() {
	answers || die "no engine answers on unix://$sock: run '$0 start $dir' first"
	# The reaper compiles (CPU) while debootstrap mostly waits (network, disk).
	reaper_build_start
	trap 'reaper_build_kill' EXIT
	postgres_image
	reaper_image
	trap - EXIT
}

# postgres_image builds PG_IMAGE: Debian bookworm minbase with postgresql-15
# (debootstrap from the mirror apt uses), trimmed, imported, and given the
# entrypoint, user and settings of scripts/postgres-test-entrypoint.sh by a
# small legacy build (docker import cannot set STOPSIGNAL).
postgres_image() {
	local recipe
	recipe=$(cat scripts/docker-engine.sh scripts/postgres-test-entrypoint.sh | sha256sum | cut -c1-16)
	if [ "$(dk image inspect -f '{{index .Config.Labels "org.pgfence.recipe"}}' "$PG_IMAGE" 2>/dev/null)" = "$recipe" ]; then
		say "$PG_IMAGE present (recipe $recipe): not rebuilt"
		return
	fi
	command -v debootstrap >/dev/null 2>&1 || {
		local t0
		t0=$(now)
		apt_install debootstrap
		say "installed debootstrap in $(since "$t0")"
	}
	local mirror root t0
	mirror=$(debian_mirror)
	root=$dir/rootfs
	t0=$(now)
	rm -rf "$root"
	say "debootstrap bookworm + postgresql-15 from $mirror"
	if ! debootstrap --variant=minbase --include=postgresql-15 bookworm "$root" "$mirror" >"$dir/debootstrap.log" 2>&1; then
		tail -n 20 "$dir/debootstrap.log" >&2
		die "debootstrap failed (log: $dir/debootstrap.log)"
	fi
	say "debootstrap done in $(since "$t0") ($(du -sh "$root" | cut -f1))"

	t0=$(now)
	# Trim what a test server never reads: docs, man pages, translations,
	# apt's caches, and the JIT (LLVM, most of the size; PostgreSQL runs
	# without JIT when its provider is missing).
	rm -rf "$root"/usr/share/{doc,man,info,locale,lintian,linda}/* \
		"$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/cache/debconf/*-old \
		"$root"/usr/lib/postgresql/15/lib/llvmjit* "$root"/usr/lib/postgresql/15/lib/bitcode \
		"$root"/usr/lib/x86_64-linux-gnu/libLLVM* "$root"/usr/lib/llvm-*
	# No cluster of Debian's own: the entrypoint makes one in PGDATA.
	rm -rf "$root"/etc/postgresql/* "$root"/var/lib/postgresql/15
	install -m 755 scripts/postgres-test-entrypoint.sh "$root/usr/local/bin/docker-entrypoint.sh"
	mkdir -p "$root/docker-entrypoint-initdb.d" "$root/var/lib/postgresql/data" "$root/run/postgresql"
	chroot "$root" chown postgres:postgres /var/lib/postgresql /var/lib/postgresql/data /run/postgresql
	chmod 700 "$root/var/lib/postgresql/data"
	chmod 2775 "$root/run/postgresql"
	local tool
	for tool in /bin/sh /usr/bin/awk /bin/grep /bin/cat; do
		[ -x "$root$tool" ] || die "the image lacks $tool (testcontainers' port check runs sh, cat, awk and grep)"
	done
	say "trimmed to $(du -sh "$root" | cut -f1) in $(since "$t0")"

	t0=$(now)
	local rootfs_tag=$PG_IMAGE-rootfs ctx=$dir/pg-build
	tar -C "$root" --numeric-owner -c . | dk import - "$rootfs_tag" >/dev/null
	rm -rf "$ctx"
	mkdir -p "$ctx"
	cat >"$ctx/Dockerfile" <<EOF
FROM $rootfs_tag
LABEL org.pgfence.recipe="$recipe" \\
      org.opencontainers.image.description="PostgreSQL 15 from Debian bookworm's packages for pgfence's CI; keeps the official postgres image's entrypoint contract, is not that image"
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PGDATA=/var/lib/postgresql/data \\
    LANG=C.UTF-8
USER postgres
WORKDIR /var/lib/postgresql
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["postgres"]
STOPSIGNAL SIGINT
EXPOSE 5432
EOF
	DOCKER_BUILDKIT=0 dk build -q -t "$PG_IMAGE" "$ctx" >/dev/null 2>"$dir/pg-build.log" || {
		cat "$dir/pg-build.log" >&2
		die "docker build of $PG_IMAGE failed"
	}
	dk rmi "$rootfs_tag" >/dev/null # the tag only: the layer is the image's
	rm -rf "$root" "$ctx"
	say "$PG_IMAGE built in $(since "$t0") ($(dk image inspect -f '{{.Size}}' "$PG_IMAGE" | awk '{ printf "%d MB", $1 / 1e6 }'))"
}

# debian_mirror prints the Debian mirror apt uses for bookworm, from
# /etc/apt/sources.list (one-line form) or /etc/apt/sources.list.d/*.list and
# *.sources (deb822 form). Security and third-party entries are skipped.
debian_mirror() {
	local m
	m=$(
		{
			cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
				awk '$1 == "deb" { line = $0; sub(/\[[^]]*\]/, "", line); split(line, f, /[ \t]+/)
				                   if (f[3] == "bookworm") print f[2] }'
			cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
				awk 'BEGIN { RS = ""; FS = "\n" }
				     { u = ""; s = ""; deb = 0; off = 0
				       for (i = 1; i <= NF; i++) {
				         if ($i ~ /^Types:/ && $i ~ /[ \t]deb([ \t]|$)/) deb = 1
				         if ($i ~ /^URIs:/) { split($i, a, /[ \t]+/); u = a[2] }
				         if ($i ~ /^Suites:/) s = $i
				         if ($i ~ /^Enabled:[ \t]*no/) off = 1
				       }
				       if (deb && !off && u != "" && s ~ /[ \t]bookworm([ \t]|$)/) print u }'
		} | grep -v -i security | head -n 1 || true
	)
	[ -n "$m" ] || die "no Debian bookworm mirror in /etc/apt/sources.list or /etc/apt/sources.list.d/"
	echo "$m"
}

# reaper_build_start compiles internal/testing/reaper in the background,
# static (CGO_ENABLED=0), unless REAPER_IMAGE was built from the same source.
reaper_src=""
reaper_pid=""
reaper_t0=""
reaper_build_start() {
	reaper_src=$(cat internal/testing/reaper/*.go | sha256sum | cut -c1-16)
	if [ "$(dk image inspect -f '{{index .Config.Labels "org.pgfence.recipe"}}' "$REAPER_IMAGE" 2>/dev/null)" = "$reaper_src" ]; then
		return
	fi
	reaper_t0=$(now)
	rm -rf "$dir/reaper-build"
	mkdir -p "$dir/reaper-build"
	(
		CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$dir/reaper-build/reaper" ./internal/testing/reaper || exit
		since "$reaper_t0" >"$dir/reaper-build/took"
	) >"$dir/reaper-go-build.log" 2>&1 &
	reaper_pid=$!
}

reaper_build_kill() {
	[ -z "$reaper_pid" ] || kill "$reaper_pid" 2>/dev/null || true
}

# reaper_image puts the reaper in REAPER_IMAGE (FROM scratch) and tags it
# with the reaper image name testcontainers runs.
reaper_image() {
	local tcdir ryuk ctx=$dir/reaper-build
	tcdir=$(go list -f '{{.Module.Dir}}' github.com/testcontainers/testcontainers-go)
	ryuk=$(sed -n 's/^const ReaperDefaultImage = "\(.*\)"$/\1/p' "$tcdir/$RYUK_CONFIG")
	[ -n "$ryuk" ] || die "no ReaperDefaultImage in $tcdir/$RYUK_CONFIG: testcontainers-go changed how its reaper image is named"
	if [ -z "$reaper_pid" ]; then
		say "$REAPER_IMAGE present (source $reaper_src): not rebuilt"
	else
		local p=$reaper_pid
		reaper_pid=""
		wait "$p" || {
			cat "$dir/reaper-go-build.log" >&2
			die "go build of internal/testing/reaper failed"
		}
		cat >"$ctx/Dockerfile" <<EOF
FROM scratch
COPY reaper /reaper
LABEL org.pgfence.recipe="$reaper_src" \\
      org.opencontainers.image.description="pgfence's stand-in for testcontainers' reaper (Ryuk), built from internal/testing/reaper"
ENTRYPOINT ["/reaper"]
EOF
		DOCKER_BUILDKIT=0 dk build -q -t "$REAPER_IMAGE" "$ctx" >/dev/null 2>"$dir/reaper-build.log" || {
			cat "$dir/reaper-build.log" >&2
			die "docker build of $REAPER_IMAGE failed"
		}
		say "$REAPER_IMAGE built (go build took $(cat "$ctx/took"), beside the PostgreSQL image's build)"
		rm -rf "$ctx"
	fi
	dk tag "$REAPER_IMAGE" "$ryuk"
	say "$REAPER_IMAGE also tagged $ryuk, the reaper image testcontainers runs"
}

stop() {
	local p
	if ! p=$(pid); then
		say "no dockerd of $dir runs"
		return
	fi
	# This engine's containers and networks are all the tests': remove them,
	# so that no bridge interface of theirs outlives the engine.
	if answers; then
		local ids
		ids=$(dk ps -aq)
		# shellcheck disable=SC2086 # one word per id
		[ -z "$ids" ] || dk rm -f $ids >/dev/null 2>&1 || true
		dk network prune -f >/dev/null 2>&1 || true
	fi
	local t0 containerd_pid=""
	t0=$(now)
	[ -s "$dir/exec/containerd/containerd.pid" ] && containerd_pid=$(cat "$dir/exec/containerd/containerd.pid")
	kill -TERM "$p"
	for _ in $(seq 150); do
		kill -0 "$p" 2>/dev/null || break
		sleep 0.2
	done
	if kill -0 "$p" 2>/dev/null; then
		say "dockerd $p still runs 30 s after SIGTERM: SIGKILL"
		kill -KILL "$p" 2>/dev/null || true
		sleep 0.5
	fi
	# dockerd stops the containerd it started; a SIGKILLed one cannot.
	if [ -n "$containerd_pid" ] && [ -r "/proc/$containerd_pid/cmdline" ] &&
		tr '\0' ' ' <"/proc/$containerd_pid/cmdline" | grep -q -- "$dir/"; then
		kill -KILL "$containerd_pid" 2>/dev/null || true
	fi
	say "dockerd $p stopped in $(since "$t0")"
	if [ -e "$dir/created-docker0" ] && ! pgrep -x dockerd >/dev/null; then
		ip link delete docker0 2>/dev/null || true
		rm -f "$dir/created-docker0"
	fi
	# The shim socket directory containerd makes; left when empty.
	pgrep -x containerd >/dev/null || rmdir /run/containerd/s /run/containerd 2>/dev/null || true
	if grep -q " $dir/" /proc/mounts; then
		say "still mounted under $dir:"
		grep " $dir/" /proc/mounts | cut -d' ' -f2 | sed 's/^/  /'
	fi
}

case "$cmd" in
start) start ;;
images) images ;;
stop) stop ;;
*) usage ;;
esac
