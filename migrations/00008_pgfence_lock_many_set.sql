-- pgfence.lock_grant_many and pgfence.lock_release_many, set-based: the
-- functions of 00006 answer exactly as before, but do the common case of a
-- batch in one UPDATE for all its elements instead of one plpgsql statement
-- (lock_release_many: one call of lock_release) per element. Measured on one
-- connection, 64 elements per call (grant then release): 00006 spent about
-- 39 us of server time per granted element and 47 us per released one,
-- mostly in starting one executor per element (each start also reads the
-- table's CHECK constraints again) and, for releases, in the nested SECURITY
-- DEFINER call; see the CHANGELOG for the figures after this migration.
--
-- What each function does now:
--   * lock_grant_many locks the rows of its names that are free (released or
--     expired, token below the bigint maximum), each name once, in byte order
--     of the names (SELECT ... ORDER BY name COLLATE "C" FOR NO KEY UPDATE
--     locks rows in the order it returns them), grants the first element of
--     each locked name in one UPDATE, then answers the other elements one by
--     one in byte order of the names: a name held (also by an earlier element
--     of the same name) is reported held; a name that became free after the
--     rows were locked is reported as changed (all NULL: call again), so that
--     no row is locked out of order; a name with no row yet is inserted, as
--     before.
--   * lock_release_many locks the rows of its names held with its key, in
--     byte order of the names, releases in one UPDATE the first element of
--     each name whose lease is live and has no waiter (lock_release's plain
--     release), then calls lock_release for every other element, in byte
--     order of the names: a handoff to the first live waiter (with its
--     NOTIFY), a lease lost, a name given again.
--   * Both run with enable_seqscan off: pgfence.locks is small and often
--     updated, so the planner would read it whole (once per element, in a
--     nested loop) rather than through its primary key.
-- Rows are locked in one order by every statement that locks more than one
-- (these two; lock_renew_many renews only leases of its own key), so two
-- batches cannot deadlock over their names. Grants stay durable: a call that
-- granted or handed over anything commits with synchronous_commit on.
--
-- Grants, comments and signatures do not change (CREATE OR REPLACE). The
-- Down restores the bodies of 00006.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_grant_many(names text[], holder text, ttls_us bigint[], key bytea)
RETURNS TABLE (i integer, token bigint, expires_at timestamptz, held_by text, exhausted boolean, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
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
CREATE OR REPLACE FUNCTION pgfence.lock_release_many(names text[], tokens bigint[], key bytea)
RETURNS TABLE (i integer, released boolean, handed_off boolean, notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
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

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_grant_many(names text[], holder text, ttls_us bigint[], key bytea)
RETURNS TABLE (i integer, token bigint, expires_at timestamptz, held_by text, exhausted boolean, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer := cardinality(lock_grant_many.names);
    kh bytea;
    bad record;
    e record;
    cur bigint;
    granted boolean := false;
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
    FOR e IN
        SELECT r.nm, r.ttl, r.i::integer AS i
        FROM unnest(lock_grant_many.names, lock_grant_many.ttls_us) WITH ORDINALITY AS r(nm, ttl, i)
        ORDER BY r.nm COLLATE "C", r.i
    LOOP
        lock_grant_many.i := e.i;
        lock_grant_many.token := NULL;
        lock_grant_many.expires_at := NULL;
        lock_grant_many.held_by := NULL;
        lock_grant_many.exhausted := false;
        -- As lock_grant, except that a token at the bigint maximum is
        -- reported (exhausted) instead of failing the whole call.
        UPDATE pgfence.locks AS l
        SET token = l.token + 1, holder = lock_grant_many.holder, key_hash = kh,
            acquired_at = now(), renewed_at = NULL,
            expires_at = now() + e.ttl * interval '1 microsecond'
        WHERE l.name = e.nm AND (l.holder IS NULL OR l.expires_at <= now())
          AND l.token < 9223372036854775807
        RETURNING l.token, l.expires_at INTO lock_grant_many.token, lock_grant_many.expires_at;
        IF FOUND THEN
            granted := true;
            RETURN NEXT;
            CONTINUE;
        END IF;
        SELECT l.holder, l.expires_at, l.token INTO lock_grant_many.held_by, lock_grant_many.expires_at, cur
        FROM pgfence.locks AS l WHERE l.name = e.nm;
        IF FOUND THEN
            IF lock_grant_many.held_by IS NULL OR lock_grant_many.expires_at <= now() THEN
                lock_grant_many.held_by := NULL;  -- released or expired since the UPDATE: call again
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
CREATE OR REPLACE FUNCTION pgfence.lock_release_many(names text[], tokens bigint[], key bytea)
RETURNS TABLE (i integer, released boolean, handed_off boolean, notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer := cardinality(lock_release_many.names);
    bad record;
    e record;
    r record;
    handed boolean := false;
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
    FOR e IN
        SELECT x.nm, x.t, x.i::integer AS i
        FROM unnest(lock_release_many.names, lock_release_many.tokens) WITH ORDINALITY AS x(nm, t, i)
        ORDER BY x.nm COLLATE "C", x.i
    LOOP
        -- Exactly lock_release, the handoff to the first live waiter and
        -- its NOTIFY included.
        SELECT g.released, g.handed_off, g.notified INTO r
        FROM pgfence.lock_release(e.nm, e.t, lock_release_many.key) AS g;
        lock_release_many.i := e.i;
        lock_release_many.released := r.released;
        lock_release_many.handed_off := r.handed_off;
        lock_release_many.notified := r.notified;
        handed := handed OR r.handed_off;
        RETURN NEXT;
    END LOOP;
    -- lock_release sets synchronous_commit for its own call: off for a plain
    -- release, on for a handoff. A handoff is a grant: the whole call is
    -- durable if any element handed a lease over.
    PERFORM set_config('synchronous_commit', CASE WHEN handed THEN 'on' ELSE 'off' END, true);
END
$fn$;
-- +goose StatementEnd
