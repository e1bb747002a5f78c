-- pgfence.lock_renew_many: renew many leases held with one key in one call, as
-- pglock's keep-alive does for every lease of a Locker that is due (one
-- statement per tick, however many leases). Each lease is renewed exactly as
-- pgfence.lock_renew renews it: conditional on (name, token, key) and on the
-- lease being live, on the database clock, durable when anything changed.
--
-- Every role that may call lock_renew gets EXECUTE on lock_renew_many here, so
-- an application role keeps working after this migration without a new grant
-- (docs/migrations.md lists it for new roles).

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_renew_many(names text[], tokens bigint[], key bytea, ttls_us bigint[])
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
COMMENT ON FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]) IS
  'Extends each lease (names[i], tokens[i]) held with key to ttls_us[i] microseconds from now, as lock_renew does, in '
  'one call (1 to 10000 leases). Returns a row per lease renewed; a lease without a row is lost (expired, released, '
  'granted again, or not this key) and was not changed. Bad arguments: PF011. Durable.';

REVOKE EXECUTE ON FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]) FROM PUBLIC;

-- +goose StatementBegin
DO $grant$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole::text AS role
        FROM pg_proc p, aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgfence.lock_renew(text, bigint, bytea, bigint)'::regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]) TO %s', r.role);
    END LOOP;
END
$grant$;
-- +goose StatementEnd

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
DROP FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]);
