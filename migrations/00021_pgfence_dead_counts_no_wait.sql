-- Counting a dead job no longer waits for, or deadlocks with, another
-- transaction. pgfence.jobs_count_dead added one to the queue's row of
-- pgfence.job_dead_counts (INSERT ... ON CONFLICT DO UPDATE), and that row
-- stayed locked until the transaction ended: a job_claim that turned an
-- expired last-attempt claim dead waited for any open transaction that had
-- sent a job of the same queue to dead (a TxWorker handler's job_fail_tx
-- holds its transaction for as long as the handler runs), and two
-- transactions sending jobs of two queues to dead in opposite orders
-- deadlocked.
--
-- A queue may now have several rows, whose dead counts add up to its total:
-- the trigger inserts a row (an insert waits for nobody: the table has no
-- unique index any more) and folds into it the queue's rows no other
-- transaction holds (FOR UPDATE SKIP LOCKED, so it waits for nobody either).
-- A queue keeps at most one row more than the transactions counting its dead
-- jobs at the same moment. Readers sum per queue (pgfence exporter does);
-- grants on the table do not change. The Down folds each queue's rows into
-- one and restores the primary key and 00001's trigger function.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE pgfence.job_dead_counts DROP CONSTRAINT job_dead_counts_pkey;
CREATE INDEX job_dead_counts_queue_idx ON pgfence.job_dead_counts (queue);
COMMENT ON INDEX pgfence.job_dead_counts_queue_idx IS
  'A queue''s counter rows, for the trigger that folds them together.';
COMMENT ON TABLE pgfence.job_dead_counts IS
  'Jobs that went dead, per queue, counted by trigger (jobs_count_dead) since the schema was created: '
  'a queue''s total is the sum of dead over its rows (a queue has more than one row while transactions '
  'that counted its dead jobs are open, so that none waits for another). Never decremented: deleting '
  'finished jobs does not lower it. Read by pgfence exporter (pgfence_jobs_dead_total); the application '
  'role needs no grant on it.';
COMMENT ON COLUMN pgfence.job_dead_counts.dead IS
  'This row''s part of the number of times a job of this queue went to state dead (a job revived by hand '
  'and dead again counts twice); sum over the queue''s rows for the total.';
COMMENT ON COLUMN pgfence.job_dead_counts.first_at IS
  'Database time at which the first job counted in this row went dead.';
COMMENT ON COLUMN pgfence.job_dead_counts.updated_at IS
  'Database time of the latest job counted in this row that went dead.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.jobs_count_dead() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- One new row for this job, with the queue's rows that no other
    -- transaction holds folded into it: neither the insert nor the delete
    -- waits for another transaction.
    WITH gone AS (
        DELETE FROM pgfence.job_dead_counts d
        WHERE d.ctid = ANY (ARRAY(
            SELECT c.ctid FROM pgfence.job_dead_counts c
            WHERE c.queue = NEW.queue
            FOR UPDATE SKIP LOCKED))
        RETURNING d.dead, d.first_at
    )
    INSERT INTO pgfence.job_dead_counts (queue, dead, first_at, updated_at)
    SELECT NEW.queue, 1 + coalesce(sum(g.dead), 0)::bigint, coalesce(min(g.first_at), now()), now()
    FROM gone g;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.jobs_count_dead() IS
  'Row trigger on pgfence.jobs: counts a row that became dead in pgfence.job_dead_counts, folding the '
  'queue''s rows no other transaction holds into one; waits for no other transaction. SECURITY DEFINER '
  '(search_path pinned), so the role that fails jobs needs no grant on the counter table.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.jobs_count_dead() RETURNS trigger
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

LOCK TABLE pgfence.job_dead_counts IN EXCLUSIVE MODE;
WITH gone AS (
    DELETE FROM pgfence.job_dead_counts RETURNING queue, dead, first_at, updated_at
)
INSERT INTO pgfence.job_dead_counts (queue, dead, first_at, updated_at)
SELECT g.queue, sum(g.dead)::bigint, min(g.first_at), max(g.updated_at)
FROM gone g
GROUP BY g.queue;
DROP INDEX pgfence.job_dead_counts_queue_idx;
ALTER TABLE pgfence.job_dead_counts ADD CONSTRAINT job_dead_counts_pkey PRIMARY KEY (queue);
COMMENT ON INDEX pgfence.job_dead_counts_pkey IS
  'One counter row per queue.';
COMMENT ON TABLE pgfence.job_dead_counts IS
  'Jobs that went dead, per queue, counted by trigger (jobs_count_dead) since the schema was created. '
  'Never decremented: deleting finished jobs does not lower it. Read by pgfence exporter '
  '(pgfence_jobs_dead_total); the application role needs no grant on it.';
COMMENT ON COLUMN pgfence.job_dead_counts.dead IS
  'Number of times a job of this queue went to state dead (a job revived by hand and dead again counts twice).';
COMMENT ON COLUMN pgfence.job_dead_counts.first_at IS
  'Database time at which this queue''s first counted job went dead.';
COMMENT ON COLUMN pgfence.job_dead_counts.updated_at IS
  'Database time of the latest job of this queue that went dead.';
