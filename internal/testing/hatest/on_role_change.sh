#!/bin/sh
# Patroni on_role_change callback: $1 = action, $2 = new role, $3 = scope.
# On promotion, run pgfence.ha_bump() in every database that has pgfence (it
# does nothing where pgfence.ha_enable() never ran). Until
# it has run, the gate refuses every grant there, so no token is issued on
# the new timeline before the bump. psql connects with PGHOST, PGPORT and
# PGUSER (the node's own server, as the owner of schema pgfence, or as a
# superuser where a superuser owns it; else set PGOPTIONS='-c role=<owner>').
case "$2" in master|primary) ;; *) exit 0 ;; esac
tries=0
while [ "$tries" -lt 600 ]; do
  tries=$((tries + 1))
  dbs=$(psql -XAtq -d postgres -c \
    "SELECT datname FROM pg_database WHERE datallowconn AND NOT pg_is_in_recovery()") || dbs=
  if [ -n "$dbs" ]; then
    failed=0
    for db in $dbs; do
      psql -XAtq -d "$db" -v ON_ERROR_STOP=1 -c \
        'DO $$ BEGIN IF to_regproc($q$pgfence.ha_bump$q$) IS NOT NULL THEN PERFORM pgfence.ha_bump(); END IF; END $$' \
        >/dev/null || failed=1
    done
    [ "$failed" -eq 0 ] && exit 0
  fi
  sleep 0.2
done
echo "pgfence epoch bump did not run: grants stay refused on this primary" >&2
exit 1
