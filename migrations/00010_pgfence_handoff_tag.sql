-- A handoff notification now proves itself. Until this migration a waiter
-- woken on pgfence_lock_handoff read its lease from the database
-- (pgfence.lock_handed), one more statement on the path from one holder to the
-- next, because any role that may connect can send a notification and one
-- that can read pgfence.lock_queue knows every waiter's wkey and wait_id.
--
-- pgfence.lock_release now adds to the handoff payload what is left of the
-- lease on the server's clock when the payload is made (left_us) and ends it
-- with a tag only the waiter can check: "wkey wait_id token expiry_us left_us
-- tag", where tag is the hex
-- of sha256(k || sha256(k || message)), message the payload before the tag
-- (UTF-8), and k the waiter's handoff key, sha256(secret || sha256(lease
-- key)). The secret is 32 random bytes drawn by this migration into
-- pgfence.handoff_secret, which no role but the owner reads (no grant is
-- documented for it; only pgfence's SECURITY DEFINER functions use it). A
-- waiter gets its handoff key once, from pgfence.lock_handoff_key(key), which
-- needs the lease key itself, not its hash: a role that reads the queue (and
-- so the key's hash) cannot compute it. The tag covers the wait's wait_id,
-- new for every wait, so a payload seen by a listener cannot be replayed to a
-- later wait. A payload without a tag, or with one that does not check, is a
-- wake-up only, as before: pgfence.lock_handed still says what the database
-- holds.
--
-- The Down drops the table and the function and restores the body of
-- lock_release from 00001.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

CREATE TABLE pgfence.handoff_secret (
    id     boolean NOT NULL DEFAULT true,
    secret bytea   NOT NULL,
    CONSTRAINT handoff_secret_pkey PRIMARY KEY (id),
    CONSTRAINT handoff_secret_one_row CHECK (id),
    CONSTRAINT handoff_secret_length CHECK (octet_length(secret) = 32)
);
REVOKE ALL ON pgfence.handoff_secret FROM PUBLIC;
-- Three version-4 UUIDs (122 random bits each, from the server's strong
-- random source) hashed to 32 bytes.
INSERT INTO pgfence.handoff_secret (secret)
SELECT sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8'));

COMMENT ON TABLE pgfence.handoff_secret IS
  'The secret pgfence.lock_release tags handoff notifications with (see pgfence.lock_handoff_key). One row. Grant it '
  'to no role: whoever reads it can make a handoff notification a waiter believes.';
COMMENT ON COLUMN pgfence.handoff_secret.secret IS '32 random bytes drawn when the migration ran.';

-- pgfence.lock_handoff_key returns the handoff key of the lease key key:
-- sha256(secret || sha256(key)). A waiter queued with key checks the tag of
-- a handoff notification with it (see the comment of this migration).
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_handoff_key(key bytea) RETURNS bytea
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    k bytea;
BEGIN
    IF lock_handoff_key.key IS NULL OR octet_length(lock_handoff_key.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_handoff_key: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_handoff_key.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    SELECT sha256(h.secret || sha256(lock_handoff_key.key)) INTO k FROM pgfence.handoff_secret AS h WHERE h.id;
    IF k IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_handoff_key: pgfence.handoff_secret has no row; handoff notifications carry no tag'
            USING ERRCODE = '55000';
    END IF;
    RETURN k;
END
$fn$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION pgfence.lock_handoff_key(bytea) FROM PUBLIC;
COMMENT ON FUNCTION pgfence.lock_handoff_key(bytea) IS
  'The handoff key of the lease key key: checks the tag that ends a pgfence_lock_handoff payload (hex of '
  'sha256(k || sha256(k || the payload before the tag))). Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_release(name text, token bigint, key bytea,
    OUT released boolean, OUT handed_off boolean, OUT notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kh bytea;
BEGIN
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
    WHERE l.name = lock_release.name AND l.token = lock_release.token
      AND l.key_hash = kh AND l.expires_at > now()
      AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '100 seconds')
      AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                      WHERE q.name = lock_release.name
                        AND (q.granted_token IS NULL OR q.alive_until <= now()));
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        released := true;
        RETURN;
    END IF;
    WITH nxt AS (
        SELECT q.ticket, q.wkey, q.wait_id, q.holder, q.ttl_us, q.key_hash
        FROM pgfence.lock_queue AS q
        WHERE q.name = lock_release.name AND q.granted_token IS NULL AND q.alive_until > now()
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
        WHERE l.name = lock_release.name AND l.token = lock_release.token
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
COMMENT ON FUNCTION pgfence.lock_release(text, bigint, bytea) IS
  'Ends the lease (name, token) held with key; released false: the lease is lost, nothing changed. Hands the lease '
  'to the first live waiter of pgfence.lock_queue if there is one (handed_off, NOTIFY pgfence_lock_handoff with '
  '"wkey wait_id token expiry_us left_us tag", durable), else frees it (token kept) and notifies pgfence_lock_released if a '
  'waiter marked it (notified). Bad arguments: PF011.';

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
    WHERE l.name = lock_release.name AND l.token = lock_release.token
      AND l.key_hash = kh AND l.expires_at > now()
      AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '100 seconds')
      AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                      WHERE q.name = lock_release.name
                        AND (q.granted_token IS NULL OR q.alive_until <= now()));
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        released := true;
        RETURN;
    END IF;
    WITH nxt AS (
        SELECT q.ticket, q.wkey, q.wait_id, q.holder, q.ttl_us, q.key_hash
        FROM pgfence.lock_queue AS q
        WHERE q.name = lock_release.name AND q.granted_token IS NULL AND q.alive_until > now()
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
        WHERE l.name = lock_release.name AND l.token = lock_release.token
          AND l.key_hash = kh AND l.expires_at > now()
        RETURNING n.ticket, n.wkey, n.wait_id, l.token, l.name, l.waiting_since, l.expires_at
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
                     THEN pg_notify('pgfence_lock_handoff',
                                    rel.wkey || ' ' || rel.wait_id || ' ' || rel.token || ' '
                                    || (extract(epoch FROM rel.expires_at) * 1000000)::bigint)::text
                 WHEN rel.waiting_since > now() - interval '100 seconds'
                     THEN pg_notify('pgfence_lock_released', rel.name)::text END) IS NOT NULL
    INTO released, handed_off, notified
    FROM rel;
    IF NOT FOUND THEN
        released := false;
        handed_off := false;
        notified := false;
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_release(text, bigint, bytea) IS
  'Ends the lease (name, token) held with key; released false: the lease is lost, nothing changed. Hands the lease '
  'to the first live waiter of pgfence.lock_queue if there is one (handed_off, NOTIFY pgfence_lock_handoff, durable), '
  'else frees it (token kept) and notifies pgfence_lock_released if a waiter marked it (notified). Bad arguments: PF011.';
DROP FUNCTION pgfence.lock_handoff_key(bytea);
DROP TABLE pgfence.handoff_secret;
