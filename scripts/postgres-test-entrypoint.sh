#!/bin/sh
# Entrypoint of pgfence/postgres-test:15, the PostgreSQL image that
# scripts/docker-engine.sh builds from Debian's packages for CI, where no
# registry can be reached. It keeps the part of the official postgres image's
# contract that testcontainers' postgres module relies on; it is not that
# image.
#
#   - POSTGRES_PASSWORD (required unless POSTGRES_HOST_AUTH_METHOD=trust),
#     POSTGRES_USER (default postgres), POSTGRES_DB (default the user),
#     POSTGRES_INITDB_ARGS, POSTGRES_HOST_AUTH_METHOD (default scram-sha-256);
#   - on the first start (no PG_VERSION in PGDATA): initdb, then a temporary
#     server on the unix socket only, which creates POSTGRES_DB and runs
#     /docker-entrypoint-initdb.d/*.sh and *.sql, then stops. Like the
#     official image, the temporary server logs "database system is ready to
#     accept connections" once and the real one a second time (the module
#     waits for the second);
#   - every address may connect with a password (host all all all), and the
#     server listens on all addresses of the container;
#   - arguments starting with "-" are options of postgres; "postgres ..." runs
#     the server; anything else is run as is.
#
# The image runs as the postgres user (USER postgres), so there is no
# privilege drop to do.
set -eu

case "${1:-}" in
-*) set -- postgres "$@" ;;
esac

if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
	user=${POSTGRES_USER:-postgres}
	db=${POSTGRES_DB:-$user}
	auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
	if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
		echo "error: POSTGRES_PASSWORD is not set (or set POSTGRES_HOST_AUTH_METHOD=trust)" >&2
		exit 1
	fi
	mkdir -p "$PGDATA"
	chmod 700 "$PGDATA"
	pwfile=$(mktemp)
	printf '%s\n' "${POSTGRES_PASSWORD:-}" >"$pwfile"
	# shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS is a list of words
	initdb -D "$PGDATA" --username="$user" --pwfile="$pwfile" \
		--encoding=UTF8 --locale=C.UTF-8 ${POSTGRES_INITDB_ARGS:-}
	rm -f "$pwfile"
	printf '\nhost all all all %s\n' "$auth" >>"$PGDATA/pg_hba.conf"
	printf "\nlisten_addresses = '*'\n" >>"$PGDATA/postgresql.conf"

	# The temporary server: unix socket only, so nobody connects before the
	# database exists.
	pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
	export PGUSER="$user" PGPASSWORD="${POSTGRES_PASSWORD:-}"
	if [ "$db" != postgres ]; then
		psql -v ON_ERROR_STOP=1 --no-psqlrc --dbname=postgres --set db="$db" <<-'EOSQL'
			CREATE DATABASE :"db";
		EOSQL
	fi
	for f in /docker-entrypoint-initdb.d/*; do
		# shellcheck disable=SC1090 # the image user's own scripts
		case "$f" in
		*.sh) echo "running $f" && . "$f" ;;
		*.sql) echo "running $f" && psql -v ON_ERROR_STOP=1 --no-psqlrc --dbname="$db" -f "$f" ;;
		*) if [ -e "$f" ]; then echo "ignoring $f"; fi ;;
		esac
	done
	unset PGUSER PGPASSWORD
	pg_ctl -D "$PGDATA" -m fast -w stop
	echo
	echo "PostgreSQL init process complete; ready for start up."
	echo
fi

exec "$@"
