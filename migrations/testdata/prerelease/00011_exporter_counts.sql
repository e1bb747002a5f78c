-- Dead-job counters for `pgfence exporter`, so that it never has to count
-- finished rows of pgfence.jobs.
--
-- Unfinished jobs (available, running) are counted from the partial indexes of
-- 00004, whose size is the backlog, not the history. Finished rows are kept
-- until the application deletes them, so counting them would make every scrape
-- read the whole history, and a gauge of them goes down when old rows are
-- pruned (a false "increase" for alert rules). Instead, a row trigger adds one
-- to pgfence.job_dead_counts each time a job goes dead: a counter that never
-- goes down, whatever is deleted from pgfence.jobs.
--
-- Completed jobs are not counted here: completing is the hot path of every
-- worker, and a counter row per queue would make concurrent completions of a
-- queue wait for each other's commit. Going dead is rare (a job that failed its
-- last attempt), so its counter costs nothing in normal operation. Completion
-- rates come from the workers' own metrics (pgfence_rows_completed_total).

-- +goose Up
-- Every name below resolves in pg_catalog, whatever the migrating role's
-- search_path (SET LOCAL: until this migration's transaction ends).
SET LOCAL search_path = pg_catalog, pg_temp;

CREATE TABLE pgfence.job_dead_counts (
    queue      text        PRIMARY KEY,
    dead       bigint      NOT NULL DEFAULT 0,
    first_at   timestamptz NOT NULL DEFAULT pg_catalog.now(),
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    CONSTRAINT job_dead_counts_dead_nonnegative CHECK (dead >= 0)
);
COMMENT ON TABLE pgfence.job_dead_counts IS
  'Jobs that went dead, per queue, counted by trigger since migration 00011 (starting from the dead rows present '
  'then). Never decremented: deleting finished jobs does not lower it. Read by pgfence exporter '
  '(pgfence_jobs_dead_total); the application role needs no grant on it.';
COMMENT ON COLUMN pgfence.job_dead_counts.queue IS
  'Queue name, as in pgfence.jobs.queue.';
COMMENT ON COLUMN pgfence.job_dead_counts.dead IS
  'Number of times a job of this queue went to state dead (a job revived by hand and dead again counts twice).';
COMMENT ON COLUMN pgfence.job_dead_counts.first_at IS
  'Database time at which this queue''s first counted job went dead.';
COMMENT ON COLUMN pgfence.job_dead_counts.updated_at IS
  'Database time of the latest job of this queue that went dead.';
COMMENT ON INDEX pgfence.job_dead_counts_pkey IS
  'One counter row per queue.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.jobs_count_dead() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO pgfence.job_dead_counts AS c (queue, dead)
    VALUES (NEW.queue, 1)
    ON CONFLICT (queue) DO UPDATE SET dead = c.dead + 1, updated_at = pg_catalog.now();
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.jobs_count_dead() IS
  'Row trigger on pgfence.jobs: adds one to pgfence.job_dead_counts for a row that became dead. SECURITY DEFINER '
  '(search_path pinned), so the role that fails jobs needs no grant on the counter table.';

CREATE TRIGGER jobs_count_dead_update AFTER UPDATE ON pgfence.jobs
    FOR EACH ROW WHEN (NEW.state = 'dead' AND OLD.state <> 'dead')
    EXECUTE FUNCTION pgfence.jobs_count_dead();
COMMENT ON TRIGGER jobs_count_dead_update ON pgfence.jobs IS
  'Counts a job that goes dead (failed its last attempt, gave up, or its claim expired with no attempts left). '
  'The WHEN clause is checked without calling the function, so other updates (claims, completions, heartbeats) '
  'do not run it.';

CREATE TRIGGER jobs_count_dead_insert AFTER INSERT ON pgfence.jobs
    FOR EACH ROW WHEN (NEW.state = 'dead')
    EXECUTE FUNCTION pgfence.jobs_count_dead();
COMMENT ON TRIGGER jobs_count_dead_insert ON pgfence.jobs IS
  'Counts a job inserted directly as dead (by hand; pgfence itself never does).';

-- The triggers exist before this count (CREATE TRIGGER locks out writers of
-- pgfence.jobs until this transaction commits), so no job is missed or counted
-- twice.
INSERT INTO pgfence.job_dead_counts (queue, dead, first_at, updated_at)
SELECT j.queue, pg_catalog.count(*), pg_catalog.min(j.finished_at), pg_catalog.max(j.finished_at)
FROM pgfence.jobs j
WHERE j.state = 'dead'
GROUP BY j.queue;

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
DROP TRIGGER IF EXISTS jobs_count_dead_insert ON pgfence.jobs;
DROP TRIGGER IF EXISTS jobs_count_dead_update ON pgfence.jobs;
DROP FUNCTION IF EXISTS pgfence.jobs_count_dead();
DROP TABLE IF EXISTS pgfence.job_dead_counts;
