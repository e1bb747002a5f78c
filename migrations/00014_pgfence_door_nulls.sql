-- The door refuses NULL where its functions took it (found by calling every
-- function with bad arguments). pgfence.lock_leave with a NULL wait_id took
-- the waiter's queue row out even when a release had handed that wait a lease
-- (returning granted_token 0, so the waiter never released it and nobody
-- could read it with lock_handed: the name stayed held until the lease
-- expired); pgfence.lock_handed answered "nothing handed" to a NULL wkey or
-- wait_id. Both now refuse NULL wkey or wait_id with PF011, as lock_wait
-- does. pgfence.fence_refused answered an unknown mode, a NULL row_found or a
-- NULL or negative fence of a found row with PF006 ("changed concurrently",
-- which a client retries): it now refuses them with PF011 (bad argument). Its
-- token check (PF007) and every answer for valid arguments are unchanged.
-- Signatures, grants and comments do not change; the Down restores the
-- bodies of migration 00001.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_handed(wkey bigint, wait_id bigint, key bytea,
    OUT token bigint, OUT expires_at timestamptz, OUT db_now timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_handed.key IS NULL OR octet_length(lock_handed.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_handed: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_handed.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_handed.wkey IS NULL OR lock_handed.wait_id IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_handed: wkey and wait_id must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    SELECT l.token, l.expires_at INTO lock_handed.token, lock_handed.expires_at
    FROM pgfence.lock_queue AS q
    JOIN pgfence.locks AS l ON l.name = q.name AND l.token = q.granted_token AND l.key_hash = q.key_hash
    WHERE q.wkey = lock_handed.wkey AND q.wait_id = lock_handed.wait_id
      AND q.key_hash = sha256(lock_handed.key) AND l.expires_at > now();
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_leave(wkey bigint, wait_id bigint, key bytea,
    OUT removed boolean, OUT granted_token bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_leave.key IS NULL OR octet_length(lock_leave.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_leave: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_leave.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_leave.wkey IS NULL OR lock_leave.wait_id IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_leave: wkey and wait_id must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.lock_queue AS q
    WHERE q.wkey = lock_leave.wkey AND q.key_hash = sha256(lock_leave.key)
    RETURNING CASE WHEN q.wait_id = lock_leave.wait_id THEN COALESCE(q.granted_token, 0) ELSE 0 END
    INTO lock_leave.granted_token;
    lock_leave.removed := FOUND;
    lock_leave.granted_token := COALESCE(lock_leave.granted_token, 0);
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

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_handed(wkey bigint, wait_id bigint, key bytea,
    OUT token bigint, OUT expires_at timestamptz, OUT db_now timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_handed.key IS NULL OR octet_length(lock_handed.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_handed: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_handed.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    SELECT l.token, l.expires_at INTO lock_handed.token, lock_handed.expires_at
    FROM pgfence.lock_queue AS q
    JOIN pgfence.locks AS l ON l.name = q.name AND l.token = q.granted_token AND l.key_hash = q.key_hash
    WHERE q.wkey = lock_handed.wkey AND q.wait_id = lock_handed.wait_id
      AND q.key_hash = sha256(lock_handed.key) AND l.expires_at > now();
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_leave(wkey bigint, wait_id bigint, key bytea,
    OUT removed boolean, OUT granted_token bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_leave.key IS NULL OR octet_length(lock_leave.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_leave: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_leave.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.lock_queue AS q
    WHERE q.wkey = lock_leave.wkey AND q.key_hash = sha256(lock_leave.key)
    RETURNING CASE WHEN q.wait_id = lock_leave.wait_id THEN COALESCE(q.granted_token, 0) ELSE 0 END
    INTO lock_leave.granted_token;
    lock_leave.removed := FOUND;
    lock_leave.granted_token := COALESCE(lock_leave.granted_token, 0);
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
