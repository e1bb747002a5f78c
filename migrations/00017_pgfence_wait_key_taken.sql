-- pgfence.lock_wait refuses a wkey whose queue row another key holds, with
-- PF013 (the caller waits again with a new random wkey), before it grants or
-- queues anything. A wkey is visible to every role that listens for handoff
-- payloads; a role with EXECUTE could queue under a waiter's wkey when its row
-- was gone (deleted 10 seconds after its wait ended, while the Locker keeps
-- the wkey for its next wait of the name). The waiter's calls then changed
-- nothing (the queue row's ON CONFLICT ... WHERE key_hash matched nothing)
-- and reported it queued: no release handed it the lease, and it waited for
-- the holder's expiry instead of its turn. It is checked again after the wait's
-- statement, in a snapshot of its own, for a row that another key's
-- transaction committed while the statement waited for it. Answers for a wkey not held by
-- another key, the signature and grants do not change; the Down restores
-- 00001's body and comment.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_wait(name text, holder text, ttl_us bigint, key bytea, wkey bigint, wait_id bigint,
    OUT granted boolean, OUT token bigint, OUT expires_at timestamptz, OUT held_by text, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kh bytea;
BEGIN
    IF lock_wait.name IS NULL OR octet_length(lock_wait.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_wait.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.holder IS NULL OR octet_length(lock_wait.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_wait.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.ttl_us IS NULL OR lock_wait.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_wait.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.key IS NULL OR octet_length(lock_wait.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_wait.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.wkey IS NULL OR lock_wait.wait_id IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_wait: wkey and wait_id must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_wait.key);
    -- The queue row of wkey is the key's that queued it: a wkey queued under
    -- another key (anyone may read wkeys in handoff payloads) would leave
    -- this wait out of the queue while it reports queued.
    IF EXISTS (SELECT 1 FROM pgfence.lock_queue AS e
               WHERE e.wkey = lock_wait.wkey AND e.key_hash <> kh) THEN
        RAISE EXCEPTION 'pgfence.lock_wait: wkey % is queued under another key: wait with a new random wkey',
            lock_wait.wkey USING ERRCODE = 'PF013';
    END IF;
    WITH handed AS (
        SELECT l.token, l.expires_at
        FROM pgfence.lock_queue AS q
        JOIN pgfence.locks AS l ON l.name = q.name AND l.token = q.granted_token AND l.key_hash = q.key_hash
        WHERE q.wkey = lock_wait.wkey AND q.wait_id = lock_wait.wait_id AND q.key_hash = kh
          AND l.expires_at > now()
    ), upd AS (
        UPDATE pgfence.locks AS l
        SET token       = l.token + 1,
            holder      = lock_wait.holder,
            key_hash    = kh,
            acquired_at = now(),
            renewed_at  = NULL,
            expires_at  = now() + lock_wait.ttl_us * interval '1 microsecond'
        WHERE l.name = lock_wait.name AND (l.holder IS NULL OR l.expires_at <= now())
          AND NOT EXISTS (SELECT 1 FROM handed)
        RETURNING l.token, l.expires_at
    ), ins AS (
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        SELECT lock_wait.name, 1, lock_wait.holder, kh, now(), NULL,
               now() + lock_wait.ttl_us * interval '1 microsecond'
        WHERE NOT EXISTS (SELECT 1 FROM pgfence.locks AS e WHERE e.name = lock_wait.name)
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at
    ), cur AS (
        SELECT l.holder, l.expires_at, l.waiting_since
        FROM pgfence.locks AS l
        WHERE l.name = lock_wait.name AND l.holder IS NOT NULL AND l.expires_at > now()
          AND NOT EXISTS (SELECT 1 FROM handed)
    ), m AS (
        UPDATE pgfence.locks AS l
        SET waiting_since = now()
        WHERE l.name = lock_wait.name AND l.holder IS NOT NULL AND l.expires_at > now()
          AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '30 seconds')
          AND NOT EXISTS (SELECT 1 FROM handed)
        RETURNING l.holder, l.expires_at
    ), enq AS (
        -- Unless this wait is queued already: a new wait, or this wait's row
        -- is gone (deleted as dead) or was handed a lease that has ended
        -- since. Queue with a new ticket, reusing the row of wkey if it holds
        -- this key's hash.
        INSERT INTO pgfence.lock_queue AS q (wkey, wait_id, name, holder, key_hash, ttl_us, alive_until)
        SELECT lock_wait.wkey, lock_wait.wait_id, lock_wait.name, lock_wait.holder, kh,
               lock_wait.ttl_us, now() + lock_wait.ttl_us * interval '1 microsecond'
        FROM cur
        WHERE NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS e
                          WHERE e.wkey = lock_wait.wkey AND e.wait_id = lock_wait.wait_id
                            AND e.granted_token IS NULL)
        ON CONFLICT ON CONSTRAINT lock_queue_pkey DO UPDATE
        SET ticket        = DEFAULT,
            wait_id       = EXCLUDED.wait_id,
            name          = EXCLUDED.name,
            holder        = EXCLUDED.holder,
            ttl_us        = EXCLUDED.ttl_us,
            alive_until   = EXCLUDED.alive_until,
            granted_token = NULL
        WHERE q.key_hash = EXCLUDED.key_hash
        RETURNING q.ticket
    ), refresh AS (
        -- Only once half of the waiter's TTL is gone: a row locked by a
        -- refresh is skipped by a concurrent release.
        UPDATE pgfence.lock_queue AS q
        SET alive_until = now() + lock_wait.ttl_us * interval '1 microsecond'
        FROM cur
        WHERE q.wkey = lock_wait.wkey AND q.wait_id = lock_wait.wait_id AND q.key_hash = kh
          AND q.name = lock_wait.name AND q.granted_token IS NULL
          AND q.alive_until < now() + (lock_wait.ttl_us / 2) * interval '1 microsecond'
        RETURNING q.ticket
    ), end_own AS (
        -- Granted here: this wait is over, no release may serve its row; it
        -- stays for the Locker's next wait for 10 seconds, as after a handoff.
        UPDATE pgfence.lock_queue AS q
        SET granted_token = 0,
            alive_until   = now() + interval '10 seconds'
        WHERE q.wkey = lock_wait.wkey AND q.key_hash = kh AND q.granted_token IS NULL
          AND EXISTS (SELECT 1 FROM upd UNION ALL SELECT 1 FROM ins)
        RETURNING q.ticket
    ), dur AS (
        -- Read at commit: only a grant must survive a crash (on); a queue row
        -- or wait mark lost with the server is written again by the waiter
        -- when its listener reconnects (off). It reads upd and ins, so it runs
        -- after them.
        SELECT set_config('synchronous_commit',
                          CASE WHEN EXISTS (SELECT 1 FROM upd) OR EXISTS (SELECT 1 FROM ins) THEN 'on' ELSE 'off' END,
                          true) AS sync
    )
    SELECT r.granted, r.token, r.expires_at, r.holder, now()
    INTO lock_wait.granted, lock_wait.token, lock_wait.expires_at, lock_wait.held_by, lock_wait.db_now
    FROM (
        SELECT true AS granted, handed.token, handed.expires_at, NULL::text AS holder FROM handed
        UNION ALL
        SELECT true, upd.token, upd.expires_at, NULL::text FROM upd
        UNION ALL
        SELECT true, ins.token, ins.expires_at, NULL::text FROM ins
        UNION ALL
        SELECT false, NULL::bigint, COALESCE(m.expires_at, cur.expires_at), COALESCE(m.holder, cur.holder)
        FROM cur LEFT JOIN m ON true
        WHERE m.holder IS NOT NULL OR cur.waiting_since > now() - interval '30 seconds'
    ) AS r CROSS JOIN dur;
    -- Checked again in a snapshot of its own: a row of another key under
    -- this wkey that committed while the statement above waited for it
    -- made the queueing do nothing, and this wait is queued nowhere. The
    -- error undoes what the statement did.
    IF lock_wait.granted IS FALSE AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS e
                                                  WHERE e.wkey = lock_wait.wkey AND e.key_hash = kh) THEN
        RAISE EXCEPTION 'pgfence.lock_wait: wkey % is queued under another key: wait with a new random wkey',
            lock_wait.wkey USING ERRCODE = 'PF013';
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_wait(text, text, bigint, bytea, bigint, bigint) IS
  'A waiter''s attempt: grants a free, expired or new lease as lock_grant does, returns a lease a release handed to '
  'the wait (wkey, wait_id) with this key, or queues the wait in pgfence.lock_queue and returns granted = false '
  'with the holder and its expiry. granted NULL: call again. Bad arguments: PF011; a wkey queued under another key: PF013 (wait with a new wkey).';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_wait(name text, holder text, ttl_us bigint, key bytea, wkey bigint, wait_id bigint,
    OUT granted boolean, OUT token bigint, OUT expires_at timestamptz, OUT held_by text, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kh bytea;
BEGIN
    IF lock_wait.name IS NULL OR octet_length(lock_wait.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_wait.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.holder IS NULL OR octet_length(lock_wait.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_wait.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.ttl_us IS NULL OR lock_wait.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_wait.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.key IS NULL OR octet_length(lock_wait.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_wait.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.wkey IS NULL OR lock_wait.wait_id IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_wait: wkey and wait_id must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_wait.key);
    WITH handed AS (
        SELECT l.token, l.expires_at
        FROM pgfence.lock_queue AS q
        JOIN pgfence.locks AS l ON l.name = q.name AND l.token = q.granted_token AND l.key_hash = q.key_hash
        WHERE q.wkey = lock_wait.wkey AND q.wait_id = lock_wait.wait_id AND q.key_hash = kh
          AND l.expires_at > now()
    ), upd AS (
        UPDATE pgfence.locks AS l
        SET token       = l.token + 1,
            holder      = lock_wait.holder,
            key_hash    = kh,
            acquired_at = now(),
            renewed_at  = NULL,
            expires_at  = now() + lock_wait.ttl_us * interval '1 microsecond'
        WHERE l.name = lock_wait.name AND (l.holder IS NULL OR l.expires_at <= now())
          AND NOT EXISTS (SELECT 1 FROM handed)
        RETURNING l.token, l.expires_at
    ), ins AS (
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        SELECT lock_wait.name, 1, lock_wait.holder, kh, now(), NULL,
               now() + lock_wait.ttl_us * interval '1 microsecond'
        WHERE NOT EXISTS (SELECT 1 FROM pgfence.locks AS e WHERE e.name = lock_wait.name)
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at
    ), cur AS (
        SELECT l.holder, l.expires_at, l.waiting_since
        FROM pgfence.locks AS l
        WHERE l.name = lock_wait.name AND l.holder IS NOT NULL AND l.expires_at > now()
          AND NOT EXISTS (SELECT 1 FROM handed)
    ), m AS (
        UPDATE pgfence.locks AS l
        SET waiting_since = now()
        WHERE l.name = lock_wait.name AND l.holder IS NOT NULL AND l.expires_at > now()
          AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '30 seconds')
          AND NOT EXISTS (SELECT 1 FROM handed)
        RETURNING l.holder, l.expires_at
    ), enq AS (
        -- Unless this wait is queued already: a new wait, or this wait's row
        -- is gone (deleted as dead) or was handed a lease that has ended
        -- since. Queue with a new ticket, reusing the row of wkey if it holds
        -- this key's hash.
        INSERT INTO pgfence.lock_queue AS q (wkey, wait_id, name, holder, key_hash, ttl_us, alive_until)
        SELECT lock_wait.wkey, lock_wait.wait_id, lock_wait.name, lock_wait.holder, kh,
               lock_wait.ttl_us, now() + lock_wait.ttl_us * interval '1 microsecond'
        FROM cur
        WHERE NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS e
                          WHERE e.wkey = lock_wait.wkey AND e.wait_id = lock_wait.wait_id
                            AND e.granted_token IS NULL)
        ON CONFLICT ON CONSTRAINT lock_queue_pkey DO UPDATE
        SET ticket        = DEFAULT,
            wait_id       = EXCLUDED.wait_id,
            name          = EXCLUDED.name,
            holder        = EXCLUDED.holder,
            ttl_us        = EXCLUDED.ttl_us,
            alive_until   = EXCLUDED.alive_until,
            granted_token = NULL
        WHERE q.key_hash = EXCLUDED.key_hash
        RETURNING q.ticket
    ), refresh AS (
        -- Only once half of the waiter's TTL is gone: a row locked by a
        -- refresh is skipped by a concurrent release.
        UPDATE pgfence.lock_queue AS q
        SET alive_until = now() + lock_wait.ttl_us * interval '1 microsecond'
        FROM cur
        WHERE q.wkey = lock_wait.wkey AND q.wait_id = lock_wait.wait_id AND q.key_hash = kh
          AND q.name = lock_wait.name AND q.granted_token IS NULL
          AND q.alive_until < now() + (lock_wait.ttl_us / 2) * interval '1 microsecond'
        RETURNING q.ticket
    ), end_own AS (
        -- Granted here: this wait is over, no release may serve its row; it
        -- stays for the Locker's next wait for 10 seconds, as after a handoff.
        UPDATE pgfence.lock_queue AS q
        SET granted_token = 0,
            alive_until   = now() + interval '10 seconds'
        WHERE q.wkey = lock_wait.wkey AND q.key_hash = kh AND q.granted_token IS NULL
          AND EXISTS (SELECT 1 FROM upd UNION ALL SELECT 1 FROM ins)
        RETURNING q.ticket
    ), dur AS (
        -- Read at commit: only a grant must survive a crash (on); a queue row
        -- or wait mark lost with the server is written again by the waiter
        -- when its listener reconnects (off). It reads upd and ins, so it runs
        -- after them.
        SELECT set_config('synchronous_commit',
                          CASE WHEN EXISTS (SELECT 1 FROM upd) OR EXISTS (SELECT 1 FROM ins) THEN 'on' ELSE 'off' END,
                          true) AS sync
    )
    SELECT r.granted, r.token, r.expires_at, r.holder, now()
    INTO lock_wait.granted, lock_wait.token, lock_wait.expires_at, lock_wait.held_by, lock_wait.db_now
    FROM (
        SELECT true AS granted, handed.token, handed.expires_at, NULL::text AS holder FROM handed
        UNION ALL
        SELECT true, upd.token, upd.expires_at, NULL::text FROM upd
        UNION ALL
        SELECT true, ins.token, ins.expires_at, NULL::text FROM ins
        UNION ALL
        SELECT false, NULL::bigint, COALESCE(m.expires_at, cur.expires_at), COALESCE(m.holder, cur.holder)
        FROM cur LEFT JOIN m ON true
        WHERE m.holder IS NOT NULL OR cur.waiting_since > now() - interval '30 seconds'
    ) AS r CROSS JOIN dur;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_wait(text, text, bigint, bytea, bigint, bigint) IS
  'A waiter''s attempt: grants a free, expired or new lease as lock_grant does, returns a lease a release handed to '
  'the wait (wkey, wait_id) with this key, or queues the wait in pgfence.lock_queue and returns granted = false '
  'with the holder and its expiry. granted NULL: call again. Bad arguments: PF011.';
