-- A handoff's tag covers the lock's name. A waiter takes a tagged
-- pgfence_lock_handoff payload as its lease without reading the database;
-- until now the tag bound the wait (wkey, wait_id) and the grant (token,
-- expiry) but not the name, so a release that chose a waiter of another name
-- (as lock_release did under a caller's nondeterministic collation until
-- migration 00028) produced a payload the waiter took for the lease of the
-- name it waits for. The tag is now the hex of sha256(k || sha256(k || m ||
-- ' ' || name)), m the payload before the tag and name the lock row's name:
-- the payload's text does not change, and a waiter checks the tag with the
-- name it waits for, so a handoff of any other name's lease fails the check
-- and the waiter reads its lease in the database (lock_handed) instead. A
-- waiter that checks tags the old way (pgfence before this migration) finds
-- no tag that checks and reads every handed lease: slower, never wrong.
-- Answers, signature and grants do not change; the Down restores 00028's
-- body.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_release(name text, token bigint, key bytea,
    OUT released boolean, OUT handed_off boolean, OUT notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kh bytea;
BEGIN
    -- Every comparison of the name is under the database's default
    -- collation (COLLATE "default", which the primary key's index uses),
    -- never the caller's: a text argument carries the collation of the
    -- call, and a nondeterministic one (CREATE COLLATION pg_temp.ci ...,
    -- which any role may create) made 'orders-leader' match a row
    -- 'ORDERS-LEADER' and a waiter of 'orders-leader' the queue of the
    -- other. A holder of one name could hand its lease to a waiter of
    -- another, which took it for the lease it waited for.
    IF lock_release.name IS NULL OR octet_length(lock_release.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_release: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_release.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release.token IS NULL OR lock_release.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.lock_release: token must be > 0, got %',
            coalesce(lock_release.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release.key IS NULL OR octet_length(lock_release.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_release: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_release.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_release.key);
    released := false;
    handed_off := false;
    notified := false;
    UPDATE pgfence.locks AS l
    SET holder = NULL, key_hash = NULL, renewed_at = NULL, expires_at = NULL
    WHERE l.name = lock_release.name COLLATE "default" AND l.token = lock_release.token
      AND l.key_hash = kh AND l.expires_at > now()
      AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '100 seconds')
      AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                      WHERE q.name = lock_release.name COLLATE "default"
                        AND (q.granted_token IS NULL OR q.alive_until <= now()));
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        released := true;
        RETURN;
    END IF;
    -- The lock row first, then the queue row (nxt): the order of every
    -- other function that takes both (lock_wait locks the lock row in its
    -- main statement and its own queue row after; lock_release_many locks
    -- its lock rows first). Taking the queue row first deadlocked with a
    -- lock_wait of the same name.
    PERFORM 1 FROM pgfence.locks AS l
    WHERE l.name = lock_release.name COLLATE "default" AND l.token = lock_release.token
      AND l.key_hash = kh AND l.expires_at > now()
    FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;  -- lost: released, handed_off and notified are false
    END IF;
    WITH nxt AS (
        SELECT q.ticket, q.wkey, q.wait_id, q.holder, q.ttl_us, q.key_hash
        FROM pgfence.lock_queue AS q
        WHERE q.name = lock_release.name COLLATE "default" AND q.granted_token IS NULL AND q.alive_until > now()
        ORDER BY q.ticket
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    ), sc AS (
        -- A handoff is a grant: durable. A plain release is not.
        SELECT set_config('synchronous_commit',
                          CASE WHEN EXISTS (SELECT 1 FROM nxt) THEN 'on' ELSE 'off' END, true) AS sync
    ), rel AS (
        UPDATE pgfence.locks AS l
        SET token       = l.token + CASE WHEN n.ticket IS NULL THEN 0 ELSE 1 END,
            holder      = n.holder,
            key_hash    = n.key_hash,
            acquired_at = CASE WHEN n.ticket IS NULL THEN l.acquired_at ELSE now() END,
            renewed_at  = NULL,
            expires_at  = now() + n.ttl_us * interval '1 microsecond'
        FROM sc LEFT JOIN nxt AS n ON true
        WHERE l.name = lock_release.name COLLATE "default" AND l.token = lock_release.token
          AND l.key_hash = kh AND l.expires_at > now()
        RETURNING n.ticket, n.wkey, n.wait_id, l.token, l.name, l.waiting_since, l.expires_at, l.key_hash
    ), handed AS (
        -- The wait is over: the row stays for its Locker's next wait of the
        -- name for 10 seconds, then the next release deletes it (gc). Only a
        -- release of this lease (by the waiter) can run gc before it expires,
        -- so the row is there for the waiter to read its lease.
        UPDATE pgfence.lock_queue AS q
        SET granted_token = rel.token,
            alive_until   = now() + interval '10 seconds'
        FROM rel
        WHERE q.wkey = rel.wkey AND q.ticket = rel.ticket
        RETURNING q.ticket
    ), gc AS (
        DELETE FROM pgfence.lock_queue AS q
        USING rel
        WHERE q.name = rel.name AND q.alive_until <= now()
        RETURNING q.ticket
    )
    SELECT true,
           rel.ticket IS NOT NULL,
           (CASE WHEN rel.ticket IS NOT NULL
                     THEN pg_notify('pgfence_lock_handoff', msg.s || COALESCE(' ' || encode(
                              sha256(mk.k || sha256(mk.k || convert_to(msg.s || ' ' || rel.name, 'UTF8'))), 'hex'), ''))::text
                 WHEN rel.waiting_since > now() - interval '100 seconds'
                     THEN pg_notify('pgfence_lock_released', rel.name)::text END) IS NOT NULL
    INTO released, handed_off, notified
    FROM rel
    -- left_us: what is left of the lease now, on the server's clock. Its
    -- expiry counts from the start of this transaction (now()), which may
    -- precede the waiter's queueing; clock_timestamp() here follows the
    -- snapshot that saw the waiter queued, so a waiter that counts left_us
    -- from before it queued stops before the lease ends.
    CROSS JOIN LATERAL (SELECT rel.wkey || ' ' || rel.wait_id || ' ' || rel.token || ' '
                               || (extract(epoch FROM rel.expires_at) * 1000000)::bigint || ' '
                               || (extract(epoch FROM rel.expires_at - clock_timestamp()) * 1000000)::bigint AS s) AS msg
    -- The tag covers the payload and the lock's name (rel.name: the row
    -- this statement hands), which the waiter checks against the name it
    -- waits for.
    -- The waiter's handoff key (pgfence.lock_handoff_key): NULL, and the
    -- payload without a tag, if the secret is missing. Read through the
    -- primary key (h.id): lock_release_many runs this function with
    -- enable_seqscan off, and a disabled sequential scan's cost made the
    -- whole statement JIT-compiled (about 0.4 s per handoff).
    LEFT JOIN LATERAL (SELECT sha256(h.secret || rel.key_hash) AS k
                       FROM pgfence.handoff_secret AS h
                       WHERE h.id AND rel.ticket IS NOT NULL) AS mk ON true;
    IF NOT FOUND THEN
        released := false;
        handed_off := false;
        notified := false;
    END IF;
END
$fn$;
-- +goose StatementEnd


-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_release(name text, token bigint, key bytea,
    OUT released boolean, OUT handed_off boolean, OUT notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kh bytea;
BEGIN
    -- Every comparison of the name is under the database's default
    -- collation (COLLATE "default", which the primary key's index uses),
    -- never the caller's: a text argument carries the collation of the
    -- call, and a nondeterministic one (CREATE COLLATION pg_temp.ci ...,
    -- which any role may create) made 'orders-leader' match a row
    -- 'ORDERS-LEADER' and a waiter of 'orders-leader' the queue of the
    -- other. A holder of one name could hand its lease to a waiter of
    -- another, which took it for the lease it waited for.
    IF lock_release.name IS NULL OR octet_length(lock_release.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_release: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_release.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release.token IS NULL OR lock_release.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.lock_release: token must be > 0, got %',
            coalesce(lock_release.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release.key IS NULL OR octet_length(lock_release.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_release: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_release.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_release.key);
    released := false;
    handed_off := false;
    notified := false;
    UPDATE pgfence.locks AS l
    SET holder = NULL, key_hash = NULL, renewed_at = NULL, expires_at = NULL
    WHERE l.name = lock_release.name COLLATE "default" AND l.token = lock_release.token
      AND l.key_hash = kh AND l.expires_at > now()
      AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '100 seconds')
      AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                      WHERE q.name = lock_release.name COLLATE "default"
                        AND (q.granted_token IS NULL OR q.alive_until <= now()));
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        released := true;
        RETURN;
    END IF;
    -- The lock row first, then the queue row (nxt): the order of every
    -- other function that takes both (lock_wait locks the lock row in its
    -- main statement and its own queue row after; lock_release_many locks
    -- its lock rows first). Taking the queue row first deadlocked with a
    -- lock_wait of the same name.
    PERFORM 1 FROM pgfence.locks AS l
    WHERE l.name = lock_release.name COLLATE "default" AND l.token = lock_release.token
      AND l.key_hash = kh AND l.expires_at > now()
    FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;  -- lost: released, handed_off and notified are false
    END IF;
    WITH nxt AS (
        SELECT q.ticket, q.wkey, q.wait_id, q.holder, q.ttl_us, q.key_hash
        FROM pgfence.lock_queue AS q
        WHERE q.name = lock_release.name COLLATE "default" AND q.granted_token IS NULL AND q.alive_until > now()
        ORDER BY q.ticket
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    ), sc AS (
        -- A handoff is a grant: durable. A plain release is not.
        SELECT set_config('synchronous_commit',
                          CASE WHEN EXISTS (SELECT 1 FROM nxt) THEN 'on' ELSE 'off' END, true) AS sync
    ), rel AS (
        UPDATE pgfence.locks AS l
        SET token       = l.token + CASE WHEN n.ticket IS NULL THEN 0 ELSE 1 END,
            holder      = n.holder,
            key_hash    = n.key_hash,
            acquired_at = CASE WHEN n.ticket IS NULL THEN l.acquired_at ELSE now() END,
            renewed_at  = NULL,
            expires_at  = now() + n.ttl_us * interval '1 microsecond'
        FROM sc LEFT JOIN nxt AS n ON true
        WHERE l.name = lock_release.name COLLATE "default" AND l.token = lock_release.token
          AND l.key_hash = kh AND l.expires_at > now()
        RETURNING n.ticket, n.wkey, n.wait_id, l.token, l.name, l.waiting_since, l.expires_at, l.key_hash
    ), handed AS (
        -- The wait is over: the row stays for its Locker's next wait of the
        -- name for 10 seconds, then the next release deletes it (gc). Only a
        -- release of this lease (by the waiter) can run gc before it expires,
        -- so the row is there for the waiter to read its lease.
        UPDATE pgfence.lock_queue AS q
        SET granted_token = rel.token,
            alive_until   = now() + interval '10 seconds'
        FROM rel
        WHERE q.wkey = rel.wkey AND q.ticket = rel.ticket
        RETURNING q.ticket
    ), gc AS (
        DELETE FROM pgfence.lock_queue AS q
        USING rel
        WHERE q.name = rel.name AND q.alive_until <= now()
        RETURNING q.ticket
    )
    SELECT true,
           rel.ticket IS NOT NULL,
           (CASE WHEN rel.ticket IS NOT NULL
                     THEN pg_notify('pgfence_lock_handoff', msg.s || COALESCE(' ' || encode(
                              sha256(mk.k || sha256(mk.k || convert_to(msg.s, 'UTF8'))), 'hex'), ''))::text
                 WHEN rel.waiting_since > now() - interval '100 seconds'
                     THEN pg_notify('pgfence_lock_released', rel.name)::text END) IS NOT NULL
    INTO released, handed_off, notified
    FROM rel
    -- left_us: what is left of the lease now, on the server's clock. Its
    -- expiry counts from the start of this transaction (now()), which may
    -- precede the waiter's queueing; clock_timestamp() here follows the
    -- snapshot that saw the waiter queued, so a waiter that counts left_us
    -- from before it queued stops before the lease ends.
    CROSS JOIN LATERAL (SELECT rel.wkey || ' ' || rel.wait_id || ' ' || rel.token || ' '
                               || (extract(epoch FROM rel.expires_at) * 1000000)::bigint || ' '
                               || (extract(epoch FROM rel.expires_at - clock_timestamp()) * 1000000)::bigint AS s) AS msg
    -- The waiter's handoff key (pgfence.lock_handoff_key): NULL, and the
    -- payload without a tag, if the secret is missing. Read through the
    -- primary key (h.id): lock_release_many runs this function with
    -- enable_seqscan off, and a disabled sequential scan's cost made the
    -- whole statement JIT-compiled (about 0.4 s per handoff).
    LEFT JOIN LATERAL (SELECT sha256(h.secret || rel.key_hash) AS k
                       FROM pgfence.handoff_secret AS h
                       WHERE h.id AND rel.ticket IS NOT NULL) AS mk ON true;
    IF NOT FOUND THEN
        released := false;
        handed_off := false;
        notified := false;
    END IF;
END
$fn$;
-- +goose StatementEnd
