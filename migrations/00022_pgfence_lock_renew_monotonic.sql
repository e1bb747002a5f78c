-- pgfence.lock_renew and pgfence.lock_renew_many never move a lease's expiry
-- earlier. Each set expires_at = now() + ttl, where now() is the start of its
-- transaction: of two renewals of one lease that overlap, the one that began
-- first could commit last and shorten the expiry below what the other had
-- answered. A Locker that keeps its leases alive (KeepAlive) and whose code
-- also calls Lease.Renew (an Elector on such a Locker does) did exactly that
-- when the keep-alive's batch waited for another row: the later Renew's
-- answer set the local deadline, the batch then committed an expiry up to a
-- round trip earlier, and another Locker was granted the name while the first
-- Lease still reported it held (TestRenewNeverShortens). The functions now
-- keep the later of the two expiries (greatest), and return it. A renewal
-- with a shorter TTL no longer shortens a lease: release it instead.
-- Signatures, settings, grants and the other answers do not change; the Down
-- restores the bodies of 00001 (lock_renew) and 00009 (lock_renew_many, with
-- 00012's plan_cache_mode).

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

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
COMMENT ON FUNCTION pgfence.lock_renew(text, bigint, bytea, bigint) IS
  'Extends the lease (name, token) held with key to ttl_us microseconds from now, or keeps its expiry if that is later. '
  'expires_at NULL: the lease is lost (expired, released, granted again, or not this key); nothing changed. Bad '
  'arguments: PF011. Durable.';

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
COMMENT ON FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]) IS
  'Extends each lease (names[i], tokens[i]) held with key to ttls_us[i] microseconds from now, or keeps its expiry if '
  'that is later, as lock_renew does, in one call (1 to 10000 leases). Returns a row per lease renewed; a lease '
  'without a row is lost (expired, released, granted again, or not this key) and was not changed. Bad arguments: '
  'PF011. Durable.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

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
    SET expires_at = now() + lock_renew.ttl_us * interval '1 microsecond', renewed_at = now()
    WHERE l.name = lock_renew.name AND l.token = lock_renew.token
      AND l.key_hash = sha256(lock_renew.key) AND l.expires_at > now()
    RETURNING l.expires_at INTO lock_renew.expires_at;
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_renew(text, bigint, bytea, bigint) IS
  'Extends the lease (name, token) held with key to ttl_us microseconds from now. expires_at NULL: the lease is lost '
  '(expired, released, granted again, or not this key); nothing changed. Bad arguments: PF011. Durable.';

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
    SET expires_at = now() + r.ttl * interval '1 microsecond', renewed_at = now()
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
COMMENT ON FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]) IS
  'Extends each lease (names[i], tokens[i]) held with key to ttls_us[i] microseconds from now, as lock_renew does, in '
  'one call (1 to 10000 leases). Returns a row per lease renewed; a lease without a row is lost (expired, released, '
  'granted again, or not this key) and was not changed. Bad arguments: PF011. Durable.';
