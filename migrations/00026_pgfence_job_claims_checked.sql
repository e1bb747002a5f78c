-- Four fixes of the job functions, found by calling the door as the
-- application role:
-- * pgfence.job_claim and pgfence.job_renew count a claim's expiry from the
--   start of their statement (statement_timestamp()), not of the calling
--   transaction (now()). Called inside a transaction begun more than a TTL
--   earlier, job_claim committed a claim that had already expired: another
--   worker took the job at once while the first believed it held it; and
--   job_renew reported a claim extended whose expiry was still in the past.
--   In a transaction of its own (every call the Go packages make) the two
--   times are the same.
-- * pgfence.job_complete_tx and pgfence.job_fail_tx change only a job that
--   pgfence.job_claim_tx claimed in the calling transaction. They changed any
--   due job no other transaction held: a wrong id completed a job of another
--   queue (an outbox intent marked delivered, never sent). job_claim_tx
--   records its ids in the setting pgfence.job_tx_claims, for the
--   transaction ("<transaction id>:,id,id,...,"; a value another transaction
--   left names another transaction id). This guards against a wrong id, not
--   against the role: it can set the value itself, as it can claim any
--   queue's due jobs with job_claim_tx.
-- * pgfence.job_claims_refused (the argument check of job_complete,
--   job_release, job_renew and job_fail) refuses arrays that are not
--   one-dimensional with PF011: a 2-D array was read flattened.
-- Answers for valid calls in a transaction of their own, signatures and
-- grants do not change; the Down restores the bodies before this migration.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;


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
COMMENT ON FUNCTION pgfence.job_claim(text, text, bigint, integer, bytea) IS
  'Leased claim: up to max_jobs claimable jobs of queue (FOR UPDATE SKIP LOCKED), each with a new claim token, '
  'holder, expiry statement_timestamp() + ttl_ms and the sha256 of key; returned in claim order. An expired claim with no attempts '
  'left sends its job to dead. Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_renew(ids bigint[], tokens bigint[], keys bytea[], ttl_ms bigint)
RETURNS TABLE (id bigint, claim_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_renew.ids) = 1 AND cardinality(job_renew.tokens) = 1 AND cardinality(job_renew.keys) = 1
        AND job_renew.ids[1] > 0 AND job_renew.tokens[1] > 0 AND octet_length(job_renew.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_renew', job_renew.ids, job_renew.tokens, job_renew.keys);
    END IF;
    IF job_renew.ttl_ms IS NULL OR job_renew.ttl_ms NOT BETWEEN 100 AND 86400000 THEN
        RAISE EXCEPTION 'pgfence.job_renew: ttl_ms must be 100 to 86400000 (100 ms to 24 hours), got %',
            coalesce(job_renew.ttl_ms::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    WITH c AS (
        SELECT u.i, u.t, sha256(u.k) AS kh FROM unnest(job_renew.ids, job_renew.tokens, job_renew.keys) AS u(i, t, k)
    ), held AS (
        SELECT h.id
        FROM pgfence.jobs h JOIN c ON c.i = h.id AND c.t = h.claim_token AND c.kh = h.claim_key_hash
        WHERE h.state = 'running'
        FOR UPDATE OF h SKIP LOCKED
    )
    UPDATE pgfence.jobs j
    -- Counted from the start of this statement, not of its transaction
    -- (now()): renewed inside a transaction begun earlier, the claim would
    -- end before the caller's deadline, or be reported extended into the
    -- past. Never earlier than it was.
    SET claim_expires_at = greatest(j.claim_expires_at, statement_timestamp() + job_renew.ttl_ms * interval '1 millisecond'),
        updated_at = now()
    FROM held, c
    WHERE j.id = held.id AND c.i = j.id AND j.claim_token = c.t AND j.claim_key_hash = c.kh AND j.state = 'running'
    RETURNING j.id, j.claim_expires_at;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_renew(bigint[], bigint[], bytea[], bigint) IS
  'Extends the claims (ids[i], tokens[i]) held with keys[i] to statement_timestamp() + ttl_ms (never earlier); returns the extended ids and expiries. '
  'A row locked by another transaction is skipped. Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_claims_refused(fn text, ids bigint[], tokens bigint[], keys bytea[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer := cardinality(ids);
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION '%: ids must be an array of 1 to 10000 job ids, got %', fn,
            coalesce(n::text || ' elements', 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(tokens) IS DISTINCT FROM n OR cardinality(keys) IS DISTINCT FROM n THEN
        RAISE EXCEPTION '%: ids, tokens and keys must have the same length (%)', fn, n USING ERRCODE = 'PF011';
    ELSIF array_ndims(ids) <> 1 OR array_ndims(tokens) <> 1 OR array_ndims(keys) <> 1 THEN
        -- A two-dimensional array would be read flattened.
        RAISE EXCEPTION '%: ids, tokens and keys must be one-dimensional arrays', fn USING ERRCODE = 'PF011';
    ELSIF (0 < ALL (ids)) IS NOT TRUE THEN -- a NULL or an id <= 0
        RAISE EXCEPTION '%: every id must be > 0', fn USING ERRCODE = 'PF011';
    ELSIF (0 < ALL (tokens)) IS NOT TRUE THEN
        RAISE EXCEPTION '%: every token must be > 0', fn USING ERRCODE = 'PF011';
    ELSIF EXISTS (SELECT 1 FROM unnest(keys) AS k(v) WHERE k.v IS NULL OR octet_length(k.v) NOT BETWEEN 16 AND 64) THEN
        RAISE EXCEPTION '%: every key must be 16 to 64 random bytes', fn USING ERRCODE = 'PF011';
    END IF;
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
COMMENT ON FUNCTION pgfence.job_claim_tx(text, integer) IS
  'In-transaction claim: locks up to max_jobs available, due jobs of queue (FOR UPDATE SKIP LOCKED) until the calling '
  'transaction ends, and returns them; job_complete_tx and job_fail_tx change only these. No table is written. Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_complete_tx(id bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    claims text;
BEGIN
    IF job_complete_tx.id IS NULL OR job_complete_tx.id <= 0 THEN
        RAISE EXCEPTION 'pgfence.job_complete_tx: id must be > 0, got %',
            coalesce(job_complete_tx.id::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- Only a job job_claim_tx claimed in this transaction: another id (of
    -- another queue, an outbox intent) was completed without being claimed.
    claims := current_setting('pgfence.job_tx_claims', true);
    IF claims IS NULL
       OR split_part(claims, ':', 1) IS DISTINCT FROM pg_current_xact_id_if_assigned()::text
       OR position(',' || job_complete_tx.id::text || ',' IN claims) = 0 THEN
        RETURN false;
    END IF;
    -- Its row, which this transaction holds: a row another transaction
    -- holds is skipped, and a job not due cannot have been claimed.
    PERFORM 1 FROM pgfence.jobs l
    WHERE l.id = job_complete_tx.id AND l.state = 'available' AND l.run_at <= now()
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE pgfence.jobs j
    SET state = 'completed', finished_at = now(), updated_at = now()
    WHERE j.id = job_complete_tx.id AND j.state = 'available';
    RETURN FOUND;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_complete_tx(bigint) IS
  'Completes the available job id that job_claim_tx claimed in the calling transaction; false: no such job. '
  'Bad arguments: PF011.';

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
COMMENT ON FUNCTION pgfence.job_fail_tx(bigint, text, bigint, boolean) IS
  'Records a failed attempt of the available job id that job_claim_tx claimed in the calling transaction: '
  'attempts + 1, available at now() + retry_in_ms or dead. No row: no such job. Bad arguments: PF011.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

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
                                    ELSE now() + job_claim.ttl_ms * interval '1 millisecond' END,
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
COMMENT ON FUNCTION pgfence.job_claim(text, text, bigint, integer, bytea) IS
  'Leased claim: up to max_jobs claimable jobs of queue (FOR UPDATE SKIP LOCKED), each with a new claim token, '
  'holder, expiry now() + ttl_ms and the sha256 of key; returned in claim order. An expired claim with no attempts '
  'left sends its job to dead. Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_renew(ids bigint[], tokens bigint[], keys bytea[], ttl_ms bigint)
RETURNS TABLE (id bigint, claim_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_renew.ids) = 1 AND cardinality(job_renew.tokens) = 1 AND cardinality(job_renew.keys) = 1
        AND job_renew.ids[1] > 0 AND job_renew.tokens[1] > 0 AND octet_length(job_renew.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_renew', job_renew.ids, job_renew.tokens, job_renew.keys);
    END IF;
    IF job_renew.ttl_ms IS NULL OR job_renew.ttl_ms NOT BETWEEN 100 AND 86400000 THEN
        RAISE EXCEPTION 'pgfence.job_renew: ttl_ms must be 100 to 86400000 (100 ms to 24 hours), got %',
            coalesce(job_renew.ttl_ms::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    WITH c AS (
        SELECT u.i, u.t, sha256(u.k) AS kh FROM unnest(job_renew.ids, job_renew.tokens, job_renew.keys) AS u(i, t, k)
    ), held AS (
        SELECT h.id
        FROM pgfence.jobs h JOIN c ON c.i = h.id AND c.t = h.claim_token AND c.kh = h.claim_key_hash
        WHERE h.state = 'running'
        FOR UPDATE OF h SKIP LOCKED
    )
    UPDATE pgfence.jobs j
    -- Never earlier than it was: called in a transaction begun earlier,
    -- now() is that transaction's start, and a renewal shortened the claim.
    SET claim_expires_at = greatest(j.claim_expires_at, now() + job_renew.ttl_ms * interval '1 millisecond'),
        updated_at = now()
    FROM held, c
    WHERE j.id = held.id AND c.i = j.id AND j.claim_token = c.t AND j.claim_key_hash = c.kh AND j.state = 'running'
    RETURNING j.id, j.claim_expires_at;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_renew(bigint[], bigint[], bytea[], bigint) IS
  'Extends the claims (ids[i], tokens[i]) held with keys[i] to now() + ttl_ms; returns the extended ids and expiries. '
  'A row locked by another transaction is skipped. Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_claims_refused(fn text, ids bigint[], tokens bigint[], keys bytea[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer := cardinality(ids);
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION '%: ids must be an array of 1 to 10000 job ids, got %', fn,
            coalesce(n::text || ' elements', 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(tokens) IS DISTINCT FROM n OR cardinality(keys) IS DISTINCT FROM n THEN
        RAISE EXCEPTION '%: ids, tokens and keys must have the same length (%)', fn, n USING ERRCODE = 'PF011';
    ELSIF (0 < ALL (ids)) IS NOT TRUE THEN -- a NULL or an id <= 0
        RAISE EXCEPTION '%: every id must be > 0', fn USING ERRCODE = 'PF011';
    ELSIF (0 < ALL (tokens)) IS NOT TRUE THEN
        RAISE EXCEPTION '%: every token must be > 0', fn USING ERRCODE = 'PF011';
    ELSIF EXISTS (SELECT 1 FROM unnest(keys) AS k(v) WHERE k.v IS NULL OR octet_length(k.v) NOT BETWEEN 16 AND 64) THEN
        RAISE EXCEPTION '%: every key must be 16 to 64 random bytes', fn USING ERRCODE = 'PF011';
    END IF;
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
BEGIN
    IF job_claim_tx.queue IS NULL OR octet_length(job_claim_tx.queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: queue must be 1 to 128 bytes, got %',
            coalesce(octet_length(job_claim_tx.queue)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim_tx.max_jobs IS NULL OR job_claim_tx.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: max_jobs must be 1 to 10000, got %',
            coalesce(job_claim_tx.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    SELECT j.* FROM pgfence.jobs j
    WHERE j.queue = job_claim_tx.queue AND j.state = 'available' AND j.run_at <= now()
    ORDER BY j.priority, j.run_at, j.id
    LIMIT job_claim_tx.max_jobs
    FOR UPDATE SKIP LOCKED;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_claim_tx(text, integer) IS
  'In-transaction claim: locks up to max_jobs available, due jobs of queue (FOR UPDATE SKIP LOCKED) until the calling '
  'transaction ends, and returns them. Nothing is written. Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_complete_tx(id bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF job_complete_tx.id IS NULL OR job_complete_tx.id <= 0 THEN
        RAISE EXCEPTION 'pgfence.job_complete_tx: id must be > 0, got %',
            coalesce(job_complete_tx.id::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- Only this transaction's claim: a row another transaction holds is
    -- skipped (it was changed once that one ended), and a job not due
    -- cannot have been claimed by job_claim_tx.
    PERFORM 1 FROM pgfence.jobs l
    WHERE l.id = job_complete_tx.id AND l.state = 'available' AND l.run_at <= now()
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE pgfence.jobs j
    SET state = 'completed', finished_at = now(), updated_at = now()
    WHERE j.id = job_complete_tx.id AND j.state = 'available';
    RETURN FOUND;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_complete_tx(bigint) IS
  'Completes the available job id in the transaction that claimed it with job_claim_tx; false: no available job id. '
  'Bad arguments: PF011.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_fail_tx(id bigint, last_error text, retry_in_ms bigint, give_up boolean)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
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
    -- Only this transaction's claim (see job_complete_tx).
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
COMMENT ON FUNCTION pgfence.job_fail_tx(bigint, text, bigint, boolean) IS
  'Records a failed attempt of the available job id in the transaction that claimed it with job_claim_tx: '
  'attempts + 1, available at now() + retry_in_ms or dead. No row: no available job id. Bad arguments: PF011.';

