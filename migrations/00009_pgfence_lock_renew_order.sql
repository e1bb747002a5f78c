-- pgfence.lock_renew_many locks the rows it renews in byte order of the
-- names before it renews any, as lock_grant_many and lock_release_many do
-- since 00008. Its one UPDATE took its rows in the order of its plan (the
-- order the keep-alive passed them, or the table's): a keep-alive tick and a
-- release batch of the same Locker, which locks its rows in name order, could
-- each hold a row the other waited for, until PostgreSQL's deadlock detector
-- failed one of them. It also runs with enable_seqscan off, as the other two.
-- Answers, grants and the signature do not change (CREATE OR REPLACE); the
-- Down restores the body of 00005.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_renew_many(names text[], tokens bigint[], key bytea, ttls_us bigint[])
RETURNS TABLE (name text, token bigint, expires_at timestamptz, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
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

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_renew_many(names text[], tokens bigint[], key bytea, ttls_us bigint[])
RETURNS TABLE (name text, token bigint, expires_at timestamptz, db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
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
