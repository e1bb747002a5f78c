-- name: GrantLock :one
-- GrantLock grants a free (holder NULL) or expired lock to holder in ONE
-- statement: token + 1, expiry now() + ttl_us microseconds; no row when the
-- lock is held or has no row yet (then InsertLock creates it). It is a plain
-- UPDATE whose WHERE tests free-or-expired: when the lock is held it matches
-- nothing, so a refused attempt takes no row lock, writes nothing and
-- commits without a WAL flush (INSERT ... ON CONFLICT DO UPDATE ... WHERE
-- would lock the held row and wait for its holder even when the WHERE is
-- false). The set_config turns synchronous_commit on for this statement's
-- own transaction (is_local = true; commit reads the setting before the
-- transaction's settings are reset), so an acknowledged token survives a
-- crash even when the server default is off, at no extra round trip. Like
-- every statement of this file it runs alone, in an implicit transaction of
-- one statement, so now() is the time the statement started on the
-- database's clock (see pglock/doc.go for why now() and not
-- clock_timestamp()). token + 1 at the bigint maximum fails with SQLSTATE
-- 22003 and changes nothing. A grant leaves waiting_since alone (see
-- WaitGrant).
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
-- 1, expiry now() + ttl_us microseconds, synchronous_commit on as in
-- GrantLock. Of two first grants racing, one inserts and the other gets no
-- row and tries GrantLock again.
INSERT INTO pgfence.locks AS l (name, token, holder, acquired_at, renewed_at, expires_at)
SELECT sqlc.arg(name)::text, 1, sqlc.arg(holder)::text, now(), NULL,
       now() + sqlc.arg(ttl_us)::bigint * interval '1 microsecond'
FROM (SELECT set_config('synchronous_commit', 'on', true) AS sync) AS sc
ON CONFLICT (name) DO NOTHING
RETURNING l.token, l.expires_at;

-- name: RenewLock :one
-- RenewLock extends a lease that is still held by (name, holder, token) to
-- now() + ttl_us microseconds, with synchronous_commit on for its transaction
-- (a lost renewal would leave the client believing in a longer lease than the
-- database's). No row = the lease was lost (expired, released or re-granted).
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
-- expiry become NULL, the row and its token stay. If a waiter marked the
-- lock in the last 100 seconds (waiting_since, see WaitGrant), it notifies
-- channel pgfence_lock_released with the lock name as payload (delivered at
-- commit) so waiters wake. 0 rows = the lease was lost; nothing changed.
UPDATE pgfence.locks AS l
SET holder = NULL, expires_at = NULL, renewed_at = NULL
WHERE l.name = sqlc.arg(name)::text
  AND l.holder = sqlc.arg(holder)::text
  AND l.token = sqlc.arg(token)::bigint
  AND l.expires_at > now()
RETURNING CASE WHEN l.waiting_since > now() - interval '100 seconds'
               THEN pg_notify('pgfence_lock_released', l.name)::text END AS notified;

-- name: WaitGrant :one
-- WaitGrant is the attempt of a waiter (one that will sleep until a release
-- notification or the holder's expiry when refused): a grant and a wait
-- mark in ONE statement, so a refused waiter costs one round trip. A free
-- or expired lock is granted exactly as by GrantLock (granted = true, token
-- and expiry). A held lock is marked (waiting_since = now(): releases in the
-- next 100 seconds send a NOTIFY) and the row comes back with granted =
-- false, the holder and its expiry for the waiter's timer. A mark less than
-- 30 seconds old in this statement's snapshot is not written again, and
-- grants leave it alone, so a hot lock costs one mark write per 30 seconds,
-- not one per handoff. The windows fit the waiter's longest sleep (one
-- minute plus jitter, then it tries again): a waiter that relied on a mark
-- at most 30 seconds old when it went to sleep wakes up by itself before
-- that mark is 100 seconds old, so every release while it sleeps notifies. The two UPDATEs
-- can never both change the row: in the statement's snapshot the lock is
-- either free or expired (only the grant can match) or held (only the mark
-- can), and a row changed concurrently is re-checked by each against its
-- own condition. No row = the lock changed between the snapshot and the
-- statement (released or re-granted): the waiter tries again at once
-- instead of sleeping on a stale holder. The mark and a release lock the
-- same row, so either the release sees the mark and notifies, or the mark
-- sees the release and the statement returns no row.
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
