-- name: GrantLock :one
-- GrantLock grants a free or expired lock to holder: token + 1, expiry
-- now() + ttl_us microseconds, synchronous_commit on for this statement's
-- transaction. No row when the lock is held (nothing is locked or written)
-- or has no row yet (InsertLock creates it). At the bigint maximum it fails
-- with SQLSTATE 22003 and changes nothing. docs/design.md explains the shape.
UPDATE pgfence.locks AS l
SET token       = (l.token OPERATOR(pg_catalog.+) 1),
    holder      = sqlc.arg(holder)::pg_catalog.text,
    acquired_at = pg_catalog.now(),
    renewed_at  = NULL,
    expires_at  = (pg_catalog.now() OPERATOR(pg_catalog.+) (sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog.*) interval '1 microsecond'))
FROM (SELECT pg_catalog.set_config('synchronous_commit', 'on', true) AS sync) AS sc
WHERE (l.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
  AND (l.holder IS NULL OR (l.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()))
RETURNING l.token, l.expires_at;

-- name: InsertLock :one
-- InsertLock is the first grant of a lock name, which has no row yet: token
-- 1, expiry now() + ttl_us microseconds, synchronous_commit on. No row when a
-- concurrent first grant inserted it (try GrantLock again).
INSERT INTO pgfence.locks AS l (name, token, holder, acquired_at, renewed_at, expires_at)
SELECT sqlc.arg(name)::pg_catalog.text, 1, sqlc.arg(holder)::pg_catalog.text, pg_catalog.now(), NULL,
       (pg_catalog.now() OPERATOR(pg_catalog.+) (sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog.*) interval '1 microsecond'))
FROM (SELECT pg_catalog.set_config('synchronous_commit', 'on', true) AS sync) AS sc
ON CONFLICT (name) DO NOTHING
RETURNING l.token, l.expires_at;

-- name: RenewLock :one
-- RenewLock extends a lease still held by (name, holder, token) to now() +
-- ttl_us microseconds, synchronous_commit on. No row = the lease was lost
-- (expired, released or re-granted).
UPDATE pgfence.locks AS l
SET expires_at = (pg_catalog.now() OPERATOR(pg_catalog.+) (sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog.*) interval '1 microsecond')),
    renewed_at = pg_catalog.now()
FROM (SELECT pg_catalog.set_config('synchronous_commit', 'on', true) AS sync) AS sc
WHERE (l.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
  AND (l.holder OPERATOR(pg_catalog.=) sqlc.arg(holder)::pg_catalog.text)
  AND (l.token OPERATOR(pg_catalog.=) sqlc.arg(token)::bigint)
  AND (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now())
RETURNING l.expires_at, pg_catalog.now()::pg_catalog.timestamptz AS db_now;

-- name: ReleaseLock :one
-- ReleaseLock ends a lease still held by (name, holder, token). If a live
-- waiter is queued for the name (pgfence.lock_queue), the lease is handed to
-- the first one in the same statement (token + 1, expiry now() + its TTL,
-- synchronous_commit on) and pgfence_lock_handoff is notified with its wkey,
-- the wait_id of its wait, the new token and the new expiry in microseconds
-- since the Unix epoch (payload "wkey wait_id token expiry_us");
-- otherwise holder and expiry become NULL and, if a waiter marked the row in
-- the last 100 seconds, pgfence_lock_released is notified with the name.
-- Rows of the name whose alive_until has passed are deleted: dead waiters,
-- and ended waits (kept 10 seconds for their Locker's next wait). No row =
-- the lease was lost; nothing changed.
WITH nxt AS (
    SELECT q.ticket, q.wkey, q.wait_id, q.holder, q.ttl_us
    FROM pgfence.lock_queue AS q
    WHERE (q.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
      AND q.granted_token IS NULL
      AND (q.alive_until OPERATOR(pg_catalog.>) pg_catalog.now())
    ORDER BY q.ticket
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), sc AS (
    -- A handoff is a grant: durable. A plain release does not wait for the
    -- flush: lost in a crash, it only keeps the lock until its expiry (the
    -- token is not re-issued), and a later grant that saw it flushes it.
    SELECT pg_catalog.set_config('synchronous_commit',
                      CASE WHEN EXISTS (SELECT 1 FROM nxt) THEN 'on' ELSE 'off' END, true) AS sync
), rel AS (
    UPDATE pgfence.locks AS l
    SET token       = (l.token OPERATOR(pg_catalog.+) CASE WHEN n.ticket IS NULL THEN 0 ELSE 1 END),
        holder      = n.holder,
        acquired_at = CASE WHEN n.ticket IS NULL THEN l.acquired_at ELSE pg_catalog.now() END,
        renewed_at  = NULL,
        expires_at  = (pg_catalog.now() OPERATOR(pg_catalog.+) (n.ttl_us OPERATOR(pg_catalog.*) interval '1 microsecond'))
    FROM sc LEFT JOIN nxt AS n ON true
    WHERE (l.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
      AND (l.holder OPERATOR(pg_catalog.=) sqlc.arg(holder)::pg_catalog.text)
      AND (l.token OPERATOR(pg_catalog.=) sqlc.arg(token)::bigint)
      AND (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now())
    RETURNING n.ticket, n.wkey, n.wait_id, l.token, l.name, l.waiting_since, l.expires_at
), handed AS (
    -- The wait is over: the row stays for its Locker's next wait of the
    -- name for 10 seconds, then the next release deletes it (gc). Only a
    -- release of this lease (by the waiter) can run gc before it expires,
    -- so the row is there for the waiter to read its lease.
    UPDATE pgfence.lock_queue AS q
    SET granted_token = rel.token,
        alive_until   = (pg_catalog.now() OPERATOR(pg_catalog.+) interval '10 seconds')
    FROM rel
    WHERE (q.wkey OPERATOR(pg_catalog.=) rel.wkey)
      AND (q.ticket OPERATOR(pg_catalog.=) rel.ticket)
    RETURNING q.ticket
), gc AS (
    DELETE FROM pgfence.lock_queue AS q
    USING rel
    WHERE (q.name OPERATOR(pg_catalog.=) rel.name)
      AND (q.alive_until OPERATOR(pg_catalog.<=) pg_catalog.now())
    RETURNING q.ticket
)
SELECT (rel.ticket IS NOT NULL)::boolean AS handed_off,
       ((CASE WHEN rel.ticket IS NOT NULL
                  THEN pg_catalog.pg_notify('pgfence_lock_handoff',
                                 ((((((rel.wkey::pg_catalog.text OPERATOR(pg_catalog.||) ' ') OPERATOR(pg_catalog.||) rel.wait_id::pg_catalog.text) OPERATOR(pg_catalog.||) ' ') OPERATOR(pg_catalog.||) rel.token::pg_catalog.text) OPERATOR(pg_catalog.||) ' ') OPERATOR(pg_catalog.||) ((extract(epoch FROM rel.expires_at) OPERATOR(pg_catalog.*) 1000000))::bigint::pg_catalog.text))::pg_catalog.text
             WHEN (rel.waiting_since OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) interval '100 seconds'))
                  THEN pg_catalog.pg_notify('pgfence_lock_released', rel.name)::pg_catalog.text END) IS NOT NULL)::boolean AS notified
FROM rel;

-- name: ReleaseUnwaitedLock :one
-- ReleaseUnwaitedLock is ReleaseLock for a lock nobody waits for, in one
-- plain UPDATE: it ends the lease held by (name, holder, token) only if no
-- waiter is queued for the name (no pgfence.lock_queue row of the name still
-- waiting, granted_token NULL, and none past its alive_until) and no
-- waiter marked the lock row in the last 100 seconds. ReleaseLock would then
-- hand nothing over, delete no queue row and notify nobody; the result is
-- the same row (holder and expiry NULL, token kept), committed without
-- waiting for the flush like ReleaseLock's plain release. Rows of ended waits
-- whose alive_until has passed also send the release to ReleaseLock, which
-- deletes them. A waiter whose
-- queue row or mark is not committed yet either conflicts on the lock row
-- (its mark) or sees the release and tries again. No row = the lease was
-- lost, or someone may be waiting: run ReleaseLock, which tells the two
-- apart.
UPDATE pgfence.locks AS l
SET holder     = NULL,
    renewed_at = NULL,
    expires_at = NULL
FROM (SELECT pg_catalog.set_config('synchronous_commit', 'off', true) AS sync) AS sc
WHERE (l.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
  AND (l.holder OPERATOR(pg_catalog.=) sqlc.arg(holder)::pg_catalog.text)
  AND (l.token OPERATOR(pg_catalog.=) sqlc.arg(token)::bigint)
  AND (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now())
  AND (l.waiting_since IS NULL OR (l.waiting_since OPERATOR(pg_catalog.<=) (pg_catalog.now() OPERATOR(pg_catalog.-) interval '100 seconds')))
  AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                  WHERE (q.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
                    AND (q.granted_token IS NULL OR (q.alive_until OPERATOR(pg_catalog.<=) pg_catalog.now())))
RETURNING l.token;

-- name: QueueGrant :one
-- QueueGrant is a waiter's attempt (LISTEN mode): it grants a free or expired
-- lock exactly as GrantLock or InsertLock do and ends the waiter's wait
-- (granted_token 0: no release serves the row again); returns a lease a
-- release handed to this wait (wkey, wait_id); or, the lock being held by
-- someone else, queues the wait (or, once half its TTL is gone, pushes its
-- alive_until to now() + its TTL), marks the row for wake-up as WaitGrant
-- does and returns granted = false with the holder and its expiry. A wait
-- whose wait_id the row of wkey does not have yet (a new wait of the key)
-- reuses that row, left by an ended wait, with a new ticket (an update in
-- place); nothing handed to an earlier wait is returned. It commits with
-- synchronous_commit on when it granted, off otherwise. No row = the lock
-- changed under the statement: try again at once.
WITH handed AS (
    SELECT l.token, l.expires_at
    FROM pgfence.lock_queue AS q
    JOIN pgfence.locks AS l ON (l.name OPERATOR(pg_catalog.=) q.name) AND (l.token OPERATOR(pg_catalog.=) q.granted_token) AND (l.holder OPERATOR(pg_catalog.=) q.holder)
    WHERE (q.wkey OPERATOR(pg_catalog.=) sqlc.arg(wkey)::bigint)
      AND (q.wait_id OPERATOR(pg_catalog.=) sqlc.arg(wait_id)::bigint)
      AND (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now())
), upd AS (
    UPDATE pgfence.locks AS l
    SET token         = (l.token OPERATOR(pg_catalog.+) 1),
        holder        = sqlc.arg(holder)::pg_catalog.text,
        acquired_at   = pg_catalog.now(),
        renewed_at    = NULL,
        expires_at    = (pg_catalog.now() OPERATOR(pg_catalog.+) (sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog.*) interval '1 microsecond'))
    WHERE (l.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
      AND (l.holder IS NULL OR (l.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()))
    RETURNING l.token, l.expires_at
), ins AS (
    INSERT INTO pgfence.locks AS l (name, token, holder, acquired_at, renewed_at, expires_at)
    SELECT sqlc.arg(name)::pg_catalog.text, 1, sqlc.arg(holder)::pg_catalog.text, pg_catalog.now(), NULL,
           (pg_catalog.now() OPERATOR(pg_catalog.+) (sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog.*) interval '1 microsecond'))
    WHERE NOT EXISTS (SELECT 1 FROM pgfence.locks AS e WHERE (e.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text))
    ON CONFLICT (name) DO NOTHING
    RETURNING l.token, l.expires_at
), cur AS (
    SELECT l.holder, l.expires_at, l.waiting_since
    FROM pgfence.locks AS l
    WHERE (l.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
      AND l.holder IS NOT NULL
      AND (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now())
      AND NOT EXISTS (SELECT 1 FROM handed)
), m AS (
    UPDATE pgfence.locks AS l
    SET waiting_since = pg_catalog.now()
    WHERE (l.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
      AND l.holder IS NOT NULL
      AND (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now())
      AND (l.waiting_since IS NULL OR (l.waiting_since OPERATOR(pg_catalog.<=) (pg_catalog.now() OPERATOR(pg_catalog.-) interval '30 seconds')))
      AND NOT EXISTS (SELECT 1 FROM handed)
    RETURNING l.holder, l.expires_at
), enq AS (
    -- Unless this wait is queued already: a new wait, or this wait's row is
    -- gone (deleted as dead) or was handed a lease that has ended since.
    -- Queue with a new ticket, reusing the row of wkey if there is one.
    INSERT INTO pgfence.lock_queue AS q (wkey, wait_id, name, holder, ttl_us, alive_until)
    SELECT sqlc.arg(wkey)::bigint, sqlc.arg(wait_id)::bigint, sqlc.arg(name)::pg_catalog.text, sqlc.arg(holder)::pg_catalog.text,
           sqlc.arg(ttl_us)::bigint, (pg_catalog.now() OPERATOR(pg_catalog.+) (sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog.*) interval '1 microsecond'))
    FROM cur
    WHERE NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS e
                      WHERE (e.wkey OPERATOR(pg_catalog.=) sqlc.arg(wkey)::bigint)
                        AND (e.wait_id OPERATOR(pg_catalog.=) sqlc.arg(wait_id)::bigint)
                        AND e.granted_token IS NULL)
    ON CONFLICT (wkey) DO UPDATE
    SET ticket        = DEFAULT,
        wait_id       = EXCLUDED.wait_id,
        name          = EXCLUDED.name,
        holder        = EXCLUDED.holder,
        ttl_us        = EXCLUDED.ttl_us,
        alive_until   = EXCLUDED.alive_until,
        granted_token = NULL
    RETURNING q.ticket
), refresh AS (
    -- Only once half of the waiter's TTL is gone: a row locked by a refresh
    -- is skipped by a concurrent release.
    UPDATE pgfence.lock_queue AS q
    SET alive_until = (pg_catalog.now() OPERATOR(pg_catalog.+) (sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog.*) interval '1 microsecond'))
    FROM cur
    WHERE (q.wkey OPERATOR(pg_catalog.=) sqlc.arg(wkey)::bigint)
      AND (q.wait_id OPERATOR(pg_catalog.=) sqlc.arg(wait_id)::bigint)
      AND (q.name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text)
      AND q.granted_token IS NULL
      AND (q.alive_until OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.+) (((sqlc.arg(ttl_us)::bigint OPERATOR(pg_catalog./) 2)) OPERATOR(pg_catalog.*) interval '1 microsecond')))
    RETURNING q.ticket
), end_own AS (
    -- Granted here: this wait is over, no release may serve its row; it
    -- stays for the Locker's next wait for 10 seconds, as after a handoff.
    UPDATE pgfence.lock_queue AS q
    SET granted_token = 0,
        alive_until   = (pg_catalog.now() OPERATOR(pg_catalog.+) interval '10 seconds')
    WHERE (q.wkey OPERATOR(pg_catalog.=) sqlc.arg(wkey)::bigint)
      AND q.granted_token IS NULL
      AND EXISTS (SELECT 1 FROM upd UNION ALL SELECT 1 FROM ins)
    RETURNING q.ticket
), dur AS (
    -- Read at commit: only a grant must survive a crash (on); a queue row or
    -- wait mark lost with the server is written again by the waiter when its
    -- listener reconnects (off). A grant returns a row, so this is evaluated
    -- whenever one happened; it reads upd and ins, so it runs after them.
    SELECT pg_catalog.set_config('synchronous_commit',
                      CASE WHEN EXISTS (SELECT 1 FROM upd) OR EXISTS (SELECT 1 FROM ins) THEN 'on' ELSE 'off' END,
                      true) AS sync
)
SELECT r.granted, r.token, r.expires_at, r.holder, r.db_now
FROM (
    SELECT true AS granted, handed.token, handed.expires_at, NULL::pg_catalog.text AS holder, pg_catalog.now()::pg_catalog.timestamptz AS db_now FROM handed
    UNION ALL
    SELECT true, upd.token, upd.expires_at, NULL::pg_catalog.text, pg_catalog.now()::pg_catalog.timestamptz FROM upd
    UNION ALL
    SELECT true, ins.token, ins.expires_at, NULL::pg_catalog.text, pg_catalog.now()::pg_catalog.timestamptz FROM ins
    UNION ALL
    SELECT false, 0::bigint, COALESCE(m.expires_at, cur.expires_at), COALESCE(m.holder, cur.holder), pg_catalog.now()::pg_catalog.timestamptz
    FROM cur LEFT JOIN m ON true
    WHERE m.holder IS NOT NULL OR (cur.waiting_since OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) interval '30 seconds'))
) AS r CROSS JOIN dur;

-- name: HandedLock :one
-- HandedLock returns the lease a release handed to the wait (wkey, wait_id),
-- if it is still held (token, expiry, database time). No row = nothing was
-- handed (or it already expired). Reads only.
SELECT l.token, l.expires_at, pg_catalog.now()::pg_catalog.timestamptz AS db_now
FROM pgfence.lock_queue AS q
JOIN pgfence.locks AS l ON (l.name OPERATOR(pg_catalog.=) q.name) AND (l.token OPERATOR(pg_catalog.=) q.granted_token) AND (l.holder OPERATOR(pg_catalog.=) q.holder)
WHERE (q.wkey OPERATOR(pg_catalog.=) sqlc.arg(wkey)::bigint)
  AND (q.wait_id OPERATOR(pg_catalog.=) sqlc.arg(wait_id)::bigint)
  AND (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now());

-- name: LeaveQueue :one
-- LeaveQueue removes the waiter wkey from the queue and returns the token of
-- a lease a release handed to its wait wait_id meanwhile (0 if none, or if
-- the row holds another wait's grant): the caller releases that lease. A concurrent release that
-- picked this row finishes first (the row is locked), so its handoff is seen
-- here.
DELETE FROM pgfence.lock_queue AS q
WHERE (q.wkey OPERATOR(pg_catalog.=) sqlc.arg(wkey)::bigint)
RETURNING (CASE WHEN (q.wait_id OPERATOR(pg_catalog.=) sqlc.arg(wait_id)::bigint) THEN COALESCE(q.granted_token, 0) ELSE 0 END)::bigint
          AS granted_token;

-- name: LockHolder :one
-- LockHolder returns a lock row with held = whether a holder has it now
-- (database clock).
SELECT name, token, holder, expires_at,
       COALESCE(holder IS NOT NULL AND (expires_at OPERATOR(pg_catalog.>) pg_catalog.now()), false)::boolean AS held,
       pg_catalog.now()::pg_catalog.timestamptz AS db_now
FROM pgfence.locks
WHERE (name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text);
