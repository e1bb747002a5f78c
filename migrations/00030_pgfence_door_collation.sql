-- The door and the guards compare lock names, queues, keys and modes under
-- the database's default collation, never the caller's, as 00028 made
-- pgfence.lock_release do. A text argument carries the collation of the
-- call, a PL/pgSQL local variable declared without COLLATE takes it too, and
-- any role can create a nondeterministic (case-insensitive) collation in
-- pg_temp.
--
-- The guards: the generated trigger function compared the row's lock name
-- with pgfence.locks under the collation of the table's lock name column or
-- expression. With a nondeterministic one, a row of 'orders-ACME' was checked
-- against the latest token of 'orders-acme': the stale holder of one wrote
-- rows of the other, the holder of the other was refused its own rows, and
-- an UPDATE that moved a row between the two was not seen as a move
-- (TestGuardLockColumnCollation, TestGuardCollationMigration).
-- pgfence.attach_guard now reads the lock name of NEW and OLD as
-- (NEW.<column>::text COLLATE "default") and (SELECT (<expression>)::text
-- COLLATE "default" FROM ...); the Up attaches every guard again with
-- pgfence.guard() and the options recorded in pgfence.guarded_tables, as
-- 00023 did (owners, guarded_at and guarded_by kept; a guard the migrating
-- role cannot attach again keeps its functions, with a WARNING).
--
-- The door (TestDoorCollation): lock_grant, lock_grant_many, lock_renew,
-- lock_renew_many, lock_release_many, lock_wait, job_claim, job_claim_tx,
-- fenced_value_update, fenced_value_upsert, fenced_value_delete,
-- fenced_value_read, outbox_enqueue and test_expire_lease compare the names,
-- queues and keys of their arguments with COLLATE "default" (the collation
-- of the columns and of their primary keys, whose indexes the lookups still
-- use); fence_refused compares mode so; job_claim_tx and job_fail_tx declare
-- their text variables COLLATE "default" (split_part and position failed
-- under a nondeterministic collation, 0A000); outbox_enqueue matches its
-- topic and idempotency_key patterns under COLLATE "C" (they failed so too,
-- which alone kept its lease check, under the caller's collation, from
-- recording an intent under another name's lease). None of these harmed
-- another holder: each call reached rows the role may reach by naming them,
-- or failed. Under the default collation every answer is unchanged, and so
-- are signatures, settings, grants and comments. The Down restores the
-- bodies of 00001, 00002, 00008 (with 00012's plan_cache_mode), 00014,
-- 00017, 00022, 00023 and 00026, and attaches every guard again with
-- 00023's attach_guard.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_grant(name text, holder text, ttl_us bigint, key bytea,
    OUT token bigint, OUT expires_at timestamptz, OUT held_by text, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_grant.name IS NULL OR octet_length(lock_grant.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.holder IS NULL OR octet_length(lock_grant.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.ttl_us IS NULL OR lock_grant.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_grant.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.key IS NULL OR octet_length(lock_grant.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_grant.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    UPDATE pgfence.locks AS l
    SET token = l.token + 1, holder = lock_grant.holder, key_hash = sha256(lock_grant.key),
        acquired_at = now(), renewed_at = NULL,
        expires_at = now() + lock_grant.ttl_us * interval '1 microsecond'
    WHERE l.name = lock_grant.name COLLATE "default" AND (l.holder IS NULL OR l.expires_at <= now())
    RETURNING l.token, l.expires_at INTO lock_grant.token, lock_grant.expires_at;
    IF NOT FOUND THEN
        SELECT l.holder, l.expires_at INTO lock_grant.held_by, lock_grant.expires_at
        FROM pgfence.locks AS l WHERE l.name = lock_grant.name COLLATE "default";
        IF FOUND THEN
            IF lock_grant.held_by IS NULL OR lock_grant.expires_at <= now() THEN
                lock_grant.held_by := NULL;  -- released or expired since the UPDATE: call again
                lock_grant.expires_at := NULL;
            END IF;
            RETURN;
        END IF;
        -- No row yet: the first grant of the name.
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        VALUES (lock_grant.name, 1, lock_grant.holder, sha256(lock_grant.key), now(), NULL,
                now() + lock_grant.ttl_us * interval '1 microsecond')
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at INTO lock_grant.token, lock_grant.expires_at;
        IF NOT FOUND THEN
            RETURN;  -- a concurrent first grant: call again
        END IF;
    END IF;
    PERFORM set_config('synchronous_commit', 'on', true);
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_grant_many(names text[], holder text, ttls_us bigint[], key bytea)
RETURNS TABLE (i integer, token bigint, expires_at timestamptz, held_by text, exhausted boolean, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    n integer := cardinality(lock_grant_many.names);
    kh bytea;
    bad record;
    e record;
    cur bigint;
    granted boolean := false;
    free_names text[] COLLATE "default";
    gi integer[];
    gt bigint[];
    ge timestamptz[];
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: names must have 1 to 10000 elements, got %',
            coalesce(n::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(lock_grant_many.ttls_us) IS DISTINCT FROM n THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: names and ttls_us must have the same number of elements, got %, %',
            n, coalesce(cardinality(lock_grant_many.ttls_us)::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant_many.holder IS NULL OR octet_length(lock_grant_many.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant_many.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant_many.key IS NULL OR octet_length(lock_grant_many.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_grant_many.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    SELECT r.i, r.nm, r.ttl INTO bad
    FROM unnest(lock_grant_many.names COLLATE "default", lock_grant_many.ttls_us) WITH ORDINALITY AS r(nm, ttl, i)
    WHERE r.nm IS NULL OR octet_length(r.nm) NOT BETWEEN 1 AND 512
       OR r.ttl IS NULL OR r.ttl NOT BETWEEN 1000 AND 86400000000
    ORDER BY r.i
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: element %: name must be 1 to 512 bytes and ttl_us 1000 to 86400000000 (1 ms to 24 hours), got % bytes, ttl_us %',
            bad.i, coalesce(octet_length(bad.nm)::text, 'NULL'), coalesce(bad.ttl::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_grant_many.key);
    lock_grant_many.db_now := now();
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    -- Lock the free rows of the names, in byte order of the names.
    SELECT array_agg(f.name) INTO free_names
    FROM (SELECT l.name
          FROM pgfence.locks AS l
          WHERE l.name = ANY (lock_grant_many.names COLLATE "default")
            AND (l.holder IS NULL OR l.expires_at <= now())
            AND l.token < 9223372036854775807
          ORDER BY l.name COLLATE "C"
          FOR NO KEY UPDATE OF l) AS f;
    -- Grant them: the first element of each name.
    IF free_names IS NOT NULL THEN
        WITH g AS (
            UPDATE pgfence.locks AS l
            SET token = l.token + 1, holder = lock_grant_many.holder, key_hash = kh,
                acquired_at = now(), renewed_at = NULL,
                expires_at = now() + rq.ttl * interval '1 microsecond'
            FROM (SELECT DISTINCT ON (x.nm) x.nm, x.ttl, x.i
                  FROM unnest(lock_grant_many.names COLLATE "default", lock_grant_many.ttls_us) WITH ORDINALITY AS x(nm, ttl, i)
                  WHERE x.nm = ANY (free_names)
                  ORDER BY x.nm, x.i) AS rq
            WHERE l.name = rq.nm AND l.name = ANY (free_names)
              AND (l.holder IS NULL OR l.expires_at <= now())
              AND l.token < 9223372036854775807
            RETURNING rq.i::integer AS i, l.token, l.expires_at
        )
        SELECT array_agg(g.i), array_agg(g.token), array_agg(g.expires_at) INTO gi, gt, ge FROM g;
        IF gi IS NOT NULL THEN
            granted := true;
            RETURN QUERY
            SELECT u.i, u.t, u.e, NULL::text, false, lock_grant_many.db_now
            FROM unnest(gi, gt, ge) AS u(i, t, e);
        END IF;
    END IF;
    -- Every other element, one by one.
    FOR e IN
        SELECT x.nm, x.ttl, x.i::integer AS i
        FROM unnest(lock_grant_many.names COLLATE "default", lock_grant_many.ttls_us) WITH ORDINALITY AS x(nm, ttl, i)
        WHERE gi IS NULL OR x.i <> ALL (gi)
        ORDER BY x.nm COLLATE "C", x.i
    LOOP
        lock_grant_many.i := e.i;
        lock_grant_many.token := NULL;
        lock_grant_many.expires_at := NULL;
        lock_grant_many.held_by := NULL;
        lock_grant_many.exhausted := false;
        SELECT l.holder, l.expires_at, l.token INTO lock_grant_many.held_by, lock_grant_many.expires_at, cur
        FROM pgfence.locks AS l WHERE l.name = e.nm;
        IF FOUND THEN
            IF lock_grant_many.held_by IS NULL OR lock_grant_many.expires_at <= now() THEN
                -- Free now but not locked above (released or expired since,
                -- or its token is at the bigint maximum): call again.
                lock_grant_many.held_by := NULL;
                lock_grant_many.expires_at := NULL;
                lock_grant_many.exhausted := cur = 9223372036854775807;
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        -- No row yet: the first grant of the name.
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        VALUES (e.nm, 1, lock_grant_many.holder, kh, now(), NULL, now() + e.ttl * interval '1 microsecond')
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at INTO lock_grant_many.token, lock_grant_many.expires_at;
        IF FOUND THEN
            granted := true;
        END IF;
        RETURN NEXT;  -- not found: a concurrent first grant, call again
    END LOOP;
    IF granted THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_renew(name text, token bigint, key bytea, ttl_us bigint,
    OUT expires_at timestamptz, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_renew.name IS NULL OR octet_length(lock_renew.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_renew.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.token IS NULL OR lock_renew.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: token must be > 0, got %',
            coalesce(lock_renew.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.key IS NULL OR octet_length(lock_renew.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_renew.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.ttl_us IS NULL OR lock_renew.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_renew.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    UPDATE pgfence.locks AS l
    -- Never earlier than it is: two renewals of one lease may commit in
    -- the other order than they began (now() is each one's start).
    SET expires_at = greatest(l.expires_at, now() + lock_renew.ttl_us * interval '1 microsecond'), renewed_at = now()
    WHERE l.name = lock_renew.name COLLATE "default" AND l.token = lock_renew.token
      AND l.key_hash = sha256(lock_renew.key) AND l.expires_at > now()
    RETURNING l.expires_at INTO lock_renew.expires_at;
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_renew_many(names text[], tokens bigint[], key bytea, ttls_us bigint[])
RETURNS TABLE (name text, token bigint, expires_at timestamptz, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    n integer := cardinality(lock_renew_many.names);
    bad record;
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: names must have 1 to 10000 elements, got %',
            coalesce(n::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(lock_renew_many.tokens) IS DISTINCT FROM n OR cardinality(lock_renew_many.ttls_us) IS DISTINCT FROM n THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: names, tokens and ttls_us must have the same number of elements, got %, %, %',
            n, coalesce(cardinality(lock_renew_many.tokens)::text, 'NULL'),
            coalesce(cardinality(lock_renew_many.ttls_us)::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew_many.key IS NULL OR octet_length(lock_renew_many.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_renew_many.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    SELECT r.i, r.nm, r.t, r.ttl INTO bad
    FROM unnest(lock_renew_many.names COLLATE "default", lock_renew_many.tokens, lock_renew_many.ttls_us) WITH ORDINALITY AS r(nm, t, ttl, i)
    WHERE r.nm IS NULL OR octet_length(r.nm) NOT BETWEEN 1 AND 512
       OR r.t IS NULL OR r.t <= 0
       OR r.ttl IS NULL OR r.ttl NOT BETWEEN 1000 AND 86400000000
    ORDER BY r.i
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: element %: name must be 1 to 512 bytes, token > 0 and ttl_us 1000 to 86400000000 (1 ms to 24 hours), got % bytes, token %, ttl_us %',
            bad.i, coalesce(octet_length(bad.nm)::text, 'NULL'), coalesce(bad.t::text, 'NULL'),
            coalesce(bad.ttl::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    -- Lock this key's rows among the names in byte order of the names first,
    -- as lock_grant_many and lock_release_many do: the UPDATE below takes
    -- its rows in the order of its plan, and a release batch of the same
    -- Locker could otherwise hold one of them while waiting for another.
    PERFORM
    FROM (SELECT l.name
          FROM pgfence.locks AS l
          WHERE l.name = ANY (lock_renew_many.names COLLATE "default") AND l.key_hash = sha256(lock_renew_many.key)
          ORDER BY l.name COLLATE "C"
          FOR NO KEY UPDATE OF l) AS h;
    RETURN QUERY
    UPDATE pgfence.locks AS l
    -- Never earlier than it is (see lock_renew).
    SET expires_at = greatest(l.expires_at, now() + r.ttl * interval '1 microsecond'), renewed_at = now()
    FROM unnest(lock_renew_many.names COLLATE "default", lock_renew_many.tokens, lock_renew_many.ttls_us) AS r(nm, t, ttl)
    WHERE l.name = r.nm AND l.token = r.t
      AND l.key_hash = sha256(lock_renew_many.key) AND l.expires_at > now()
    RETURNING l.name, l.token, l.expires_at, now();
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_release_many(names text[], tokens bigint[], key bytea)
RETURNS TABLE (i integer, released boolean, handed_off boolean, notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    n integer := cardinality(lock_release_many.names);
    bad record;
    e record;
    r record;
    handed boolean := false;
    kh bytea;
    done integer[];
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: names must have 1 to 10000 elements, got %',
            coalesce(n::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(lock_release_many.tokens) IS DISTINCT FROM n THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: names and tokens must have the same number of elements, got %, %',
            n, coalesce(cardinality(lock_release_many.tokens)::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release_many.key IS NULL OR octet_length(lock_release_many.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_release_many.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    SELECT x.i, x.nm, x.t INTO bad
    FROM unnest(lock_release_many.names COLLATE "default", lock_release_many.tokens) WITH ORDINALITY AS x(nm, t, i)
    WHERE x.nm IS NULL OR octet_length(x.nm) NOT BETWEEN 1 AND 512 OR x.t IS NULL OR x.t <= 0
    ORDER BY x.i
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: element %: name must be 1 to 512 bytes and token > 0, got % bytes, token %',
            bad.i, coalesce(octet_length(bad.nm)::text, 'NULL'), coalesce(bad.t::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_release_many.key);
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    -- Lock the rows of the names held with this key, in byte order of the
    -- names.
    PERFORM
    FROM (SELECT l.name
          FROM pgfence.locks AS l
          WHERE l.name = ANY (lock_release_many.names COLLATE "default") AND l.key_hash = kh
          ORDER BY l.name COLLATE "C"
          FOR NO KEY UPDATE OF l) AS h;
    -- Release in one UPDATE the first element of each name whose lease is
    -- live and nobody waits for (lock_release's plain release).
    WITH u AS (
        UPDATE pgfence.locks AS l
        SET holder = NULL, key_hash = NULL, renewed_at = NULL, expires_at = NULL
        FROM (SELECT DISTINCT ON (x.nm) x.nm, x.t, x.i
              FROM unnest(lock_release_many.names COLLATE "default", lock_release_many.tokens) WITH ORDINALITY AS x(nm, t, i)
              ORDER BY x.nm, x.i) AS rq
        WHERE l.name = rq.nm AND l.token = rq.t
          AND l.key_hash = kh AND l.expires_at > now()
          AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '100 seconds')
          AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                          WHERE q.name = rq.nm
                            AND (q.granted_token IS NULL OR q.alive_until <= now()))
        RETURNING rq.i::integer AS i
    )
    SELECT array_agg(u.i) INTO done FROM u;
    IF done IS NOT NULL THEN
        RETURN QUERY SELECT d.i, true, false, false FROM unnest(done) AS d(i);
    END IF;
    -- Every other element: exactly lock_release, the handoff to the first
    -- live waiter and its NOTIFY included.
    FOR e IN
        SELECT x.nm, x.t, x.i::integer AS i
        FROM unnest(lock_release_many.names COLLATE "default", lock_release_many.tokens) WITH ORDINALITY AS x(nm, t, i)
        WHERE done IS NULL OR x.i <> ALL (done)
        ORDER BY x.nm COLLATE "C", x.i
    LOOP
        SELECT g.released, g.handed_off, g.notified INTO r
        FROM pgfence.lock_release(e.nm, e.t, lock_release_many.key) AS g;
        lock_release_many.i := e.i;
        lock_release_many.released := r.released;
        lock_release_many.handed_off := r.handed_off;
        lock_release_many.notified := r.notified;
        handed := handed OR r.handed_off;
        RETURN NEXT;
    END LOOP;
    -- A handoff is a grant: the whole call is durable if any element handed
    -- a lease over; a plain release is not.
    PERFORM set_config('synchronous_commit', CASE WHEN handed THEN 'on' ELSE 'off' END, true);
END
$fn$;
-- +goose StatementEnd

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
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
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
        WHERE l.name = lock_wait.name COLLATE "default" AND (l.holder IS NULL OR l.expires_at <= now())
          AND NOT EXISTS (SELECT 1 FROM handed)
        RETURNING l.token, l.expires_at
    ), ins AS (
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        SELECT lock_wait.name, 1, lock_wait.holder, kh, now(), NULL,
               now() + lock_wait.ttl_us * interval '1 microsecond'
        WHERE NOT EXISTS (SELECT 1 FROM pgfence.locks AS e WHERE e.name = lock_wait.name COLLATE "default")
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at
    ), cur AS (
        SELECT l.holder, l.expires_at, l.waiting_since
        FROM pgfence.locks AS l
        WHERE l.name = lock_wait.name COLLATE "default" AND l.holder IS NOT NULL AND l.expires_at > now()
          AND NOT EXISTS (SELECT 1 FROM handed)
    ), m AS (
        UPDATE pgfence.locks AS l
        SET waiting_since = now()
        WHERE l.name = lock_wait.name COLLATE "default" AND l.holder IS NOT NULL AND l.expires_at > now()
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
          AND q.name = lock_wait.name COLLATE "default" AND q.granted_token IS NULL
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_claim(queue text, holder text, ttl_ms bigint, max_jobs integer, key bytea)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    kh bytea;
BEGIN
    IF job_claim.queue IS NULL OR octet_length(job_claim.queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION 'pgfence.job_claim: queue must be 1 to 128 bytes, got %',
            coalesce(octet_length(job_claim.queue)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.holder IS NULL OR octet_length(job_claim.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.job_claim: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(job_claim.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.ttl_ms IS NULL OR job_claim.ttl_ms NOT BETWEEN 100 AND 86400000 THEN
        RAISE EXCEPTION 'pgfence.job_claim: ttl_ms must be 100 to 86400000 (100 ms to 24 hours), got %',
            coalesce(job_claim.ttl_ms::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.max_jobs IS NULL OR job_claim.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_claim: max_jobs must be 1 to 10000, got %',
            coalesce(job_claim.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.key IS NULL OR octet_length(job_claim.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.job_claim: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(job_claim.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(job_claim.key);
    -- COLLATE "default" (the column's collation), never the caller's: a
    -- text argument carries the collation of the call (migration 00030).
    -- The picked rows stay locked until the UPDATE, so a running one is one
    -- whose claim expired. The UPDATE finds them by primary key (id = ANY): a
    -- join with picked becomes, on a small table, a hash join over every row.
    RETURN QUERY
    WITH due AS (
        SELECT a.id, a.priority, a.run_at
        FROM pgfence.jobs a
        WHERE a.queue = job_claim.queue COLLATE "default" AND a.state = 'available' AND a.run_at <= now()
        ORDER BY a.priority, a.run_at, a.id
        LIMIT job_claim.max_jobs
        FOR UPDATE SKIP LOCKED
    ), expired AS (
        SELECT r.id, r.priority, r.run_at
        FROM pgfence.jobs r
        WHERE r.queue = job_claim.queue COLLATE "default" AND r.state = 'running' AND r.claim_expires_at <= now()
        ORDER BY r.claim_expires_at
        LIMIT job_claim.max_jobs
        FOR UPDATE SKIP LOCKED
    ), picked AS (
        SELECT c.id
        FROM (SELECT d.id, d.priority, d.run_at FROM due d
              UNION ALL
              SELECT e.id, e.priority, e.run_at FROM expired e) AS c
        ORDER BY c.priority, c.run_at, c.id
        LIMIT job_claim.max_jobs
    ), claimed AS (
        UPDATE pgfence.jobs j
        SET state            = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN 'dead' ELSE 'running' END,
            attempts         = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.attempts ELSE j.attempts + 1 END,
            holder           = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.holder ELSE job_claim.holder END,
            claim_token      = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.claim_token
                                    ELSE nextval('pgfence.jobs_claim_token_seq') END,
            claim_key_hash   = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.claim_key_hash ELSE kh END,
            claim_expires_at = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN NULL
                                    ELSE statement_timestamp() + job_claim.ttl_ms * interval '1 millisecond' END,
            last_error       = CASE WHEN j.state = 'running'
                                    THEN 'claim ' || j.claim_token || ' of ' || j.holder || ' expired at ' || j.claim_expires_at
                                    ELSE j.last_error END,
            finished_at      = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN now() END,
            claim_outcome    = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN 'expired' END,
            updated_at       = now()
        WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
        RETURNING j.*
    )
    SELECT c.* FROM claimed c
    WHERE c.state = 'running'
    ORDER BY c.priority, c.run_at, c.id;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_claim_tx(queue text, max_jobs integer)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    r pgfence.jobs%ROWTYPE;
    got bigint[] := '{}';
    -- Not the caller's collation (a local variable takes the call's):
    -- split_part fails under a nondeterministic one (migration 00030).
    prev text COLLATE "default";
    me text COLLATE "default";
BEGIN
    IF job_claim_tx.queue IS NULL OR octet_length(job_claim_tx.queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: queue must be 1 to 128 bytes, got %',
            coalesce(octet_length(job_claim_tx.queue)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim_tx.max_jobs IS NULL OR job_claim_tx.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: max_jobs must be 1 to 10000, got %',
            coalesce(job_claim_tx.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- COLLATE "default" (the column's collation), never the caller's: a
    -- text argument carries the collation of the call (migration 00030).
    FOR r IN
        SELECT j.* FROM pgfence.jobs j
        WHERE j.queue = job_claim_tx.queue COLLATE "default" AND j.state = 'available' AND j.run_at <= now()
        ORDER BY j.priority, j.run_at, j.id
        LIMIT job_claim_tx.max_jobs
        FOR UPDATE SKIP LOCKED
    LOOP
        got := got || r.id;
        RETURN NEXT r;
    END LOOP;
    IF cardinality(got) > 0 THEN
        -- Remember the claims for job_complete_tx and job_fail_tx, for this
        -- transaction only: "<transaction id>:,id,id,...,", the id assigned
        -- by the row locks taken above. A savepoint rolled back takes its
        -- claims (row locks and setting) with it.
        me := pg_current_xact_id()::text;
        prev := current_setting('pgfence.job_tx_claims', true);
        IF prev IS NULL OR split_part(prev, ':', 1) <> me THEN
            prev := me || ':,';  -- none yet, or another transaction's
        END IF;
        PERFORM set_config('pgfence.job_tx_claims', prev || array_to_string(got, ',') || ',', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_fail_tx(id bigint, last_error text, retry_in_ms bigint, give_up boolean)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    -- Not the caller's collation (a local variable takes the call's, from
    -- last_error): split_part and position fail under a nondeterministic
    -- one (migration 00030).
    claims text COLLATE "default";
BEGIN
    IF job_fail_tx.id IS NULL OR job_fail_tx.id <= 0 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: id must be > 0, got %',
            coalesce(job_fail_tx.id::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.last_error IS NULL OR octet_length(job_fail_tx.last_error) > 8192 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: last_error must be 0 to 8192 bytes, got %',
            coalesce(octet_length(job_fail_tx.last_error)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.retry_in_ms IS NULL OR job_fail_tx.retry_in_ms NOT BETWEEN 0 AND 31536000000 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: retry_in_ms must be 0 to 31536000000 (a year), got %',
            coalesce(job_fail_tx.retry_in_ms::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.give_up IS NULL THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: give_up must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    -- Only a job job_claim_tx claimed in this transaction (see
    -- job_complete_tx).
    claims := current_setting('pgfence.job_tx_claims', true);
    IF claims IS NULL
       OR split_part(claims, ':', 1) IS DISTINCT FROM pg_current_xact_id_if_assigned()::text
       OR position(',' || job_fail_tx.id::text || ',' IN claims) = 0 THEN
        RETURN;
    END IF;
    PERFORM 1 FROM pgfence.jobs l
    WHERE l.id = job_fail_tx.id AND l.state = 'available' AND l.run_at <= now()
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET attempts    = j.attempts + 1,
        state       = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN 'dead' ELSE 'available' END,
        run_at      = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN j.run_at
                           ELSE now() + job_fail_tx.retry_in_ms * interval '1 millisecond' END,
        finished_at = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN now() END,
        last_error  = job_fail_tx.last_error,
        updated_at  = now()
    WHERE j.id = job_fail_tx.id AND j.state = 'available'
    RETURNING j.*;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_update(key text, value jsonb, token bigint, reentrant boolean,
    OUT applied boolean, OUT fence bigint, OUT updated_at timestamptz, OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_update.key IS NULL OR octet_length(fenced_value_update.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_update.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.token IS NULL OR fenced_value_update.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: token must be > 0, got %',
            coalesce(fenced_value_update.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.value IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: value must be a jsonb value (JSON null is ''null''), got NULL'
            USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.reentrant IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: reentrant must be true or false, got NULL'
            USING ERRCODE = 'PF011';
    END IF;
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    UPDATE pgfence.fenced_values AS v
    SET value = fenced_value_update.value, fence = fenced_value_update.token, updated_at = now()
    WHERE v.key = fenced_value_update.key COLLATE "default"
      AND (v.fence < fenced_value_update.token
           OR (fenced_value_update.reentrant AND v.fence = fenced_value_update.token))
    RETURNING true, v.fence, v.updated_at
    INTO fenced_value_update.applied, fenced_value_update.fence, fenced_value_update.updated_at;
    fenced_value_update.row_found := FOUND;
    IF NOT fenced_value_update.row_found THEN
        SELECT c.fence, c.updated_at
        INTO fenced_value_update.fence, fenced_value_update.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_update.key COLLATE "default";
        fenced_value_update.row_found := FOUND;
        fenced_value_update.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_upsert(key text, value jsonb, token bigint, reentrant boolean,
    OUT applied boolean, OUT fence bigint, OUT updated_at timestamptz, OUT inserted boolean,
    OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_upsert.key IS NULL OR octet_length(fenced_value_upsert.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_upsert.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.token IS NULL OR fenced_value_upsert.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: token must be > 0, got %',
            coalesce(fenced_value_upsert.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.value IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: value must be a jsonb value (JSON null is ''null''), got NULL'
            USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.reentrant IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: reentrant must be true or false, got NULL'
            USING ERRCODE = 'PF011';
    END IF;
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    INSERT INTO pgfence.fenced_values AS t (key, value, fence, updated_at)
    VALUES (fenced_value_upsert.key, fenced_value_upsert.value, fenced_value_upsert.token, now())
    ON CONFLICT ON CONSTRAINT fenced_values_pkey DO UPDATE
    SET value = excluded.value, fence = excluded.fence, updated_at = excluded.updated_at
    WHERE t.fence < excluded.fence
       OR (fenced_value_upsert.reentrant AND t.fence = excluded.fence)
    RETURNING true, t.fence, t.updated_at, t.xmax = 0
    INTO fenced_value_upsert.applied, fenced_value_upsert.fence, fenced_value_upsert.updated_at,
         fenced_value_upsert.inserted;
    fenced_value_upsert.row_found := FOUND;
    IF NOT fenced_value_upsert.row_found THEN
        SELECT c.fence, c.updated_at
        INTO fenced_value_upsert.fence, fenced_value_upsert.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_upsert.key COLLATE "default";
        fenced_value_upsert.row_found := FOUND;
        fenced_value_upsert.applied := false;
        fenced_value_upsert.inserted := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_delete(key text, token bigint,
    OUT applied boolean, OUT fence bigint, OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_delete.key IS NULL OR octet_length(fenced_value_delete.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_delete: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_delete.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_delete.token IS NULL OR fenced_value_delete.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_delete: token must be > 0, got %',
            coalesce(fenced_value_delete.token::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    DELETE FROM pgfence.fenced_values AS v
    WHERE v.key = fenced_value_delete.key COLLATE "default" AND v.fence <= fenced_value_delete.token
    RETURNING true, v.fence
    INTO fenced_value_delete.applied, fenced_value_delete.fence;
    fenced_value_delete.row_found := FOUND;
    IF NOT fenced_value_delete.row_found THEN
        SELECT c.fence
        INTO fenced_value_delete.fence
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_delete.key COLLATE "default";
        fenced_value_delete.row_found := FOUND;
        fenced_value_delete.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_read(key text, token bigint,
    OUT applied boolean, OUT value jsonb, OUT fence bigint, OUT updated_at timestamptz,
    OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_read.key IS NULL OR octet_length(fenced_value_read.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_read: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_read.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_read.token IS NULL OR fenced_value_read.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_read: token must be > 0, got %',
            coalesce(fenced_value_read.token::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    UPDATE pgfence.fenced_values AS v
    SET fence = fenced_value_read.token
    WHERE v.key = fenced_value_read.key COLLATE "default" AND v.fence <= fenced_value_read.token
    RETURNING true, v.value, v.fence, v.updated_at
    INTO fenced_value_read.applied, fenced_value_read.value, fenced_value_read.fence, fenced_value_read.updated_at;
    fenced_value_read.row_found := FOUND;
    IF NOT fenced_value_read.row_found THEN
        SELECT c.value, c.fence, c.updated_at
        INTO fenced_value_read.value, fenced_value_read.fence, fenced_value_read.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_read.key COLLATE "default";
        fenced_value_read.row_found := FOUND;
        fenced_value_read.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fence_refused(
    table_name text,
    key        text,
    mode       text,
    token      bigint,
    fence      bigint,
    row_found  boolean
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    detail text := format('token %s, fence %s, table %s, key %s',
                          coalesce(token::text, 'NULL'), coalesce(fence::text, 'NULL'), table_name, key);
BEGIN
    -- mode under COLLATE "default", never the caller's collation: a text
    -- argument carries the collation of the call (migration 00030).
    IF token IS NULL OR token <= 0 THEN
        RAISE EXCEPTION 'pgfence: write to % refused: invalid token %', table_name, coalesce(token::text, 'NULL')
            USING ERRCODE = 'PF007', DETAIL = detail;
    ELSIF row_found IS NULL OR mode IS NULL OR mode COLLATE "default" NOT IN ('strict', 'reentrant')
          OR (row_found AND (fence IS NULL OR fence < 0)) THEN
        RAISE EXCEPTION 'pgfence.fence_refused: mode must be strict or reentrant, row_found not NULL, and fence >= 0 for a row found; got mode %, row_found %, fence %',
                coalesce(quote_literal(mode), 'NULL'), coalesce(row_found::text, 'NULL'), coalesce(fence::text, 'NULL')
            USING ERRCODE = 'PF011', DETAIL = detail;
    ELSIF NOT row_found THEN
        RAISE EXCEPTION 'pgfence: write to % refused: no row with key %', table_name, key
            USING ERRCODE = 'PF005', DETAIL = detail;
    ELSIF fence > token THEN
        RAISE EXCEPTION 'pgfence: write to % refused: stale token % (the row''s fence is %: a newer grant wrote it)',
                table_name, token, fence
            USING ERRCODE = 'PF003', DETAIL = detail;
    ELSIF fence = token AND mode COLLATE "default" = 'strict' THEN
        RAISE EXCEPTION 'pgfence: write to % refused: already applied (this grant, token %, wrote the row)',
                table_name, token
            USING ERRCODE = 'PF004', DETAIL = detail;
    END IF;
    RAISE EXCEPTION 'pgfence: write to % refused: the row changed concurrently; the write was not applied', table_name
        USING ERRCODE = 'PF006', DETAIL = detail;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue(
    lock_name       text,
    token           bigint,
    key             bytea,
    topic           text,
    idempotency_key text,
    payload         jsonb,
    max_attempts    integer DEFAULT 25,
    run_at          timestamptz DEFAULT NULL
) RETURNS TABLE (intent_id bigint, duplicate boolean, intent_topic text, intent_lock_name text, intent_token bigint,
                 enqueued_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    latest  bigint;
    held_by text;
    expires timestamptz;
    kh      bytea;
    jid     bigint;
BEGIN
    -- 1. The arguments. The regular expressions read topic and
    --    idempotency_key under COLLATE "C", and every comparison below is
    --    under COLLATE "default" (the columns' and their indexes'), never
    --    the caller's collation: a text argument carries the collation of the
    --    call (migration 00030).
    IF outbox_enqueue.lock_name IS NULL OR octet_length(outbox_enqueue.lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: lock_name must be 1 to 512 bytes, got %',
            coalesce(octet_length(outbox_enqueue.lock_name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.token IS NULL OR outbox_enqueue.token <= 0 THEN
        PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                             outbox_enqueue.token, NULL);  -- PF007
    ELSIF outbox_enqueue.key IS NULL OR octet_length(outbox_enqueue.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: key must be 16 to 64 random bytes (the lease''s key), got %',
            coalesce(octet_length(outbox_enqueue.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.topic IS NULL OR outbox_enqueue.topic COLLATE "C" !~ '^[A-Za-z0-9._:/-]{1,100}$' THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: topic must be 1 to 100 bytes of ASCII letters, digits and . _ : / -, got %',
            coalesce(CASE WHEN octet_length(outbox_enqueue.topic) BETWEEN 1 AND 100 THEN 'another character'
                          ELSE octet_length(outbox_enqueue.topic)::text || ' bytes' END, 'NULL')
            USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.idempotency_key IS NULL OR outbox_enqueue.idempotency_key COLLATE "C" !~ '^[!-~]{1,255}$' THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: idempotency_key must be 1 to 255 visible ASCII characters, got %',
            coalesce(CASE WHEN octet_length(outbox_enqueue.idempotency_key) BETWEEN 1 AND 255 THEN 'another character'
                          ELSE octet_length(outbox_enqueue.idempotency_key)::text || ' bytes' END, 'NULL')
            USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: payload must not be NULL' USING ERRCODE = '22004';
    ELSIF octet_length(outbox_enqueue.payload::text) > 1048576 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: payload must be at most 1048576 bytes in its text form, got %',
                octet_length(outbox_enqueue.payload::text) || ' bytes'
            USING ERRCODE = '23514', SCHEMA = 'pgfence', TABLE = 'outbox', CONSTRAINT = 'outbox_payload_size';
    ELSIF outbox_enqueue.max_attempts IS NULL OR outbox_enqueue.max_attempts NOT BETWEEN 1 AND 1000000 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: max_attempts must be 1 to 1000000, got %',
            coalesce(outbox_enqueue.max_attempts::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- 2. The token must be the lock's latest grant (checked again at COMMIT,
    --    under a lock, by trigger outbox_check_token), and the lease held
    --    with this key.
    SELECT l.token, l.holder, l.expires_at, l.key_hash INTO latest, held_by, expires, kh
    FROM pgfence.locks l WHERE l.name = outbox_enqueue.lock_name COLLATE "default";
    PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                         outbox_enqueue.token, latest);
    IF held_by IS NULL OR NOT expires > now() OR kh IS DISTINCT FROM sha256(outbox_enqueue.key) THEN
        RAISE EXCEPTION 'pgfence outbox: intent % refused: the lease of lock % with token % is not held with this key (%)',
                jsonb_build_object('idempotency_key', outbox_enqueue.idempotency_key)::text,
                quote_literal(outbox_enqueue.lock_name), outbox_enqueue.token,
                CASE WHEN held_by IS NULL THEN 'released' WHEN NOT expires > now() THEN 'expired'
                     ELSE 'held with another key' END
            USING ERRCODE = 'PF012', SCHEMA = 'pgfence', TABLE = 'outbox',
                  DETAIL = format('op INSERT, key %s, token %s, lock %s, latest token %s',
                                  jsonb_build_object('idempotency_key', outbox_enqueue.idempotency_key)::text,
                                  outbox_enqueue.token, outbox_enqueue.lock_name, latest),
                  HINT = 'Pass the lease of the current holder with its own key (pglock: Lease.Key()).';
    END IF;
    FOR attempt IN 1..3 LOOP
        -- 3. A key already recorded for this lock: the first intent wins.
        RETURN QUERY SELECT o.id, true, o.topic, o.lock_name, o.token, o.created_at
                       FROM pgfence.outbox o
                      WHERE o.lock_name = outbox_enqueue.lock_name COLLATE "default"
                        AND o.idempotency_key = outbox_enqueue.idempotency_key COLLATE "default";
        IF FOUND THEN
            RETURN;
        END IF;
        -- 4. The delivery job, then the intent under the job's id.
        INSERT INTO pgfence.jobs (queue, run_at, max_attempts)
        VALUES ('outbox:' || outbox_enqueue.topic, coalesce(outbox_enqueue.run_at, now()), outbox_enqueue.max_attempts)
        RETURNING id INTO jid;
        INSERT INTO pgfence.outbox AS o (id, topic, idempotency_key, lock_name, token, payload)
        VALUES (jid, outbox_enqueue.topic, outbox_enqueue.idempotency_key, outbox_enqueue.lock_name,
                outbox_enqueue.token, outbox_enqueue.payload)
        ON CONFLICT ON CONSTRAINT outbox_key_unique DO NOTHING
        RETURNING o.id, false, o.topic, o.lock_name, o.token, o.created_at
             INTO intent_id, duplicate, intent_topic, intent_lock_name, intent_token, enqueued_at;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        -- A concurrent enqueue of the same lock and key committed first: drop
        -- the job and report that intent.
        DELETE FROM pgfence.jobs j WHERE j.id = jid;
    END LOOP;
    RAISE EXCEPTION 'pgfence outbox: key % of lock % keeps appearing and disappearing; not recorded',
            outbox_enqueue.idempotency_key, outbox_enqueue.lock_name
        USING ERRCODE = '40001';
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.test_expire_lease(name text) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    ended bigint;
BEGIN
    IF test_expire_lease.name IS NULL OR octet_length(test_expire_lease.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.test_expire_lease: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(test_expire_lease.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- COLLATE "default" (the primary key's collation), never the caller's:
    -- a text argument carries the collation of the call (migration 00030).
    UPDATE pgfence.locks AS l SET expires_at = now()
    WHERE l.name = test_expire_lease.name COLLATE "default" AND l.expires_at > now()
    RETURNING l.token INTO ended;
    RETURN coalesce(ended, 0);
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.attach_guard(
    tbl                  regclass,
    lock_name            text DEFAULT NULL,
    lock_name_column     text DEFAULT NULL,
    fence_column         text DEFAULT 'fence',
    mode                 text DEFAULT 'strict',
    lock_name_expression text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kind       "char";
    col_type   regtype;
    generated  "char";
    fn_name    text;
    lock_src   text;  -- an expression over the table's columns
    new_src    text;  -- the lock name of NEW / OLD in the trigger: a subquery or a literal,
                      -- under COLLATE "default"
    old_src    text;
    new_key    text;  -- the row's primary key as JSON text, from NEW / OLD
    old_key    text;
    lookup     text;  -- the trigger's statement that reads the latest token of NEW's lock
    name_late  text;  -- sets pgf_lock from NEW when refusing ('' when lookup sets it)
    slow       text;  -- the reentrant mode's extra conditions of the slow path
    mark       text;  -- the body of the reentrant mode's mark function (trigger a_mark)
    marked     text;  -- b_check: a fence the mark kept equal (opens an IF ... ELSE)
    marked_end text;  -- b_check: closes it
    assigned   text;  -- b_check: decoding any other negative fence, as the first version did
    moved      text;  -- b_check: refuses an UPDATE that changes the row's lock ('' for one lock name)
    body       text;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'pgfence.guard: table must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF num_nonnulls(lock_name, lock_name_column, lock_name_expression) <> 1 THEN
        RAISE EXCEPTION 'pgfence.guard: pass exactly one of lock_name, lock_name_column and lock_name_expression'
            USING ERRCODE = '22023';
    END IF;
    IF lock_name IS NOT NULL AND octet_length(lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.guard: lock_name must be 1..512 bytes' USING ERRCODE = '22023';
    END IF;
    IF mode IS NULL OR mode NOT IN ('strict', 'reentrant') THEN
        RAISE EXCEPTION 'pgfence.guard: mode must be ''strict'' or ''reentrant'', not %', quote_nullable(mode)
            USING ERRCODE = '22023';
    END IF;
    SELECT relkind INTO kind FROM pg_class WHERE oid = tbl;
    IF kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION 'pgfence.guard: % is not a table', tbl USING ERRCODE = '42809';
    END IF;
    SELECT atttypid::regtype INTO col_type FROM pg_attribute
     WHERE attrelid = tbl AND attname = fence_column AND attnum > 0 AND NOT attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(fence_column)
            USING ERRCODE = '42703',
                  HINT = 'Add it first: ALTER TABLE ... ADD COLUMN fence bigint NOT NULL DEFAULT 0';
    END IF;
    IF col_type <> 'bigint'::regtype THEN
        RAISE EXCEPTION 'pgfence.guard: column %.% is %, want bigint', tbl, quote_ident(fence_column), col_type
            USING ERRCODE = '42804';
    END IF;
    IF lock_name_column IS NOT NULL THEN
        SELECT a.attgenerated INTO generated FROM pg_attribute a
         WHERE a.attrelid = tbl AND a.attname = lock_name_column AND a.attnum > 0 AND NOT a.attisdropped;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(lock_name_column)
                USING ERRCODE = '42703';
        END IF;
        IF generated = 's' THEN
            -- A BEFORE trigger sees a stored generated column as NULL: compute it
            -- from the row with the column's own generation expression.
            SELECT pg_get_expr(d.adbin, d.adrelid) INTO lock_src
              FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
             WHERE d.adrelid = tbl AND a.attname = lock_name_column;
        ELSE
            -- A plain column is read from the row directly (no subquery).
            -- Under COLLATE "default", as the lock names of pgfence.locks
            -- are compared (the primary key's collation): under the
            -- column's own, a nondeterministic (case-insensitive) one
            -- matched the row of another name, whose latest token then
            -- vouched for the row, and hid a move between two such names
            -- (migration 00030). So is an expression's value, below.
            new_src := format('(NEW.%I::text COLLATE "default")', lock_name_column);
            old_src := format('(OLD.%I::text COLLATE "default")', lock_name_column);
        END IF;
    ELSIF lock_name_expression IS NOT NULL THEN
        IF octet_length(lock_name_expression) NOT BETWEEN 1 AND 4096 THEN
            RAISE EXCEPTION 'pgfence.guard: lock_name_expression must be 1..4096 bytes' USING ERRCODE = '22023';
        END IF;
        lock_src := lock_name_expression;
    END IF;
    IF lock_src IS NOT NULL THEN
        -- Check that the expression compiles against the table's columns (and
        -- is one expression): nothing is read.
        BEGIN
            EXECUTE format('SELECT (%s)::text FROM %s AS pgfence_row LIMIT 0', lock_src, tbl);
        EXCEPTION WHEN OTHERS THEN
            RAISE EXCEPTION 'pgfence.guard: lock name expression % does not work on %: %', lock_src, tbl, SQLERRM
                USING ERRCODE = '22023';
        END;
        new_src := format('(SELECT (%s)::text COLLATE "default" FROM (SELECT (NEW).*) AS pgfence_row)', lock_src);
        old_src := format('(SELECT (%s)::text COLLATE "default" FROM (SELECT (OLD).*) AS pgfence_row)', lock_src);
        -- One statement computes the lock name and reads its latest token.
        lookup := format(E'SELECT pgf_s.pgf_name, l.token INTO pgf_lock, pgf_issued\n'
                         '      FROM (SELECT %s AS pgf_name) AS pgf_s LEFT JOIN pgfence.locks l ON l.name = pgf_s.pgf_name;',
                         new_src);
        name_late := '';
    ELSE
        IF lock_name IS NOT NULL THEN
            new_src := quote_literal(lock_name);
            old_src := new_src;
        END IF;
        -- A literal or a column of NEW: the lookup reads it as a parameter.
        lookup := format('SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = %s;', new_src);
        name_late := format(E'\n    pgf_lock := %s;', new_src);
    END IF;

    -- The row's primary key, for the errors (evaluated only when raising).
    SELECT 'pg_catalog.jsonb_build_object(' || string_agg(quote_literal(a.attname) || ', NEW.' || quote_ident(a.attname),
                                                          ', ' ORDER BY k.ord) || ')::text'
      INTO new_key
      FROM pg_index i
      CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = tbl AND i.indisprimary;
    IF new_key IS NULL THEN
        new_key := quote_literal('(no primary key)');
        old_key := new_key;
    ELSE
        old_key := replace(new_key, ', NEW.', ', OLD.');
    END IF;

    -- A token vouches for a row of its own lock only: an UPDATE that moves a
    -- row to another lock (a lock name column or expression whose value
    -- changes) would otherwise be checked against the new lock alone, and a
    -- holder superseded on the row's lock who holds the other lock's latest
    -- token would overwrite the newer holder's write. Refused; move a row by
    -- deleting it under its lock's token and inserting it under the other's.
    IF old_src IS DISTINCT FROM new_src THEN
        moved := format($b$
    IF TG_OP = 'UPDATE' AND %1$s IS DISTINCT FROM %2$s THEN
        RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% moves a row from lock %% to lock %%',
                TG_TABLE_SCHEMA, TG_TABLE_NAME, coalesce(quote_literal(%1$s), 'NULL'), coalesce(quote_literal(%2$s), 'NULL')
            USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op UPDATE, key %%s, row fence %%s, new fence %%s, lock %%s, new lock %%s', %4$s,
                                  coalesce(OLD.%5$I::text, 'NULL'), coalesce(NEW.%5$I::text, 'NULL'),
                                  coalesce(%1$s, 'NULL'), coalesce(%2$s, 'NULL')),
                  HINT = 'A token vouches only for rows of its own lock: delete the row under its lock''s token '
                         '(pgfence.use_token) and insert it under the new lock''s.';
    END IF;$b$, old_src, new_src, fence_column, old_key, fence_column);
    ELSE
        moved := '';
    END IF;

    PERFORM pgfence.unguard(tbl);
    fn_name := 'guard_' || tbl::oid;

    -- In reentrant mode an UPDATE may keep the fence equal, but only if it
    -- assigns the fence column. Trigger a_mark (BEFORE UPDATE OF fence, fires
    -- first by name) calls the mark function, <trigger function>_mark, which
    -- encodes a fence kept equal as -1 - fence (and refuses a NULL or
    -- negative one); b_check decodes it. An UPDATE that does not name the
    -- fence column arrives unmarked. A fence that goes up needs no mark: the
    -- mark function returns at once and b_check checks it as in strict mode.
    -- (The first version of the guard marked every fence a_mark saw; only a
    -- fence kept equal is decided by the mark.)
    -- (Inside these templates %% is a literal percent for RAISE; %N$ are
    -- substituted by format() here.)
    IF mode = 'reentrant' THEN
        slow := format(' OR NEW.%I < 0', fence_column);
        mark := format($b$
BEGIN
    IF NEW.%1$I IS NULL OR NEW.%1$I < 0 OR NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
        IF NEW.%1$I IS NULL OR NEW.%1$I < 0 THEN
            RAISE EXCEPTION 'pgfence guard: %% of %%.%% must not be NULL or negative',
                    quote_ident(%2$L), TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %2$L;
        END IF;
        NEW.%1$I := -1 - NEW.%1$I;
    END IF;
    RETURN NEW;
END
$b$, fence_column, fence_column);
        -- A fence the mark kept equal skips the checks of a fence not
        -- raised, not the lookup: it must still be the latest token of the
        -- row's lock (a superseded holder's reentrant write is PF008). A
        -- fence kept at 0 carries no token and is not taken as marked.
        marked := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < -1 AND -1 - NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
            NEW.%1$I := -1 - NEW.%1$I;  -- marked: the UPDATE assigns the fence and keeps it
        ELSE$b$, fence_column);
        marked_end := E'\n        END IF;';
        assigned := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < 0 THEN
            NEW.%1$I := -1 - NEW.%1$I;
        END IF;$b$, fence_column);
    ELSE
        slow := '';
        marked := '';
        marked_end := '';
        assigned := '';
    END IF;

    -- The trigger function. Its fast path, an INSERT or an UPDATE that raises
    -- the fence (OLD is NULL in an INSERT), evaluates two conditions and runs
    -- one statement, the lookup in pgfence.locks. Everything else (a DELETE,
    -- a fence not raised, the reentrant mode's mark) takes the slow path; the
    -- checks and the errors of every path are those of the first version of
    -- the guard, in the same order.
    body := format($b$
#variable_conflict use_column
DECLARE
    pgf_issued    bigint;
    pgf_lock      text;
    pgf_token     bigint;
    pgf_old_fence bigint;
BEGIN%13$s
    IF NEW.%1$I IS NULL OR NEW.%1$I <= coalesce(OLD.%1$I, 0)%10$s THEN%11$s
        IF TG_OP = 'DELETE' THEN
            pgf_lock := %6$s;
            pgf_token := nullif(current_setting('pgfence.token', true), '')::bigint;
            pgf_old_fence := coalesce(OLD.%1$I, 0);
            IF pgf_token IS NULL THEN
                RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% carries no fencing token', TG_TABLE_SCHEMA, TG_TABLE_NAME
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op DELETE, key %%s, row fence %%s, token none, lock %%s', %8$s, pgf_old_fence,
                                          coalesce(pgf_lock, 'NULL')),
                          HINT = 'Delete through a fenced statement, or call pgfence.use_token(<token>) earlier in the transaction.';
            END IF;
            IF pgf_old_fence > pgf_token THEN
                RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% with stale token %% (row fence %%)',
                        TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, pgf_old_fence
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op DELETE, key %%s, row fence %%s, token %%s, lock %%s', %8$s, pgf_old_fence,
                                          pgf_token, coalesce(pgf_lock, 'NULL'));
            END IF;
            SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = pgf_lock;
            IF pgf_issued = pgf_token THEN
                RETURN OLD;
            END IF;
            IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                        coalesce(pgf_issued::text, 'none')
                    USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                          HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
            END IF;
            IF pgf_token < pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
                    USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          pgf_lock, pgf_issued),
                          HINT = 'The lease was granted to someone else: stop and re-acquire.';
            END IF;
            RETURN OLD;
        END IF;
        pgf_old_fence := coalesce(OLD.%1$I, 0);%2$s
        IF NEW.%1$I IS NULL OR NEW.%1$I <= pgf_old_fence THEN
            IF TG_OP = 'INSERT' OR (NEW.%1$I IS NOT NULL AND NEW.%1$I = pgf_old_fence) THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% does not raise %% (still %%): no fencing token?',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, new fence %%s, mode %%s', TG_OP, %7$s,
                                          pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L),
                          HINT = 'Write through a fenced statement: SET ' || quote_ident(%3$L)
                                 || ' = <token> ... WHERE <key> AND ' || quote_ident(%3$L) || ' < <token>';
            END IF;
            RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% would lower %% from %% to %% (stale token)',
                    TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL')
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op UPDATE, key %%s, row fence %%s, new fence %%s, mode %%s', %7$s,
                                      pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L);
        END IF;%12$s
    END IF;
    %5$s
    IF pgf_issued = NEW.%1$I THEN
        RETURN NEW;
    END IF;
    pgf_old_fence := coalesce(OLD.%1$I, 0);
    pgf_token := NEW.%1$I;%9$s
    IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                coalesce(pgf_issued::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
    END IF;
    IF pgf_token < pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
            USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  pgf_lock, pgf_issued),
                  HINT = 'The lease was granted to someone else: stop and re-acquire.';
    END IF;
    RETURN NEW;
END
$b$, fence_column, assigned, fence_column, mode,
      lookup, old_src, new_key, old_key, name_late, slow, marked, marked_end, moved);

    -- enable_seqscan = off: the lookup reads pgfence.locks through its primary
    -- key even while the table is small enough for the planner to prefer a
    -- sequential scan, which reads every lock (and every dead version of
    -- one) on each check.
    EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql '
                   'SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS %L',
                   fn_name, body);
    -- A trigger function needs no EXECUTE to fire; nobody calls it directly.
    EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name);
    EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name,
                   'pgfence guard for ' || tbl::text || ', generated by pgfence.guard(); dropped by pgfence.unguard().');
    IF mode = 'reentrant' THEN
        EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
                       fn_name || '_mark', mark);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name || '_mark');
        EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name || '_mark',
                       'pgfence guard for ' || tbl::text || ' (reentrant): marks a fence kept equal by an UPDATE that '
                       'assigns it. Generated by pgfence.guard(); dropped by pgfence.unguard().');
        EXECUTE format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %I ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I()',
                       fence_column, tbl, fn_name || '_mark');
        EXECUTE format('COMMENT ON TRIGGER pgfence_guard_a_mark ON %s IS %L', tbl,
                       'pgfence guard (reentrant): marks UPDATEs that assign the fence column. See pgfence.guarded_tables.');
    END IF;
    EXECUTE format('CREATE TRIGGER pgfence_guard_b_check BEFORE INSERT OR UPDATE OR DELETE ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                   tbl, fn_name, 'check');
    EXECUTE format('COMMENT ON TRIGGER pgfence_guard_b_check ON %s IS %L', tbl,
                   'pgfence guard (' || mode || '): refuses INSERT, UPDATE and DELETE without the latest token of the row''s lock. '
                   'See pgfence.guarded_tables; detach with pgfence.unguard().');
    INSERT INTO pgfence.guarded_tables (relid, fence_column, lock_name, lock_name_column, lock_name_expression, mode, trigger_function)
    VALUES (tbl, fence_column, lock_name, lock_name_column, lock_name_expression, mode, fn_name);
END
$fn$;
-- +goose StatementEnd

-- Attach every guard again, so that it gets the functions generated above.
-- +goose StatementBegin
DO $regen$
DECLARE
    g     record;
    owner name;
    fn    text;
    f     text;
BEGIN
    FOR g IN SELECT t.relid::oid AS oid, t.lock_name, t.lock_name_column, t.fence_column, t.mode,
                    t.lock_name_expression, t.trigger_function, t.guarded_at, t.guarded_by
               FROM pgfence.guarded_tables t
              WHERE EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.relid)
              ORDER BY t.relid::oid
    LOOP
        SELECT pg_get_userbyid(p.proowner) INTO owner FROM pg_proc p
         WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname = g.trigger_function AND p.pronargs = 0;
        BEGIN
            PERFORM pgfence.guard(g.oid::regclass, g.lock_name, g.lock_name_column, g.fence_column, g.mode,
                                  g.lock_name_expression);
            UPDATE pgfence.guarded_tables SET guarded_at = g.guarded_at, guarded_by = g.guarded_by
             WHERE relid = g.oid::regclass
            RETURNING trigger_function INTO fn;
            IF owner IS NOT NULL AND owner <> current_user THEN
                FOR f IN SELECT p.proname FROM pg_proc p
                          WHERE p.pronamespace = 'pgfence'::regnamespace AND p.pronargs = 0
                            AND p.proname IN (fn, fn || '_mark')
                LOOP
                    EXECUTE format('ALTER FUNCTION pgfence.%I() OWNER TO %I', f, owner);
                END LOOP;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'pgfence: the guard of % keeps the trigger functions it had: %', g.oid::regclass, SQLERRM
                USING HINT = 'Attach it again with pgfence.guard(), as the table''s owner, with the options in '
                             'pgfence.guarded_tables.';
        END;
    END LOOP;
END
$regen$;
-- +goose StatementEnd


-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_grant(name text, holder text, ttl_us bigint, key bytea,
    OUT token bigint, OUT expires_at timestamptz, OUT held_by text, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_grant.name IS NULL OR octet_length(lock_grant.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.holder IS NULL OR octet_length(lock_grant.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.ttl_us IS NULL OR lock_grant.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_grant.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.key IS NULL OR octet_length(lock_grant.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_grant.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    UPDATE pgfence.locks AS l
    SET token = l.token + 1, holder = lock_grant.holder, key_hash = sha256(lock_grant.key),
        acquired_at = now(), renewed_at = NULL,
        expires_at = now() + lock_grant.ttl_us * interval '1 microsecond'
    WHERE l.name = lock_grant.name AND (l.holder IS NULL OR l.expires_at <= now())
    RETURNING l.token, l.expires_at INTO lock_grant.token, lock_grant.expires_at;
    IF NOT FOUND THEN
        SELECT l.holder, l.expires_at INTO lock_grant.held_by, lock_grant.expires_at
        FROM pgfence.locks AS l WHERE l.name = lock_grant.name;
        IF FOUND THEN
            IF lock_grant.held_by IS NULL OR lock_grant.expires_at <= now() THEN
                lock_grant.held_by := NULL;  -- released or expired since the UPDATE: call again
                lock_grant.expires_at := NULL;
            END IF;
            RETURN;
        END IF;
        -- No row yet: the first grant of the name.
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        VALUES (lock_grant.name, 1, lock_grant.holder, sha256(lock_grant.key), now(), NULL,
                now() + lock_grant.ttl_us * interval '1 microsecond')
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at INTO lock_grant.token, lock_grant.expires_at;
        IF NOT FOUND THEN
            RETURN;  -- a concurrent first grant: call again
        END IF;
    END IF;
    PERFORM set_config('synchronous_commit', 'on', true);
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_grant_many(names text[], holder text, ttls_us bigint[], key bytea)
RETURNS TABLE (i integer, token bigint, expires_at timestamptz, held_by text, exhausted boolean, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    n integer := cardinality(lock_grant_many.names);
    kh bytea;
    bad record;
    e record;
    cur bigint;
    granted boolean := false;
    free_names text[];
    gi integer[];
    gt bigint[];
    ge timestamptz[];
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: names must have 1 to 10000 elements, got %',
            coalesce(n::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(lock_grant_many.ttls_us) IS DISTINCT FROM n THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: names and ttls_us must have the same number of elements, got %, %',
            n, coalesce(cardinality(lock_grant_many.ttls_us)::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant_many.holder IS NULL OR octet_length(lock_grant_many.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant_many.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant_many.key IS NULL OR octet_length(lock_grant_many.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_grant_many.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    SELECT r.i, r.nm, r.ttl INTO bad
    FROM unnest(lock_grant_many.names, lock_grant_many.ttls_us) WITH ORDINALITY AS r(nm, ttl, i)
    WHERE r.nm IS NULL OR octet_length(r.nm) NOT BETWEEN 1 AND 512
       OR r.ttl IS NULL OR r.ttl NOT BETWEEN 1000 AND 86400000000
    ORDER BY r.i
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgfence.lock_grant_many: element %: name must be 1 to 512 bytes and ttl_us 1000 to 86400000000 (1 ms to 24 hours), got % bytes, ttl_us %',
            bad.i, coalesce(octet_length(bad.nm)::text, 'NULL'), coalesce(bad.ttl::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_grant_many.key);
    lock_grant_many.db_now := now();
    -- Lock the free rows of the names, in byte order of the names.
    SELECT array_agg(f.name) INTO free_names
    FROM (SELECT l.name
          FROM pgfence.locks AS l
          WHERE l.name = ANY (lock_grant_many.names)
            AND (l.holder IS NULL OR l.expires_at <= now())
            AND l.token < 9223372036854775807
          ORDER BY l.name COLLATE "C"
          FOR NO KEY UPDATE OF l) AS f;
    -- Grant them: the first element of each name.
    IF free_names IS NOT NULL THEN
        WITH g AS (
            UPDATE pgfence.locks AS l
            SET token = l.token + 1, holder = lock_grant_many.holder, key_hash = kh,
                acquired_at = now(), renewed_at = NULL,
                expires_at = now() + rq.ttl * interval '1 microsecond'
            FROM (SELECT DISTINCT ON (x.nm) x.nm, x.ttl, x.i
                  FROM unnest(lock_grant_many.names, lock_grant_many.ttls_us) WITH ORDINALITY AS x(nm, ttl, i)
                  WHERE x.nm = ANY (free_names)
                  ORDER BY x.nm, x.i) AS rq
            WHERE l.name = rq.nm AND l.name = ANY (free_names)
              AND (l.holder IS NULL OR l.expires_at <= now())
              AND l.token < 9223372036854775807
            RETURNING rq.i::integer AS i, l.token, l.expires_at
        )
        SELECT array_agg(g.i), array_agg(g.token), array_agg(g.expires_at) INTO gi, gt, ge FROM g;
        IF gi IS NOT NULL THEN
            granted := true;
            RETURN QUERY
            SELECT u.i, u.t, u.e, NULL::text, false, lock_grant_many.db_now
            FROM unnest(gi, gt, ge) AS u(i, t, e);
        END IF;
    END IF;
    -- Every other element, one by one.
    FOR e IN
        SELECT x.nm, x.ttl, x.i::integer AS i
        FROM unnest(lock_grant_many.names, lock_grant_many.ttls_us) WITH ORDINALITY AS x(nm, ttl, i)
        WHERE gi IS NULL OR x.i <> ALL (gi)
        ORDER BY x.nm COLLATE "C", x.i
    LOOP
        lock_grant_many.i := e.i;
        lock_grant_many.token := NULL;
        lock_grant_many.expires_at := NULL;
        lock_grant_many.held_by := NULL;
        lock_grant_many.exhausted := false;
        SELECT l.holder, l.expires_at, l.token INTO lock_grant_many.held_by, lock_grant_many.expires_at, cur
        FROM pgfence.locks AS l WHERE l.name = e.nm;
        IF FOUND THEN
            IF lock_grant_many.held_by IS NULL OR lock_grant_many.expires_at <= now() THEN
                -- Free now but not locked above (released or expired since,
                -- or its token is at the bigint maximum): call again.
                lock_grant_many.held_by := NULL;
                lock_grant_many.expires_at := NULL;
                lock_grant_many.exhausted := cur = 9223372036854775807;
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        -- No row yet: the first grant of the name.
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        VALUES (e.nm, 1, lock_grant_many.holder, kh, now(), NULL, now() + e.ttl * interval '1 microsecond')
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at INTO lock_grant_many.token, lock_grant_many.expires_at;
        IF FOUND THEN
            granted := true;
        END IF;
        RETURN NEXT;  -- not found: a concurrent first grant, call again
    END LOOP;
    IF granted THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_renew(name text, token bigint, key bytea, ttl_us bigint,
    OUT expires_at timestamptz, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_renew.name IS NULL OR octet_length(lock_renew.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_renew.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.token IS NULL OR lock_renew.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: token must be > 0, got %',
            coalesce(lock_renew.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.key IS NULL OR octet_length(lock_renew.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_renew.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.ttl_us IS NULL OR lock_renew.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_renew.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    UPDATE pgfence.locks AS l
    -- Never earlier than it is: two renewals of one lease may commit in
    -- the other order than they began (now() is each one's start).
    SET expires_at = greatest(l.expires_at, now() + lock_renew.ttl_us * interval '1 microsecond'), renewed_at = now()
    WHERE l.name = lock_renew.name AND l.token = lock_renew.token
      AND l.key_hash = sha256(lock_renew.key) AND l.expires_at > now()
    RETURNING l.expires_at INTO lock_renew.expires_at;
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_renew_many(names text[], tokens bigint[], key bytea, ttls_us bigint[])
RETURNS TABLE (name text, token bigint, expires_at timestamptz, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    n integer := cardinality(lock_renew_many.names);
    bad record;
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: names must have 1 to 10000 elements, got %',
            coalesce(n::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(lock_renew_many.tokens) IS DISTINCT FROM n OR cardinality(lock_renew_many.ttls_us) IS DISTINCT FROM n THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: names, tokens and ttls_us must have the same number of elements, got %, %, %',
            n, coalesce(cardinality(lock_renew_many.tokens)::text, 'NULL'),
            coalesce(cardinality(lock_renew_many.ttls_us)::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew_many.key IS NULL OR octet_length(lock_renew_many.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_renew_many.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    SELECT r.i, r.nm, r.t, r.ttl INTO bad
    FROM unnest(lock_renew_many.names, lock_renew_many.tokens, lock_renew_many.ttls_us) WITH ORDINALITY AS r(nm, t, ttl, i)
    WHERE r.nm IS NULL OR octet_length(r.nm) NOT BETWEEN 1 AND 512
       OR r.t IS NULL OR r.t <= 0
       OR r.ttl IS NULL OR r.ttl NOT BETWEEN 1000 AND 86400000000
    ORDER BY r.i
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgfence.lock_renew_many: element %: name must be 1 to 512 bytes, token > 0 and ttl_us 1000 to 86400000000 (1 ms to 24 hours), got % bytes, token %, ttl_us %',
            bad.i, coalesce(octet_length(bad.nm)::text, 'NULL'), coalesce(bad.t::text, 'NULL'),
            coalesce(bad.ttl::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- Lock this key's rows among the names in byte order of the names first,
    -- as lock_grant_many and lock_release_many do: the UPDATE below takes
    -- its rows in the order of its plan, and a release batch of the same
    -- Locker could otherwise hold one of them while waiting for another.
    PERFORM
    FROM (SELECT l.name
          FROM pgfence.locks AS l
          WHERE l.name = ANY (lock_renew_many.names) AND l.key_hash = sha256(lock_renew_many.key)
          ORDER BY l.name COLLATE "C"
          FOR NO KEY UPDATE OF l) AS h;
    RETURN QUERY
    UPDATE pgfence.locks AS l
    -- Never earlier than it is (see lock_renew).
    SET expires_at = greatest(l.expires_at, now() + r.ttl * interval '1 microsecond'), renewed_at = now()
    FROM unnest(lock_renew_many.names, lock_renew_many.tokens, lock_renew_many.ttls_us) AS r(nm, t, ttl)
    WHERE l.name = r.nm AND l.token = r.t
      AND l.key_hash = sha256(lock_renew_many.key) AND l.expires_at > now()
    RETURNING l.name, l.token, l.expires_at, now();
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_release_many(names text[], tokens bigint[], key bytea)
RETURNS TABLE (i integer, released boolean, handed_off boolean, notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    n integer := cardinality(lock_release_many.names);
    bad record;
    e record;
    r record;
    handed boolean := false;
    kh bytea;
    done integer[];
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: names must have 1 to 10000 elements, got %',
            coalesce(n::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(lock_release_many.tokens) IS DISTINCT FROM n THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: names and tokens must have the same number of elements, got %, %',
            n, coalesce(cardinality(lock_release_many.tokens)::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release_many.key IS NULL OR octet_length(lock_release_many.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_release_many.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    SELECT x.i, x.nm, x.t INTO bad
    FROM unnest(lock_release_many.names, lock_release_many.tokens) WITH ORDINALITY AS x(nm, t, i)
    WHERE x.nm IS NULL OR octet_length(x.nm) NOT BETWEEN 1 AND 512 OR x.t IS NULL OR x.t <= 0
    ORDER BY x.i
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgfence.lock_release_many: element %: name must be 1 to 512 bytes and token > 0, got % bytes, token %',
            bad.i, coalesce(octet_length(bad.nm)::text, 'NULL'), coalesce(bad.t::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_release_many.key);
    -- Lock the rows of the names held with this key, in byte order of the
    -- names.
    PERFORM
    FROM (SELECT l.name
          FROM pgfence.locks AS l
          WHERE l.name = ANY (lock_release_many.names) AND l.key_hash = kh
          ORDER BY l.name COLLATE "C"
          FOR NO KEY UPDATE OF l) AS h;
    -- Release in one UPDATE the first element of each name whose lease is
    -- live and nobody waits for (lock_release's plain release).
    WITH u AS (
        UPDATE pgfence.locks AS l
        SET holder = NULL, key_hash = NULL, renewed_at = NULL, expires_at = NULL
        FROM (SELECT DISTINCT ON (x.nm) x.nm, x.t, x.i
              FROM unnest(lock_release_many.names, lock_release_many.tokens) WITH ORDINALITY AS x(nm, t, i)
              ORDER BY x.nm, x.i) AS rq
        WHERE l.name = rq.nm AND l.token = rq.t
          AND l.key_hash = kh AND l.expires_at > now()
          AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '100 seconds')
          AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                          WHERE q.name = rq.nm
                            AND (q.granted_token IS NULL OR q.alive_until <= now()))
        RETURNING rq.i::integer AS i
    )
    SELECT array_agg(u.i) INTO done FROM u;
    IF done IS NOT NULL THEN
        RETURN QUERY SELECT d.i, true, false, false FROM unnest(done) AS d(i);
    END IF;
    -- Every other element: exactly lock_release, the handoff to the first
    -- live waiter and its NOTIFY included.
    FOR e IN
        SELECT x.nm, x.t, x.i::integer AS i
        FROM unnest(lock_release_many.names, lock_release_many.tokens) WITH ORDINALITY AS x(nm, t, i)
        WHERE done IS NULL OR x.i <> ALL (done)
        ORDER BY x.nm COLLATE "C", x.i
    LOOP
        SELECT g.released, g.handed_off, g.notified INTO r
        FROM pgfence.lock_release(e.nm, e.t, lock_release_many.key) AS g;
        lock_release_many.i := e.i;
        lock_release_many.released := r.released;
        lock_release_many.handed_off := r.handed_off;
        lock_release_many.notified := r.notified;
        handed := handed OR r.handed_off;
        RETURN NEXT;
    END LOOP;
    -- A handoff is a grant: the whole call is durable if any element handed
    -- a lease over; a plain release is not.
    PERFORM set_config('synchronous_commit', CASE WHEN handed THEN 'on' ELSE 'off' END, true);
END
$fn$;
-- +goose StatementEnd

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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_claim(queue text, holder text, ttl_ms bigint, max_jobs integer, key bytea)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    kh bytea;
BEGIN
    IF job_claim.queue IS NULL OR octet_length(job_claim.queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION 'pgfence.job_claim: queue must be 1 to 128 bytes, got %',
            coalesce(octet_length(job_claim.queue)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.holder IS NULL OR octet_length(job_claim.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.job_claim: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(job_claim.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.ttl_ms IS NULL OR job_claim.ttl_ms NOT BETWEEN 100 AND 86400000 THEN
        RAISE EXCEPTION 'pgfence.job_claim: ttl_ms must be 100 to 86400000 (100 ms to 24 hours), got %',
            coalesce(job_claim.ttl_ms::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.max_jobs IS NULL OR job_claim.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_claim: max_jobs must be 1 to 10000, got %',
            coalesce(job_claim.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.key IS NULL OR octet_length(job_claim.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.job_claim: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(job_claim.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(job_claim.key);
    -- The picked rows stay locked until the UPDATE, so a running one is one
    -- whose claim expired. The UPDATE finds them by primary key (id = ANY): a
    -- join with picked becomes, on a small table, a hash join over every row.
    RETURN QUERY
    WITH due AS (
        SELECT a.id, a.priority, a.run_at
        FROM pgfence.jobs a
        WHERE a.queue = job_claim.queue AND a.state = 'available' AND a.run_at <= now()
        ORDER BY a.priority, a.run_at, a.id
        LIMIT job_claim.max_jobs
        FOR UPDATE SKIP LOCKED
    ), expired AS (
        SELECT r.id, r.priority, r.run_at
        FROM pgfence.jobs r
        WHERE r.queue = job_claim.queue AND r.state = 'running' AND r.claim_expires_at <= now()
        ORDER BY r.claim_expires_at
        LIMIT job_claim.max_jobs
        FOR UPDATE SKIP LOCKED
    ), picked AS (
        SELECT c.id
        FROM (SELECT d.id, d.priority, d.run_at FROM due d
              UNION ALL
              SELECT e.id, e.priority, e.run_at FROM expired e) AS c
        ORDER BY c.priority, c.run_at, c.id
        LIMIT job_claim.max_jobs
    ), claimed AS (
        UPDATE pgfence.jobs j
        SET state            = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN 'dead' ELSE 'running' END,
            attempts         = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.attempts ELSE j.attempts + 1 END,
            holder           = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.holder ELSE job_claim.holder END,
            claim_token      = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.claim_token
                                    ELSE nextval('pgfence.jobs_claim_token_seq') END,
            claim_key_hash   = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.claim_key_hash ELSE kh END,
            claim_expires_at = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN NULL
                                    ELSE statement_timestamp() + job_claim.ttl_ms * interval '1 millisecond' END,
            last_error       = CASE WHEN j.state = 'running'
                                    THEN 'claim ' || j.claim_token || ' of ' || j.holder || ' expired at ' || j.claim_expires_at
                                    ELSE j.last_error END,
            finished_at      = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN now() END,
            claim_outcome    = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN 'expired' END,
            updated_at       = now()
        WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
        RETURNING j.*
    )
    SELECT c.* FROM claimed c
    WHERE c.state = 'running'
    ORDER BY c.priority, c.run_at, c.id;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_claim_tx(queue text, max_jobs integer)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    r pgfence.jobs%ROWTYPE;
    got bigint[] := '{}';
    prev text;
    me text;
BEGIN
    IF job_claim_tx.queue IS NULL OR octet_length(job_claim_tx.queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: queue must be 1 to 128 bytes, got %',
            coalesce(octet_length(job_claim_tx.queue)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim_tx.max_jobs IS NULL OR job_claim_tx.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: max_jobs must be 1 to 10000, got %',
            coalesce(job_claim_tx.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    FOR r IN
        SELECT j.* FROM pgfence.jobs j
        WHERE j.queue = job_claim_tx.queue AND j.state = 'available' AND j.run_at <= now()
        ORDER BY j.priority, j.run_at, j.id
        LIMIT job_claim_tx.max_jobs
        FOR UPDATE SKIP LOCKED
    LOOP
        got := got || r.id;
        RETURN NEXT r;
    END LOOP;
    IF cardinality(got) > 0 THEN
        -- Remember the claims for job_complete_tx and job_fail_tx, for this
        -- transaction only: "<transaction id>:,id,id,...,", the id assigned
        -- by the row locks taken above. A savepoint rolled back takes its
        -- claims (row locks and setting) with it.
        me := pg_current_xact_id()::text;
        prev := current_setting('pgfence.job_tx_claims', true);
        IF prev IS NULL OR split_part(prev, ':', 1) <> me THEN
            prev := me || ':,';  -- none yet, or another transaction's
        END IF;
        PERFORM set_config('pgfence.job_tx_claims', prev || array_to_string(got, ',') || ',', true);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_fail_tx(id bigint, last_error text, retry_in_ms bigint, give_up boolean)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    claims text;
BEGIN
    IF job_fail_tx.id IS NULL OR job_fail_tx.id <= 0 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: id must be > 0, got %',
            coalesce(job_fail_tx.id::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.last_error IS NULL OR octet_length(job_fail_tx.last_error) > 8192 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: last_error must be 0 to 8192 bytes, got %',
            coalesce(octet_length(job_fail_tx.last_error)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.retry_in_ms IS NULL OR job_fail_tx.retry_in_ms NOT BETWEEN 0 AND 31536000000 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: retry_in_ms must be 0 to 31536000000 (a year), got %',
            coalesce(job_fail_tx.retry_in_ms::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.give_up IS NULL THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: give_up must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    -- Only a job job_claim_tx claimed in this transaction (see
    -- job_complete_tx).
    claims := current_setting('pgfence.job_tx_claims', true);
    IF claims IS NULL
       OR split_part(claims, ':', 1) IS DISTINCT FROM pg_current_xact_id_if_assigned()::text
       OR position(',' || job_fail_tx.id::text || ',' IN claims) = 0 THEN
        RETURN;
    END IF;
    PERFORM 1 FROM pgfence.jobs l
    WHERE l.id = job_fail_tx.id AND l.state = 'available' AND l.run_at <= now()
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET attempts    = j.attempts + 1,
        state       = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN 'dead' ELSE 'available' END,
        run_at      = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN j.run_at
                           ELSE now() + job_fail_tx.retry_in_ms * interval '1 millisecond' END,
        finished_at = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN now() END,
        last_error  = job_fail_tx.last_error,
        updated_at  = now()
    WHERE j.id = job_fail_tx.id AND j.state = 'available'
    RETURNING j.*;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_update(key text, value jsonb, token bigint, reentrant boolean,
    OUT applied boolean, OUT fence bigint, OUT updated_at timestamptz, OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_update.key IS NULL OR octet_length(fenced_value_update.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_update.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.token IS NULL OR fenced_value_update.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: token must be > 0, got %',
            coalesce(fenced_value_update.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.value IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: value must be a jsonb value (JSON null is ''null''), got NULL'
            USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.reentrant IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: reentrant must be true or false, got NULL'
            USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.fenced_values AS v
    SET value = fenced_value_update.value, fence = fenced_value_update.token, updated_at = now()
    WHERE v.key = fenced_value_update.key
      AND (v.fence < fenced_value_update.token
           OR (fenced_value_update.reentrant AND v.fence = fenced_value_update.token))
    RETURNING true, v.fence, v.updated_at
    INTO fenced_value_update.applied, fenced_value_update.fence, fenced_value_update.updated_at;
    fenced_value_update.row_found := FOUND;
    IF NOT fenced_value_update.row_found THEN
        SELECT c.fence, c.updated_at
        INTO fenced_value_update.fence, fenced_value_update.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_update.key;
        fenced_value_update.row_found := FOUND;
        fenced_value_update.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_upsert(key text, value jsonb, token bigint, reentrant boolean,
    OUT applied boolean, OUT fence bigint, OUT updated_at timestamptz, OUT inserted boolean,
    OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_upsert.key IS NULL OR octet_length(fenced_value_upsert.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_upsert.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.token IS NULL OR fenced_value_upsert.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: token must be > 0, got %',
            coalesce(fenced_value_upsert.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.value IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: value must be a jsonb value (JSON null is ''null''), got NULL'
            USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.reentrant IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: reentrant must be true or false, got NULL'
            USING ERRCODE = 'PF011';
    END IF;
    INSERT INTO pgfence.fenced_values AS t (key, value, fence, updated_at)
    VALUES (fenced_value_upsert.key, fenced_value_upsert.value, fenced_value_upsert.token, now())
    ON CONFLICT ON CONSTRAINT fenced_values_pkey DO UPDATE
    SET value = excluded.value, fence = excluded.fence, updated_at = excluded.updated_at
    WHERE t.fence < excluded.fence
       OR (fenced_value_upsert.reentrant AND t.fence = excluded.fence)
    RETURNING true, t.fence, t.updated_at, t.xmax = 0
    INTO fenced_value_upsert.applied, fenced_value_upsert.fence, fenced_value_upsert.updated_at,
         fenced_value_upsert.inserted;
    fenced_value_upsert.row_found := FOUND;
    IF NOT fenced_value_upsert.row_found THEN
        SELECT c.fence, c.updated_at
        INTO fenced_value_upsert.fence, fenced_value_upsert.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_upsert.key;
        fenced_value_upsert.row_found := FOUND;
        fenced_value_upsert.applied := false;
        fenced_value_upsert.inserted := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_delete(key text, token bigint,
    OUT applied boolean, OUT fence bigint, OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_delete.key IS NULL OR octet_length(fenced_value_delete.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_delete: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_delete.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_delete.token IS NULL OR fenced_value_delete.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_delete: token must be > 0, got %',
            coalesce(fenced_value_delete.token::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.fenced_values AS v
    WHERE v.key = fenced_value_delete.key AND v.fence <= fenced_value_delete.token
    RETURNING true, v.fence
    INTO fenced_value_delete.applied, fenced_value_delete.fence;
    fenced_value_delete.row_found := FOUND;
    IF NOT fenced_value_delete.row_found THEN
        SELECT c.fence
        INTO fenced_value_delete.fence
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_delete.key;
        fenced_value_delete.row_found := FOUND;
        fenced_value_delete.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fenced_value_read(key text, token bigint,
    OUT applied boolean, OUT value jsonb, OUT fence bigint, OUT updated_at timestamptz,
    OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_read.key IS NULL OR octet_length(fenced_value_read.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_read: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_read.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_read.token IS NULL OR fenced_value_read.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_read: token must be > 0, got %',
            coalesce(fenced_value_read.token::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.fenced_values AS v
    SET fence = fenced_value_read.token
    WHERE v.key = fenced_value_read.key AND v.fence <= fenced_value_read.token
    RETURNING true, v.value, v.fence, v.updated_at
    INTO fenced_value_read.applied, fenced_value_read.value, fenced_value_read.fence, fenced_value_read.updated_at;
    fenced_value_read.row_found := FOUND;
    IF NOT fenced_value_read.row_found THEN
        SELECT c.value, c.fence, c.updated_at
        INTO fenced_value_read.value, fenced_value_read.fence, fenced_value_read.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_read.key;
        fenced_value_read.row_found := FOUND;
        fenced_value_read.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.fence_refused(
    table_name text,
    key        text,
    mode       text,
    token      bigint,
    fence      bigint,
    row_found  boolean
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    detail text := format('token %s, fence %s, table %s, key %s',
                          coalesce(token::text, 'NULL'), coalesce(fence::text, 'NULL'), table_name, key);
BEGIN
    IF token IS NULL OR token <= 0 THEN
        RAISE EXCEPTION 'pgfence: write to % refused: invalid token %', table_name, coalesce(token::text, 'NULL')
            USING ERRCODE = 'PF007', DETAIL = detail;
    ELSIF row_found IS NULL OR mode IS NULL OR mode NOT IN ('strict', 'reentrant')
          OR (row_found AND (fence IS NULL OR fence < 0)) THEN
        RAISE EXCEPTION 'pgfence.fence_refused: mode must be strict or reentrant, row_found not NULL, and fence >= 0 for a row found; got mode %, row_found %, fence %',
                coalesce(quote_literal(mode), 'NULL'), coalesce(row_found::text, 'NULL'), coalesce(fence::text, 'NULL')
            USING ERRCODE = 'PF011', DETAIL = detail;
    ELSIF NOT row_found THEN
        RAISE EXCEPTION 'pgfence: write to % refused: no row with key %', table_name, key
            USING ERRCODE = 'PF005', DETAIL = detail;
    ELSIF fence > token THEN
        RAISE EXCEPTION 'pgfence: write to % refused: stale token % (the row''s fence is %: a newer grant wrote it)',
                table_name, token, fence
            USING ERRCODE = 'PF003', DETAIL = detail;
    ELSIF fence = token AND mode = 'strict' THEN
        RAISE EXCEPTION 'pgfence: write to % refused: already applied (this grant, token %, wrote the row)',
                table_name, token
            USING ERRCODE = 'PF004', DETAIL = detail;
    END IF;
    RAISE EXCEPTION 'pgfence: write to % refused: the row changed concurrently; the write was not applied', table_name
        USING ERRCODE = 'PF006', DETAIL = detail;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue(
    lock_name       text,
    token           bigint,
    key             bytea,
    topic           text,
    idempotency_key text,
    payload         jsonb,
    max_attempts    integer DEFAULT 25,
    run_at          timestamptz DEFAULT NULL
) RETURNS TABLE (intent_id bigint, duplicate boolean, intent_topic text, intent_lock_name text, intent_token bigint,
                 enqueued_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    latest  bigint;
    held_by text;
    expires timestamptz;
    kh      bytea;
    jid     bigint;
BEGIN
    -- 1. The arguments.
    IF outbox_enqueue.lock_name IS NULL OR octet_length(outbox_enqueue.lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: lock_name must be 1 to 512 bytes, got %',
            coalesce(octet_length(outbox_enqueue.lock_name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.token IS NULL OR outbox_enqueue.token <= 0 THEN
        PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                             outbox_enqueue.token, NULL);  -- PF007
    ELSIF outbox_enqueue.key IS NULL OR octet_length(outbox_enqueue.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: key must be 16 to 64 random bytes (the lease''s key), got %',
            coalesce(octet_length(outbox_enqueue.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.topic IS NULL OR outbox_enqueue.topic !~ '^[A-Za-z0-9._:/-]{1,100}$' THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: topic must be 1 to 100 bytes of ASCII letters, digits and . _ : / -, got %',
            coalesce(CASE WHEN octet_length(outbox_enqueue.topic) BETWEEN 1 AND 100 THEN 'another character'
                          ELSE octet_length(outbox_enqueue.topic)::text || ' bytes' END, 'NULL')
            USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.idempotency_key IS NULL OR outbox_enqueue.idempotency_key !~ '^[!-~]{1,255}$' THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: idempotency_key must be 1 to 255 visible ASCII characters, got %',
            coalesce(CASE WHEN octet_length(outbox_enqueue.idempotency_key) BETWEEN 1 AND 255 THEN 'another character'
                          ELSE octet_length(outbox_enqueue.idempotency_key)::text || ' bytes' END, 'NULL')
            USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: payload must not be NULL' USING ERRCODE = '22004';
    ELSIF octet_length(outbox_enqueue.payload::text) > 1048576 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: payload must be at most 1048576 bytes in its text form, got %',
                octet_length(outbox_enqueue.payload::text) || ' bytes'
            USING ERRCODE = '23514', SCHEMA = 'pgfence', TABLE = 'outbox', CONSTRAINT = 'outbox_payload_size';
    ELSIF outbox_enqueue.max_attempts IS NULL OR outbox_enqueue.max_attempts NOT BETWEEN 1 AND 1000000 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: max_attempts must be 1 to 1000000, got %',
            coalesce(outbox_enqueue.max_attempts::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- 2. The token must be the lock's latest grant (checked again at COMMIT,
    --    under a lock, by trigger outbox_check_token), and the lease held
    --    with this key.
    SELECT l.token, l.holder, l.expires_at, l.key_hash INTO latest, held_by, expires, kh
    FROM pgfence.locks l WHERE l.name = outbox_enqueue.lock_name;
    PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                         outbox_enqueue.token, latest);
    IF held_by IS NULL OR NOT expires > now() OR kh IS DISTINCT FROM sha256(outbox_enqueue.key) THEN
        RAISE EXCEPTION 'pgfence outbox: intent % refused: the lease of lock % with token % is not held with this key (%)',
                jsonb_build_object('idempotency_key', outbox_enqueue.idempotency_key)::text,
                quote_literal(outbox_enqueue.lock_name), outbox_enqueue.token,
                CASE WHEN held_by IS NULL THEN 'released' WHEN NOT expires > now() THEN 'expired'
                     ELSE 'held with another key' END
            USING ERRCODE = 'PF012', SCHEMA = 'pgfence', TABLE = 'outbox',
                  DETAIL = format('op INSERT, key %s, token %s, lock %s, latest token %s',
                                  jsonb_build_object('idempotency_key', outbox_enqueue.idempotency_key)::text,
                                  outbox_enqueue.token, outbox_enqueue.lock_name, latest),
                  HINT = 'Pass the lease of the current holder with its own key (pglock: Lease.Key()).';
    END IF;
    FOR attempt IN 1..3 LOOP
        -- 3. A key already recorded for this lock: the first intent wins.
        RETURN QUERY SELECT o.id, true, o.topic, o.lock_name, o.token, o.created_at
                       FROM pgfence.outbox o
                      WHERE o.lock_name = outbox_enqueue.lock_name
                        AND o.idempotency_key = outbox_enqueue.idempotency_key;
        IF FOUND THEN
            RETURN;
        END IF;
        -- 4. The delivery job, then the intent under the job's id.
        INSERT INTO pgfence.jobs (queue, run_at, max_attempts)
        VALUES ('outbox:' || outbox_enqueue.topic, coalesce(outbox_enqueue.run_at, now()), outbox_enqueue.max_attempts)
        RETURNING id INTO jid;
        INSERT INTO pgfence.outbox AS o (id, topic, idempotency_key, lock_name, token, payload)
        VALUES (jid, outbox_enqueue.topic, outbox_enqueue.idempotency_key, outbox_enqueue.lock_name,
                outbox_enqueue.token, outbox_enqueue.payload)
        ON CONFLICT ON CONSTRAINT outbox_key_unique DO NOTHING
        RETURNING o.id, false, o.topic, o.lock_name, o.token, o.created_at
             INTO intent_id, duplicate, intent_topic, intent_lock_name, intent_token, enqueued_at;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        -- A concurrent enqueue of the same lock and key committed first: drop
        -- the job and report that intent.
        DELETE FROM pgfence.jobs j WHERE j.id = jid;
    END LOOP;
    RAISE EXCEPTION 'pgfence outbox: key % of lock % keeps appearing and disappearing; not recorded',
            outbox_enqueue.idempotency_key, outbox_enqueue.lock_name
        USING ERRCODE = '40001';
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.test_expire_lease(name text) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    ended bigint;
BEGIN
    IF test_expire_lease.name IS NULL OR octet_length(test_expire_lease.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.test_expire_lease: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(test_expire_lease.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.locks AS l SET expires_at = now()
    WHERE l.name = test_expire_lease.name AND l.expires_at > now()
    RETURNING l.token INTO ended;
    RETURN coalesce(ended, 0);
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.attach_guard(
    tbl                  regclass,
    lock_name            text DEFAULT NULL,
    lock_name_column     text DEFAULT NULL,
    fence_column         text DEFAULT 'fence',
    mode                 text DEFAULT 'strict',
    lock_name_expression text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kind       "char";
    col_type   regtype;
    generated  "char";
    fn_name    text;
    lock_src   text;  -- an expression over the table's columns
    new_src    text;  -- the lock name of NEW / OLD in the trigger: a subquery or a literal
    old_src    text;
    new_key    text;  -- the row's primary key as JSON text, from NEW / OLD
    old_key    text;
    lookup     text;  -- the trigger's statement that reads the latest token of NEW's lock
    name_late  text;  -- sets pgf_lock from NEW when refusing ('' when lookup sets it)
    slow       text;  -- the reentrant mode's extra conditions of the slow path
    mark       text;  -- the body of the reentrant mode's mark function (trigger a_mark)
    marked     text;  -- b_check: a fence the mark kept equal (opens an IF ... ELSE)
    marked_end text;  -- b_check: closes it
    assigned   text;  -- b_check: decoding any other negative fence, as the first version did
    moved      text;  -- b_check: refuses an UPDATE that changes the row's lock ('' for one lock name)
    body       text;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'pgfence.guard: table must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF num_nonnulls(lock_name, lock_name_column, lock_name_expression) <> 1 THEN
        RAISE EXCEPTION 'pgfence.guard: pass exactly one of lock_name, lock_name_column and lock_name_expression'
            USING ERRCODE = '22023';
    END IF;
    IF lock_name IS NOT NULL AND octet_length(lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.guard: lock_name must be 1..512 bytes' USING ERRCODE = '22023';
    END IF;
    IF mode IS NULL OR mode NOT IN ('strict', 'reentrant') THEN
        RAISE EXCEPTION 'pgfence.guard: mode must be ''strict'' or ''reentrant'', not %', quote_nullable(mode)
            USING ERRCODE = '22023';
    END IF;
    SELECT relkind INTO kind FROM pg_class WHERE oid = tbl;
    IF kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION 'pgfence.guard: % is not a table', tbl USING ERRCODE = '42809';
    END IF;
    SELECT atttypid::regtype INTO col_type FROM pg_attribute
     WHERE attrelid = tbl AND attname = fence_column AND attnum > 0 AND NOT attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(fence_column)
            USING ERRCODE = '42703',
                  HINT = 'Add it first: ALTER TABLE ... ADD COLUMN fence bigint NOT NULL DEFAULT 0';
    END IF;
    IF col_type <> 'bigint'::regtype THEN
        RAISE EXCEPTION 'pgfence.guard: column %.% is %, want bigint', tbl, quote_ident(fence_column), col_type
            USING ERRCODE = '42804';
    END IF;
    IF lock_name_column IS NOT NULL THEN
        SELECT a.attgenerated INTO generated FROM pg_attribute a
         WHERE a.attrelid = tbl AND a.attname = lock_name_column AND a.attnum > 0 AND NOT a.attisdropped;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(lock_name_column)
                USING ERRCODE = '42703';
        END IF;
        IF generated = 's' THEN
            -- A BEFORE trigger sees a stored generated column as NULL: compute it
            -- from the row with the column's own generation expression.
            SELECT pg_get_expr(d.adbin, d.adrelid) INTO lock_src
              FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
             WHERE d.adrelid = tbl AND a.attname = lock_name_column;
        ELSE
            -- A plain column is read from the row directly (no subquery).
            new_src := format('NEW.%I::text', lock_name_column);
            old_src := format('OLD.%I::text', lock_name_column);
        END IF;
    ELSIF lock_name_expression IS NOT NULL THEN
        IF octet_length(lock_name_expression) NOT BETWEEN 1 AND 4096 THEN
            RAISE EXCEPTION 'pgfence.guard: lock_name_expression must be 1..4096 bytes' USING ERRCODE = '22023';
        END IF;
        lock_src := lock_name_expression;
    END IF;
    IF lock_src IS NOT NULL THEN
        -- Check that the expression compiles against the table's columns (and
        -- is one expression): nothing is read.
        BEGIN
            EXECUTE format('SELECT (%s)::text FROM %s AS pgfence_row LIMIT 0', lock_src, tbl);
        EXCEPTION WHEN OTHERS THEN
            RAISE EXCEPTION 'pgfence.guard: lock name expression % does not work on %: %', lock_src, tbl, SQLERRM
                USING ERRCODE = '22023';
        END;
        new_src := format('(SELECT (%s)::text FROM (SELECT (NEW).*) AS pgfence_row)', lock_src);
        old_src := format('(SELECT (%s)::text FROM (SELECT (OLD).*) AS pgfence_row)', lock_src);
        -- One statement computes the lock name and reads its latest token.
        lookup := format(E'SELECT pgf_s.pgf_name, l.token INTO pgf_lock, pgf_issued\n'
                         '      FROM (SELECT %s AS pgf_name) AS pgf_s LEFT JOIN pgfence.locks l ON l.name = pgf_s.pgf_name;',
                         new_src);
        name_late := '';
    ELSE
        IF lock_name IS NOT NULL THEN
            new_src := quote_literal(lock_name);
            old_src := new_src;
        END IF;
        -- A literal or a column of NEW: the lookup reads it as a parameter.
        lookup := format('SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = %s;', new_src);
        name_late := format(E'\n    pgf_lock := %s;', new_src);
    END IF;

    -- The row's primary key, for the errors (evaluated only when raising).
    SELECT 'pg_catalog.jsonb_build_object(' || string_agg(quote_literal(a.attname) || ', NEW.' || quote_ident(a.attname),
                                                          ', ' ORDER BY k.ord) || ')::text'
      INTO new_key
      FROM pg_index i
      CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = tbl AND i.indisprimary;
    IF new_key IS NULL THEN
        new_key := quote_literal('(no primary key)');
        old_key := new_key;
    ELSE
        old_key := replace(new_key, ', NEW.', ', OLD.');
    END IF;

    -- A token vouches for a row of its own lock only: an UPDATE that moves a
    -- row to another lock (a lock name column or expression whose value
    -- changes) would otherwise be checked against the new lock alone, and a
    -- holder superseded on the row's lock who holds the other lock's latest
    -- token would overwrite the newer holder's write. Refused; move a row by
    -- deleting it under its lock's token and inserting it under the other's.
    IF old_src IS DISTINCT FROM new_src THEN
        moved := format($b$
    IF TG_OP = 'UPDATE' AND %1$s IS DISTINCT FROM %2$s THEN
        RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% moves a row from lock %% to lock %%',
                TG_TABLE_SCHEMA, TG_TABLE_NAME, coalesce(quote_literal(%1$s), 'NULL'), coalesce(quote_literal(%2$s), 'NULL')
            USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op UPDATE, key %%s, row fence %%s, new fence %%s, lock %%s, new lock %%s', %4$s,
                                  coalesce(OLD.%5$I::text, 'NULL'), coalesce(NEW.%5$I::text, 'NULL'),
                                  coalesce(%1$s, 'NULL'), coalesce(%2$s, 'NULL')),
                  HINT = 'A token vouches only for rows of its own lock: delete the row under its lock''s token '
                         '(pgfence.use_token) and insert it under the new lock''s.';
    END IF;$b$, old_src, new_src, fence_column, old_key, fence_column);
    ELSE
        moved := '';
    END IF;

    PERFORM pgfence.unguard(tbl);
    fn_name := 'guard_' || tbl::oid;

    -- In reentrant mode an UPDATE may keep the fence equal, but only if it
    -- assigns the fence column. Trigger a_mark (BEFORE UPDATE OF fence, fires
    -- first by name) calls the mark function, <trigger function>_mark, which
    -- encodes a fence kept equal as -1 - fence (and refuses a NULL or
    -- negative one); b_check decodes it. An UPDATE that does not name the
    -- fence column arrives unmarked. A fence that goes up needs no mark: the
    -- mark function returns at once and b_check checks it as in strict mode.
    -- (The first version of the guard marked every fence a_mark saw; only a
    -- fence kept equal is decided by the mark.)
    -- (Inside these templates %% is a literal percent for RAISE; %N$ are
    -- substituted by format() here.)
    IF mode = 'reentrant' THEN
        slow := format(' OR NEW.%I < 0', fence_column);
        mark := format($b$
BEGIN
    IF NEW.%1$I IS NULL OR NEW.%1$I < 0 OR NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
        IF NEW.%1$I IS NULL OR NEW.%1$I < 0 THEN
            RAISE EXCEPTION 'pgfence guard: %% of %%.%% must not be NULL or negative',
                    quote_ident(%2$L), TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %2$L;
        END IF;
        NEW.%1$I := -1 - NEW.%1$I;
    END IF;
    RETURN NEW;
END
$b$, fence_column, fence_column);
        -- A fence the mark kept equal skips the checks of a fence not
        -- raised, not the lookup: it must still be the latest token of the
        -- row's lock (a superseded holder's reentrant write is PF008). A
        -- fence kept at 0 carries no token and is not taken as marked.
        marked := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < -1 AND -1 - NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
            NEW.%1$I := -1 - NEW.%1$I;  -- marked: the UPDATE assigns the fence and keeps it
        ELSE$b$, fence_column);
        marked_end := E'\n        END IF;';
        assigned := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < 0 THEN
            NEW.%1$I := -1 - NEW.%1$I;
        END IF;$b$, fence_column);
    ELSE
        slow := '';
        marked := '';
        marked_end := '';
        assigned := '';
    END IF;

    -- The trigger function. Its fast path, an INSERT or an UPDATE that raises
    -- the fence (OLD is NULL in an INSERT), evaluates two conditions and runs
    -- one statement, the lookup in pgfence.locks. Everything else (a DELETE,
    -- a fence not raised, the reentrant mode's mark) takes the slow path; the
    -- checks and the errors of every path are those of the first version of
    -- the guard, in the same order.
    body := format($b$
#variable_conflict use_column
DECLARE
    pgf_issued    bigint;
    pgf_lock      text;
    pgf_token     bigint;
    pgf_old_fence bigint;
BEGIN%13$s
    IF NEW.%1$I IS NULL OR NEW.%1$I <= coalesce(OLD.%1$I, 0)%10$s THEN%11$s
        IF TG_OP = 'DELETE' THEN
            pgf_lock := %6$s;
            pgf_token := nullif(current_setting('pgfence.token', true), '')::bigint;
            pgf_old_fence := coalesce(OLD.%1$I, 0);
            IF pgf_token IS NULL THEN
                RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% carries no fencing token', TG_TABLE_SCHEMA, TG_TABLE_NAME
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op DELETE, key %%s, row fence %%s, token none, lock %%s', %8$s, pgf_old_fence,
                                          coalesce(pgf_lock, 'NULL')),
                          HINT = 'Delete through a fenced statement, or call pgfence.use_token(<token>) earlier in the transaction.';
            END IF;
            IF pgf_old_fence > pgf_token THEN
                RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% with stale token %% (row fence %%)',
                        TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, pgf_old_fence
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op DELETE, key %%s, row fence %%s, token %%s, lock %%s', %8$s, pgf_old_fence,
                                          pgf_token, coalesce(pgf_lock, 'NULL'));
            END IF;
            SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = pgf_lock;
            IF pgf_issued = pgf_token THEN
                RETURN OLD;
            END IF;
            IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                        coalesce(pgf_issued::text, 'none')
                    USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                          HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
            END IF;
            IF pgf_token < pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
                    USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          pgf_lock, pgf_issued),
                          HINT = 'The lease was granted to someone else: stop and re-acquire.';
            END IF;
            RETURN OLD;
        END IF;
        pgf_old_fence := coalesce(OLD.%1$I, 0);%2$s
        IF NEW.%1$I IS NULL OR NEW.%1$I <= pgf_old_fence THEN
            IF TG_OP = 'INSERT' OR (NEW.%1$I IS NOT NULL AND NEW.%1$I = pgf_old_fence) THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% does not raise %% (still %%): no fencing token?',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, new fence %%s, mode %%s', TG_OP, %7$s,
                                          pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L),
                          HINT = 'Write through a fenced statement: SET ' || quote_ident(%3$L)
                                 || ' = <token> ... WHERE <key> AND ' || quote_ident(%3$L) || ' < <token>';
            END IF;
            RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% would lower %% from %% to %% (stale token)',
                    TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL')
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op UPDATE, key %%s, row fence %%s, new fence %%s, mode %%s', %7$s,
                                      pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L);
        END IF;%12$s
    END IF;
    %5$s
    IF pgf_issued = NEW.%1$I THEN
        RETURN NEW;
    END IF;
    pgf_old_fence := coalesce(OLD.%1$I, 0);
    pgf_token := NEW.%1$I;%9$s
    IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                coalesce(pgf_issued::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
    END IF;
    IF pgf_token < pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
            USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  pgf_lock, pgf_issued),
                  HINT = 'The lease was granted to someone else: stop and re-acquire.';
    END IF;
    RETURN NEW;
END
$b$, fence_column, assigned, fence_column, mode,
      lookup, old_src, new_key, old_key, name_late, slow, marked, marked_end, moved);

    -- enable_seqscan = off: the lookup reads pgfence.locks through its primary
    -- key even while the table is small enough for the planner to prefer a
    -- sequential scan, which reads every lock (and every dead version of
    -- one) on each check.
    EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql '
                   'SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS %L',
                   fn_name, body);
    -- A trigger function needs no EXECUTE to fire; nobody calls it directly.
    EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name);
    EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name,
                   'pgfence guard for ' || tbl::text || ', generated by pgfence.guard(); dropped by pgfence.unguard().');
    IF mode = 'reentrant' THEN
        EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
                       fn_name || '_mark', mark);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name || '_mark');
        EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name || '_mark',
                       'pgfence guard for ' || tbl::text || ' (reentrant): marks a fence kept equal by an UPDATE that '
                       'assigns it. Generated by pgfence.guard(); dropped by pgfence.unguard().');
        EXECUTE format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %I ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I()',
                       fence_column, tbl, fn_name || '_mark');
        EXECUTE format('COMMENT ON TRIGGER pgfence_guard_a_mark ON %s IS %L', tbl,
                       'pgfence guard (reentrant): marks UPDATEs that assign the fence column. See pgfence.guarded_tables.');
    END IF;
    EXECUTE format('CREATE TRIGGER pgfence_guard_b_check BEFORE INSERT OR UPDATE OR DELETE ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                   tbl, fn_name, 'check');
    EXECUTE format('COMMENT ON TRIGGER pgfence_guard_b_check ON %s IS %L', tbl,
                   'pgfence guard (' || mode || '): refuses INSERT, UPDATE and DELETE without the latest token of the row''s lock. '
                   'See pgfence.guarded_tables; detach with pgfence.unguard().');
    INSERT INTO pgfence.guarded_tables (relid, fence_column, lock_name, lock_name_column, lock_name_expression, mode, trigger_function)
    VALUES (tbl, fence_column, lock_name, lock_name_column, lock_name_expression, mode, fn_name);
END
$fn$;
-- +goose StatementEnd

-- Attach every guard again, with the functions of 00023's attach_guard.
-- +goose StatementBegin
DO $regen$
DECLARE
    g     record;
    owner name;
    fn    text;
    f     text;
BEGIN
    FOR g IN SELECT t.relid::oid AS oid, t.lock_name, t.lock_name_column, t.fence_column, t.mode,
                    t.lock_name_expression, t.trigger_function, t.guarded_at, t.guarded_by
               FROM pgfence.guarded_tables t
              WHERE EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.relid)
              ORDER BY t.relid::oid
    LOOP
        SELECT pg_get_userbyid(p.proowner) INTO owner FROM pg_proc p
         WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname = g.trigger_function AND p.pronargs = 0;
        BEGIN
            PERFORM pgfence.guard(g.oid::regclass, g.lock_name, g.lock_name_column, g.fence_column, g.mode,
                                  g.lock_name_expression);
            UPDATE pgfence.guarded_tables SET guarded_at = g.guarded_at, guarded_by = g.guarded_by
             WHERE relid = g.oid::regclass
            RETURNING trigger_function INTO fn;
            IF owner IS NOT NULL AND owner <> current_user THEN
                FOR f IN SELECT p.proname FROM pg_proc p
                          WHERE p.pronamespace = 'pgfence'::regnamespace AND p.pronargs = 0
                            AND p.proname IN (fn, fn || '_mark')
                LOOP
                    EXECUTE format('ALTER FUNCTION pgfence.%I() OWNER TO %I', f, owner);
                END LOOP;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'pgfence: the guard of % keeps the trigger functions it had: %', g.oid::regclass, SQLERRM
                USING HINT = 'Attach it again with pgfence.guard(), as the table''s owner, with the options in '
                             'pgfence.guarded_tables.';
        END;
    END LOOP;
END
$regen$;
-- +goose StatementEnd
