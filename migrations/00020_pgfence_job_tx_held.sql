-- pgfence.job_complete_tx and pgfence.job_fail_tx change only a job the
-- calling transaction can hold: one that is due (job_claim_tx claims only due
-- jobs) and whose row no other transaction holds (FOR UPDATE SKIP LOCKED:
-- this transaction's own claim is not skipped). They changed any available
-- job: a job scheduled for later, or an outbox intent waiting for its retry,
-- completed or sent to dead without being claimed; and a job another worker
-- held through job_claim_tx was changed once that worker's transaction ended
-- (its "retry in 10 minutes" turned into "completed"). Such a call now
-- returns false (job_fail_tx: no row), as for an id with no available job.
-- Signatures and grants do not change; the Down restores 00001's bodies.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

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

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

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
    UPDATE pgfence.jobs j
    SET state = 'completed', finished_at = now(), updated_at = now()
    WHERE j.id = job_complete_tx.id AND j.state = 'available';
    RETURN FOUND;
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
