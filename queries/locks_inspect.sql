-- name: GetLock :one
-- GetLock returns one lock row, its state and the database's current time.
-- State is computed on the database clock: held, expired or free.
SELECT name, token, holder, acquired_at, renewed_at, expires_at, metadata,
       (CASE WHEN holder IS NULL THEN 'free'
             WHEN expires_at > now() THEN 'held'
             ELSE 'expired' END)::text AS state,
       COALESCE((extract(epoch FROM (expires_at - now())) * 1000)::bigint, 0)::bigint AS expires_in_ms,
       now()::timestamptz AS db_now
FROM pgfence.locks
WHERE name = @name;

-- name: ListLocks :many
-- ListLocks returns lock rows whose name matches a LIKE pattern and whose state
-- is one of the given states (held, expired, free), ordered by name.
-- expires_in_ms is 0 for a free lock and negative for an expired one.
SELECT name, token, holder, acquired_at, renewed_at, expires_at, metadata,
       (CASE WHEN holder IS NULL THEN 'free'
             WHEN expires_at > now() THEN 'held'
             ELSE 'expired' END)::text AS state,
       COALESCE((extract(epoch FROM (expires_at - now())) * 1000)::bigint, 0)::bigint AS expires_in_ms,
       now()::timestamptz AS db_now
FROM pgfence.locks
WHERE name LIKE @name_pattern
  AND (CASE WHEN holder IS NULL THEN 'free'
            WHEN expires_at > now() THEN 'held'
            ELSE 'expired' END) = ANY (@states::text[])
ORDER BY name
LIMIT @max_rows;
