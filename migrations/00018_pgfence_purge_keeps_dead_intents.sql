-- pgfence.job_purge (skiplocked.DeleteFinished) keeps the dead delivery job of
-- an outbox intent. It deleted every dead job, and an intent whose job was
-- gone disappeared from pgfence.outbox_status, outbox.Status and `pgfence
-- outbox` (which join the jobs), and could no longer be sent again by making
-- its job available: a payout never delivered left no trace but its row in
-- pgfence.outbox. Such a job now stays until the intent is deleted from
-- pgfence.outbox (then the next purge takes it); completed jobs, and dead jobs
-- of other queues, are purged as before. Its DELETE also checks the
-- conditions again on each row it deletes: the ids were chosen first, and a
-- job made available again (a dead intent sent again by the documented
-- UPDATE) while the DELETE waited for its row was deleted all the same.
-- Signature and grants do not change; the Down restores 00001's body and
-- comment.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_purge(finished_before timestamptz, max_jobs integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    n bigint;
BEGIN
    IF job_purge.finished_before IS NULL THEN
        RAISE EXCEPTION 'pgfence.job_purge: finished_before must not be NULL' USING ERRCODE = 'PF011';
    ELSIF job_purge.max_jobs IS NULL OR job_purge.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_purge: max_jobs must be 1 to 10000, got %',
            coalesce(job_purge.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- The conditions are checked again on the row deleted: a job made
    -- available again (a dead intent sent again) while the DELETE waited
    -- for its row is not deleted.
    DELETE FROM pgfence.jobs AS d
    WHERE d.id = ANY (ARRAY(SELECT f.id FROM pgfence.jobs f
                            WHERE f.state IN ('completed', 'dead') AND f.finished_at < job_purge.finished_before
                              AND NOT (f.state = 'dead' AND EXISTS (SELECT 1 FROM pgfence.outbox AS o WHERE o.id = f.id))
                            ORDER BY f.finished_at
                            LIMIT job_purge.max_jobs))
      AND d.state IN ('completed', 'dead') AND d.finished_at < job_purge.finished_before
      AND NOT (d.state = 'dead' AND EXISTS (SELECT 1 FROM pgfence.outbox AS o WHERE o.id = d.id));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_purge(timestamptz, integer) IS
  'Deletes up to max_jobs completed or dead jobs that finished before finished_before (oldest first), but not the '
  'dead job of an intent of pgfence.outbox (kept for a human until the intent is deleted); returns how many. '
  'Bad arguments: PF011.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.job_purge(finished_before timestamptz, max_jobs integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    n bigint;
BEGIN
    IF job_purge.finished_before IS NULL THEN
        RAISE EXCEPTION 'pgfence.job_purge: finished_before must not be NULL' USING ERRCODE = 'PF011';
    ELSIF job_purge.max_jobs IS NULL OR job_purge.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_purge: max_jobs must be 1 to 10000, got %',
            coalesce(job_purge.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.jobs
    WHERE id = ANY (ARRAY(SELECT f.id FROM pgfence.jobs f
                          WHERE f.state IN ('completed', 'dead') AND f.finished_at < job_purge.finished_before
                          ORDER BY f.finished_at
                          LIMIT job_purge.max_jobs));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_purge(timestamptz, integer) IS
  'Deletes up to max_jobs completed or dead jobs that finished before finished_before (oldest first); returns how '
  'many. Bad arguments: PF011.';
