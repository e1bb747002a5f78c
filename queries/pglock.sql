-- name: GrantLock :one
-- GrantLock grants a free or expired lock to holder: token + 1, expiry
-- now() + ttl_us microseconds, synchronous_commit on for this statement's
-- transaction. No row when the lock is held (nothing is locked or written)
-- or has no row yet (InsertLock creates it). At the bigint maximum it fails
-- with SQLSTATE 22003 and changes nothing. docs/design.md explains the shape.
UPDATE pgfence.locks AS l
SET token       = l.token + 1,
    holder      = sqlc.arg(holder)::text,
    acquired_at = now(),
    renewed_at  = NULL,
    expires_at  = now() + sqlc.arg(ttl_us)::bigint * interval '1 microsecond'
FROM (SELECT set_config('synchronous_commit', 'on', true) AS sync) AS sc
WHERE l.name = sqlc.arg(name)::text
  AND (l.holder IS NULL OR l.expires_at <= now())
RETURNING l.token, l.expires_at;

-- name: InsertLock :one
-- InsertLock is the first grant of a lock name, which has no row yet: token
-- 1, expiry now() + ttl_us microseconds, synchronous_commit on. No row when a
-- concurrent first grant inserted it (try GrantLock again).
INSERT INTO pgfence.locks AS l (name, token, holder, acquired_at, renewed_at, expires_at)
SELECT sqlc.arg(name)::text, 1, sqlc.arg(holder)::text, now(), NULL,
       now() + sqlc.arg(ttl_us)::bigint * interval '1 microsecond'
FROM (SELECT set_config('synchronous_commit', 'on', true) AS sync) AS sc
ON CONFLICT (name) DO NOTHING
RETURNING l.token, l.expires_at;

-- name: RenewLock :one
-- RenewLock extends a lease still held by (name, holder, token) to now() +
-- ttl_us microseconds, synchronous_commit on. No row = the lease was lost
-- (expired, released or re-granted).
UPDATE pgfence.locks AS l
SET expires_at = now() + sqlc.arg(ttl_us)::bigint * interval '1 microsecond',
    renewed_at = now()
FROM (SELECT set_config('synchronous_commit', 'on', true) AS sync) AS sc
WHERE l.name = sqlc.arg(name)::text
  AND l.holder = sqlc.arg(holder)::text
  AND l.token = sqlc.arg(token)::bigint
  AND l.expires_at > now()
RETURNING l.expires_at, now()::timestamptz AS db_now;

-- name: ReleaseLock :execrows
-- ReleaseLock frees a lease still held by (name, holder, token): holder and
-- expiry become NULL, the row and its token stay. If a waiter marked the row
-- in the last 100 seconds it notifies pgfence_lock_released with the lock
-- name. 0 rows = the lease was lost; nothing changed.
UPDATE pgfence.locks AS l
SET holder = NULL, expires_at = NULL, renewed_at = NULL
WHERE l.name = sqlc.arg(name)::text
  AND l.holder = sqlc.arg(holder)::text
  AND l.token = sqlc.arg(token)::bigint
  AND l.expires_at > now()
RETURNING CASE WHEN l.waiting_since > now() - interval '100 seconds'
               THEN pg_notify('pgfence_lock_released', l.name)::text END AS notified;

-- name: WaitGrant :one
-- WaitGrant is a waiter's attempt: it grants a free or expired lock exactly
-- as GrantLock or InsertLock do (granted = true, token, expiry), or marks a
-- held lock for wake-up (waiting_since = now(), unless the mark is under 30
-- seconds old) and returns granted = false with the holder and its expiry.
-- No row = the lock changed under the statement: try again at once.
WITH sc AS (
    SELECT set_config('synchronous_commit', 'on', true) AS sync
), upd AS (
    UPDATE pgfence.locks AS l
    SET token         = l.token + 1,
        holder        = sqlc.arg(holder)::text,
        acquired_at   = now(),
        renewed_at    = NULL,
        expires_at    = now() + sqlc.arg(ttl_us)::bigint * interval '1 microsecond'
    FROM sc
    WHERE l.name = sqlc.arg(name)::text
      AND (l.holder IS NULL OR l.expires_at <= now())
    RETURNING l.token, l.expires_at
), ins AS (
    INSERT INTO pgfence.locks AS l (name, token, holder, acquired_at, renewed_at, expires_at)
    SELECT sqlc.arg(name)::text, 1, sqlc.arg(holder)::text, now(), NULL,
           now() + sqlc.arg(ttl_us)::bigint * interval '1 microsecond'
    FROM sc
    WHERE NOT EXISTS (SELECT 1 FROM pgfence.locks AS e WHERE e.name = sqlc.arg(name)::text)
    ON CONFLICT (name) DO NOTHING
    RETURNING l.token, l.expires_at
), cur AS (
    SELECT l.holder, l.expires_at, l.waiting_since
    FROM pgfence.locks AS l
    WHERE l.name = sqlc.arg(name)::text
      AND l.holder IS NOT NULL
      AND l.expires_at > now()
), m AS (
    UPDATE pgfence.locks AS l
    SET waiting_since = now()
    FROM sc
    WHERE l.name = sqlc.arg(name)::text
      AND l.holder IS NOT NULL
      AND l.expires_at > now()
      AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '30 seconds')
    RETURNING l.holder, l.expires_at
)
SELECT true AS granted, upd.token, upd.expires_at, NULL::text AS holder, now()::timestamptz AS db_now FROM upd
UNION ALL
SELECT true, ins.token, ins.expires_at, NULL::text, now()::timestamptz FROM ins
UNION ALL
SELECT false, 0::bigint, COALESCE(m.expires_at, cur.expires_at), COALESCE(m.holder, cur.holder), now()::timestamptz
FROM cur LEFT JOIN m ON true
WHERE m.holder IS NOT NULL OR cur.waiting_since > now() - interval '30 seconds';

-- name: LockHolder :one
-- LockHolder returns a lock row with held = whether a holder has it now
-- (database clock).
SELECT name, token, holder, expires_at,
       COALESCE(holder IS NOT NULL AND expires_at > now(), false)::boolean AS held,
       now()::timestamptz AS db_now
FROM pgfence.locks
WHERE name = sqlc.arg(name)::text;
