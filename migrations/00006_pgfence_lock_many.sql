-- pgfence.lock_grant_many and pgfence.lock_release_many: grant, or release,
-- many leases of one holder and key in one call, as pglock's Locker does with
-- the TryAcquire, Acquire (first attempt) and Release calls that queued while
-- its previous statement was out (one statement, one commit for all of them).
-- Each element is granted exactly as pgfence.lock_grant grants it, and released
-- exactly as pgfence.lock_release releases it (a handoff to the first live
-- waiter included), one after the other in the byte order of the names (then
-- of their positions), so two calls that share names take their row locks in
-- the same order and cannot deadlock. A name given twice is treated as two
-- calls in a row: the first may be granted, the second then finds it held.
--
-- Every role that may call lock_grant (lock_release) gets EXECUTE on
-- lock_grant_many (lock_release_many) here, so an application role keeps
-- working after this migration without a new grant (docs/migrations.md lists
-- them for new roles).

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_grant_many(names text[], holder text, ttls_us bigint[], key bytea)
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
COMMENT ON FUNCTION pgfence.lock_grant_many(text[], text, bigint[], bytea) IS
  'Grants each lease names[i] to holder for ttls_us[i] microseconds as lock_grant does, in one call (1 to 10000 '
  'names, granted in byte order of the names). A row per element, i its position (1-based): token and expires_at '
  'when granted; token NULL and held_by, expires_at of the holder when held (also by an earlier element of the same '
  'name); all NULL when the lease changed during the call (call again); exhausted when its token is at the bigint '
  'maximum (nothing changed). Bad arguments: PF011. Durable when anything was granted.';

REVOKE EXECUTE ON FUNCTION pgfence.lock_grant_many(text[], text, bigint[], bytea) FROM PUBLIC;

-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_release_many(names text[], tokens bigint[], key bytea)
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
COMMENT ON FUNCTION pgfence.lock_release_many(text[], bigint[], bytea) IS
  'Ends each lease (names[i], tokens[i]) held with key as lock_release does (a handoff to the first live waiter and '
  'its NOTIFY included), in one call (1 to 10000 leases, in byte order of the names). A row per element, i its '
  'position (1-based): released false means that lease was lost and not changed. Bad arguments: PF011. Durable when '
  'a lease was handed over.';

REVOKE EXECUTE ON FUNCTION pgfence.lock_release_many(text[], bigint[], bytea) FROM PUBLIC;

-- +goose StatementBegin
DO $grant$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole::text AS role
        FROM pg_proc p, aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgfence.lock_grant(text, text, bigint, bytea)'::regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgfence.lock_grant_many(text[], text, bigint[], bytea) TO %s', r.role);
    END LOOP;
    FOR r IN
        SELECT a.grantee::regrole::text AS role
        FROM pg_proc p, aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgfence.lock_release(text, bigint, bytea)'::regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgfence.lock_release_many(text[], bigint[], bytea) TO %s', r.role);
    END LOOP;
END
$grant$;
-- +goose StatementEnd

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
DROP FUNCTION pgfence.lock_release_many(text[], bigint[], bytea);
DROP FUNCTION pgfence.lock_grant_many(text[], text, bigint[], bytea);
