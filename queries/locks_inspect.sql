-- name: GetLock :one
-- GetLock returns one lock row with the database's current time.
SELECT name, token, holder, acquired_at, renewed_at, expires_at, metadata,
       now()::timestamptz AS db_now
FROM pgfence.locks
WHERE name = @name;

-- name: ListLocks :many
-- ListLocks returns lock rows whose name matches a LIKE pattern, by name.
SELECT name, token, holder, acquired_at, renewed_at, expires_at, metadata,
       now()::timestamptz AS db_now
FROM pgfence.locks
WHERE name LIKE @name_pattern
ORDER BY name
LIMIT @max_rows;
