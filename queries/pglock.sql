-- The lease statements are calls of the lease functions of the schema
-- (migrations/00001_pgfence.sql, "Functions: leases and the lock queue"),
-- which hold every rule: a client in another language calls the same ones.
-- sqlc types each column from the function's OUT parameters.

-- name: GrantLock :one
-- GrantLock grants a free, expired or new lock to holder (pgfence.lock_grant):
-- token set when granted; token NULL with held_by and expires_at of the holder
-- when held; token and held_by NULL when the lock changed under the call
-- (call again).
SELECT g.token, g.expires_at,
       g.held_by, g.db_now
FROM pgfence.lock_grant(sqlc.arg(name)::pg_catalog.text, sqlc.arg(holder)::pg_catalog.text, sqlc.arg(ttl_us)::bigint, sqlc.arg(key)::pg_catalog.bytea) AS g;

-- name: RenewLock :one
-- RenewLock extends the lease (name, token) held with key
-- (pgfence.lock_renew). expires_at NULL = the lease was lost.
SELECT g.expires_at, g.db_now
FROM pgfence.lock_renew(sqlc.arg(name)::pg_catalog.text, sqlc.arg(token)::bigint, sqlc.arg(key)::pg_catalog.bytea, sqlc.arg(ttl_us)::bigint) AS g;

-- name: RenewLocks :many
-- RenewLocks extends every lease (names[i], tokens[i]) held with key
-- (pgfence.lock_renew_many): a row per lease renewed; a lease without one
-- was lost.
SELECT g.name::pg_catalog.text AS name, g.token::bigint AS token, g.expires_at::pg_catalog.timestamptz AS expires_at
FROM pgfence.lock_renew_many(sqlc.arg(names)::pg_catalog.text[], sqlc.arg(tokens)::bigint[], sqlc.arg(key)::pg_catalog.bytea, sqlc.arg(ttls_us)::bigint[]) AS g;

-- name: ReleaseLock :one
-- ReleaseLock ends the lease (name, token) held with key, handing it to the
-- first live waiter if there is one (pgfence.lock_release). released false =
-- the lease was lost; nothing changed.
SELECT g.released, g.handed_off, g.notified
FROM pgfence.lock_release(sqlc.arg(name)::pg_catalog.text, sqlc.arg(token)::bigint, sqlc.arg(key)::pg_catalog.bytea) AS g;

-- name: QueueGrant :one
-- QueueGrant is a waiter's attempt (LISTEN mode, pgfence.lock_wait): granted
-- with token and expires_at; or queued, granted false with held_by and
-- expires_at; granted NULL: the lock changed under the call (call again).
SELECT g.granted, g.token, g.expires_at,
       g.held_by, g.db_now
FROM pgfence.lock_wait(sqlc.arg(name)::pg_catalog.text, sqlc.arg(holder)::pg_catalog.text, sqlc.arg(ttl_us)::bigint, sqlc.arg(key)::pg_catalog.bytea,
                       sqlc.arg(wkey)::bigint, sqlc.arg(wait_id)::bigint) AS g;

-- name: HandedLock :one
-- HandedLock returns the lease a release handed to the wait (wkey, wait_id)
-- queued with key, if still held (pgfence.lock_handed): token NULL = none.
SELECT g.token, g.expires_at, g.db_now
FROM pgfence.lock_handed(sqlc.arg(wkey)::bigint, sqlc.arg(wait_id)::bigint, sqlc.arg(key)::pg_catalog.bytea) AS g;

-- name: HandoffKey :one
-- HandoffKey returns the handoff key of the lease key key
-- (pgfence.lock_handoff_key): it checks the tag of a handoff notification.
SELECT pgfence.lock_handoff_key(sqlc.arg(key)::pg_catalog.bytea)::pg_catalog.bytea AS handoff_key;

-- name: LeaveQueue :one
-- LeaveQueue takes the wait (wkey, wait_id) queued with key out of the
-- queue (pgfence.lock_leave) and returns the token of a lease handed to that
-- wait meanwhile and still live (0 if none, or if it has expired or ended:
-- since migration 00032): the caller releases it.
SELECT g.removed, g.granted_token
FROM pgfence.lock_leave(sqlc.arg(wkey)::bigint, sqlc.arg(wait_id)::bigint, sqlc.arg(key)::pg_catalog.bytea) AS g;

-- name: LockHolder :one
-- LockHolder returns a lock row with held = whether a holder has it now
-- (database clock).
SELECT name, token, holder, expires_at, acquired_at,
       COALESCE(holder IS NOT NULL AND (expires_at OPERATOR(pg_catalog.>) pg_catalog.now()), false)::boolean AS held,
       pg_catalog.now()::pg_catalog.timestamptz AS db_now
FROM pgfence.locks
WHERE (name OPERATOR(pg_catalog.=) sqlc.arg(name)::pg_catalog.text);

-- name: GrantLocks :many
-- GrantLocks grants each lease names[i] to holder for ttls_us[i] as
-- GrantLock does, in one statement (pgfence.lock_grant_many): a row per
-- element, i its position (1-based); token 0 = not granted, held_by '' =
-- no holder (a holder is never empty).
SELECT g.i::integer AS i, coalesce(g.token, 0)::bigint AS token, (g.expires_at IS NOT NULL)::boolean AS has_expiry,
       coalesce(g.expires_at, g.db_now)::pg_catalog.timestamptz AS expires_at, coalesce(g.held_by, '')::pg_catalog.text AS held_by,
       g.exhausted::boolean AS exhausted, g.db_now::pg_catalog.timestamptz AS db_now
FROM pgfence.lock_grant_many(sqlc.arg(names)::pg_catalog.text[], sqlc.arg(holder)::pg_catalog.text, sqlc.arg(ttls_us)::bigint[], sqlc.arg(key)::pg_catalog.bytea) AS g;

-- name: ReleaseLocks :many
-- ReleaseLocks ends each lease (names[i], tokens[i]) held with key as
-- ReleaseLock does, in one statement (pgfence.lock_release_many): a row per
-- element, i its position (1-based).
SELECT g.i::integer AS i, g.released::boolean AS released, g.handed_off::boolean AS handed_off, g.notified::boolean AS notified
FROM pgfence.lock_release_many(sqlc.arg(names)::pg_catalog.text[], sqlc.arg(tokens)::bigint[], sqlc.arg(key)::pg_catalog.bytea) AS g;
