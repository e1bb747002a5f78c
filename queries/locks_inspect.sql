-- name: GetLock :one
-- GetLock returns one lock row of the pgfence.lock_status view (state held,
-- expired or free on the database clock) and the database's current time.
SELECT name, token, holder, acquired_at, renewed_at, expires_at, metadata, state::pg_catalog.text AS state,
       COALESCE(((extract(epoch FROM ((expires_at OPERATOR(pg_catalog.-) pg_catalog.now()))) OPERATOR(pg_catalog.*) 1000))::bigint, 0)::bigint AS expires_in_ms,
       pg_catalog.now()::pg_catalog.timestamptz AS db_now
FROM pgfence.lock_status
WHERE (name OPERATOR(pg_catalog.=) @name);

-- name: ListLocks :many
-- ListLocks returns the rows of pgfence.lock_status whose name matches a LIKE
-- pattern and whose state is one of the given states, ordered by name.
-- expires_in_ms is 0 for a free lock and negative for an expired one.
SELECT name, token, holder, acquired_at, renewed_at, expires_at, metadata, state::pg_catalog.text AS state,
       COALESCE(((extract(epoch FROM ((expires_at OPERATOR(pg_catalog.-) pg_catalog.now()))) OPERATOR(pg_catalog.*) 1000))::bigint, 0)::bigint AS expires_in_ms,
       pg_catalog.now()::pg_catalog.timestamptz AS db_now
FROM pgfence.lock_status
WHERE (name OPERATOR(pg_catalog.~~) @name_pattern::pg_catalog.text)
  AND (state OPERATOR(pg_catalog.=) ANY (@states::pg_catalog.text[]))
ORDER BY name
LIMIT @max_rows;
