-- Three fixes of the job functions and one of the jobs table, found by calling
-- the door as the application role:
-- * pgfence.job_complete and pgfence.job_release lock the rows of a batch in
--   id order before updating them. They updated them in the order of their
--   arrays (the plan looks each id up once the table is large), so two
--   batches of the same claims in different orders, a worker's completions
--   and its shutdown's release, could deadlock (40P01).
-- * pgfence.job_renew never moves a claim's expiry earlier. It set it to
--   now() + ttl, and now() is the start of the calling transaction: renewed
--   inside a transaction begun earlier (the job's own work), the claim was
--   shortened, possibly into the past, while the call reported it renewed.
-- * pgfence.jobs refuses a run_at that is not finite (CHECK
--   jobs_run_at_finite, 23514): job_enqueue and outbox_enqueue accepted
--   'infinity', a job that can never be claimed (an intent never delivered).
--   NOT VALID: rows already there are not checked.
-- Answers for valid calls, signatures and grants do not change; the Down
-- restores 00001's bodies and drops the constraint.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_complete(ids bigint[], tokens bigint[], keys bytea[])
RETURNS TABLE (id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_complete.ids) = 1 AND cardinality(job_complete.tokens) = 1 AND cardinality(job_complete.keys) = 1
        AND job_complete.ids[1] > 0 AND job_complete.tokens[1] > 0 AND octet_length(job_complete.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_complete', job_complete.ids, job_complete.tokens, job_complete.keys);
    END IF;
    IF cardinality(job_complete.ids) > 1 THEN
        -- A batch locks its rows in id order first: updated in the order
        -- of the arrays, two batches of the same claims in different
        -- orders (a completion and a shutdown's release) deadlocked.
        PERFORM 1
        FROM pgfence.jobs l
        JOIN unnest(job_complete.ids, job_complete.tokens, job_complete.keys) AS c(i, t, k)
          ON l.id = c.i AND l.claim_token = c.t AND l.claim_key_hash = sha256(c.k)
        WHERE l.state = 'running'
        ORDER BY l.id
        FOR UPDATE OF l;
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET state = 'completed', claim_outcome = 'completed', claim_expires_at = NULL, finished_at = now(), updated_at = now()
    FROM unnest(job_complete.ids, job_complete.tokens, job_complete.keys) AS c(i, t, k)
    WHERE j.id = c.i AND j.claim_token = c.t AND j.claim_key_hash = sha256(c.k) AND j.state = 'running'
    RETURNING j.id;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_release(ids bigint[], tokens bigint[], keys bytea[])
RETURNS TABLE (id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_release.ids) = 1 AND cardinality(job_release.tokens) = 1 AND cardinality(job_release.keys) = 1
        AND job_release.ids[1] > 0 AND job_release.tokens[1] > 0 AND octet_length(job_release.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_release', job_release.ids, job_release.tokens, job_release.keys);
    END IF;
    IF cardinality(job_release.ids) > 1 THEN
        -- A batch locks its rows in id order first: updated in the order
        -- of the arrays, two batches of the same claims in different
        -- orders (a completion and a shutdown's release) deadlocked.
        PERFORM 1
        FROM pgfence.jobs l
        JOIN unnest(job_release.ids, job_release.tokens, job_release.keys) AS c(i, t, k)
          ON l.id = c.i AND l.claim_token = c.t AND l.claim_key_hash = sha256(c.k)
        WHERE l.state = 'running'
        ORDER BY l.id
        FOR UPDATE OF l;
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET state = 'available', attempts = greatest(j.attempts - 1, 0), claim_expires_at = NULL, claim_outcome = 'released',
        updated_at = now()
    FROM unnest(job_release.ids, job_release.tokens, job_release.keys) AS c(i, t, k)
    WHERE j.id = c.i AND j.claim_token = c.t AND j.claim_key_hash = sha256(c.k) AND j.state = 'running'
    RETURNING j.id;
END
$fn$;
-- +goose StatementEnd

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

ALTER TABLE pgfence.jobs ADD CONSTRAINT jobs_run_at_finite CHECK (isfinite(run_at)) NOT VALID;

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE pgfence.jobs DROP CONSTRAINT jobs_run_at_finite;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_complete(ids bigint[], tokens bigint[], keys bytea[])
RETURNS TABLE (id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_complete.ids) = 1 AND cardinality(job_complete.tokens) = 1 AND cardinality(job_complete.keys) = 1
        AND job_complete.ids[1] > 0 AND job_complete.tokens[1] > 0 AND octet_length(job_complete.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_complete', job_complete.ids, job_complete.tokens, job_complete.keys);
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET state = 'completed', claim_outcome = 'completed', claim_expires_at = NULL, finished_at = now(), updated_at = now()
    FROM unnest(job_complete.ids, job_complete.tokens, job_complete.keys) AS c(i, t, k)
    WHERE j.id = c.i AND j.claim_token = c.t AND j.claim_key_hash = sha256(c.k) AND j.state = 'running'
    RETURNING j.id;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_release(ids bigint[], tokens bigint[], keys bytea[])
RETURNS TABLE (id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_release.ids) = 1 AND cardinality(job_release.tokens) = 1 AND cardinality(job_release.keys) = 1
        AND job_release.ids[1] > 0 AND job_release.tokens[1] > 0 AND octet_length(job_release.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_release', job_release.ids, job_release.tokens, job_release.keys);
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET state = 'available', attempts = greatest(j.attempts - 1, 0), claim_expires_at = NULL, claim_outcome = 'released',
        updated_at = now()
    FROM unnest(job_release.ids, job_release.tokens, job_release.keys) AS c(i, t, k)
    WHERE j.id = c.i AND j.claim_token = c.t AND j.claim_key_hash = sha256(c.k) AND j.state = 'running'
    RETURNING j.id;
END
$fn$;
-- +goose StatementEnd

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
    SET claim_expires_at = now() + job_renew.ttl_ms * interval '1 millisecond', updated_at = now()
    FROM held, c
    WHERE j.id = held.id AND c.i = j.id AND j.claim_token = c.t AND j.claim_key_hash = c.kh AND j.state = 'running'
    RETURNING j.id, j.claim_expires_at;
END
$fn$;
-- +goose StatementEnd
