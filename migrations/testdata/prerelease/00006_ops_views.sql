-- More views for operators: the job queue per queue and state, and the fences
-- of guarded tables next to their locks' tokens.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
CREATE VIEW pgfence.job_summary AS
SELECT queue,
       state,
       count(*) AS jobs,
       min(run_at) FILTER (WHERE state = 'available') AS oldest_run_at,
       round(extract(epoch FROM now() - min(run_at) FILTER (WHERE state = 'available' AND run_at <= now()))::numeric, 3)
           AS oldest_ready_seconds,
       count(*) FILTER (WHERE state = 'running' AND claim_expires_at <= now()) AS expired_claims,
       round(extract(epoch FROM now() - min(claim_expires_at) FILTER (WHERE state = 'running' AND claim_expires_at <= now()))::numeric, 3)
           AS oldest_expired_claim_seconds,
       max(attempts) AS max_attempts_seen
FROM pgfence.jobs
GROUP BY queue, state;

COMMENT ON VIEW pgfence.job_summary IS
  'pgfence.jobs per queue and state, on the database clock: how many, the oldest job ready to run, '
  'claims that expired without completion (a dead or stuck worker) and how long ago the oldest expired.';
COMMENT ON COLUMN pgfence.job_summary.oldest_ready_seconds IS
  'Seconds the oldest available job has been ready to run without being claimed (queue latency).';
COMMENT ON COLUMN pgfence.job_summary.expired_claims IS
  'Running jobs whose claim expired: they become claimable again; many of them mean workers die or stall.';
COMMENT ON COLUMN pgfence.job_summary.oldest_expired_claim_seconds IS
  'Seconds since the oldest expired claim ran out (NULL if none).';

-- +goose StatementBegin
CREATE FUNCTION pgfence.guarded_fence_status()
RETURNS TABLE (table_name text, lock_name text, rows bigint, max_fence bigint, lock_token bigint, forged_rows bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT relid, fence_column, guarded_tables.lock_name AS ln, lock_name_column FROM pgfence.guarded_tables LOOP
        IF g.lock_name_column IS NULL THEN
            RETURN QUERY EXECUTE format(
                'SELECT %L::text, %L::text, count(*), max(t.%I), max(l.token), count(*) FILTER (WHERE t.%I > COALESCE(l.token, 0))
                 FROM %s t LEFT JOIN pgfence.locks l ON l.name = %L',
                g.relid::text, g.ln, g.fence_column, g.fence_column, g.relid, g.ln);
        ELSE
            RETURN QUERY EXECUTE format(
                'SELECT %L::text, t.%I::text, count(*), max(t.%I), max(l.token), count(*) FILTER (WHERE t.%I > COALESCE(l.token, 0))
                 FROM %s t LEFT JOIN pgfence.locks l ON l.name = t.%I::text GROUP BY t.%I',
                g.relid::text, g.lock_name_column, g.fence_column, g.fence_column, g.relid, g.lock_name_column, g.lock_name_column);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION pgfence.guarded_fence_status() IS
  'For every table registered with pgfence.guard: per governing lock, the number of rows, the highest fence, '
  'the lock''s current token and the rows whose fence is above it (a token never issued: forged). Reads whole tables.';

CREATE VIEW pgfence.guarded_fences AS SELECT * FROM pgfence.guarded_fence_status();
COMMENT ON VIEW pgfence.guarded_fences IS
  'Fence vs lock token for every guarded table (see pgfence.guarded_fence_status). forged_rows > 0 needs attention.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
DROP VIEW IF EXISTS pgfence.guarded_fences;
DROP FUNCTION IF EXISTS pgfence.guarded_fence_status();
DROP VIEW IF EXISTS pgfence.job_summary;
