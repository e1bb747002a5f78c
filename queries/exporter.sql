-- name: ExporterTables :one
-- ExporterTables says which of the optional tables exist (a database may be
-- migrated to an older version than the exporter knows).
SELECT (to_regclass('pgfence.jobs') IS NOT NULL)::boolean AS jobs,
       (to_regclass('pgfence.job_dead_counts') IS NOT NULL)::boolean AS dead_counts;

-- name: ExporterLockStats :one
-- ExporterLockStats sums up the pgfence.lock_status view: rows held, expired
-- (lease ran out without a release) and free, the longest-expired lease, the
-- longest time since grant among held leases and the highest token.
SELECT count(*) FILTER (WHERE state = 'held') AS held,
       count(*) FILTER (WHERE state = 'expired') AS expired,
       count(*) FILTER (WHERE state = 'free') AS free,
       COALESCE(max(-seconds_left) FILTER (WHERE state = 'expired'), 0)::float8 AS expired_seconds_max,
       COALESCE(max(seconds_since_grant) FILTER (WHERE state = 'held'), 0)::float8 AS held_seconds_max,
       COALESCE(max(token), 0)::bigint AS token_max
FROM pgfence.lock_status;

-- name: ExporterQueueStats :many
-- ExporterQueueStats returns the unfinished jobs of the top_n queues with the
-- most of them (ties by name, bytewise), one row each in that order with rank
-- 1..top_n, then one row labelled other_label, rank 0, that sums up
-- every other queue (absent when there is none); a queue that is itself named
-- other_label always lands in that row. Each row gives the number of queues it
-- covers, available and running jobs, running jobs whose claim expired, the
-- age of the oldest job ready to run and the time since the oldest expired
-- claim ran out. It reads only unfinished jobs (partial indexes).
WITH available AS (
    SELECT a.queue, count(*) AS jobs,
           min(a.run_at) FILTER (WHERE a.run_at <= now()) AS oldest_ready
    FROM pgfence.jobs a
    WHERE a.state = 'available'
    GROUP BY a.queue
), running AS (
    SELECT r.queue, count(*) AS jobs,
           count(*) FILTER (WHERE r.claim_expires_at <= now()) AS expired,
           min(r.claim_expires_at) FILTER (WHERE r.claim_expires_at <= now()) AS oldest_expiry
    FROM pgfence.jobs r
    WHERE r.state = 'running'
    GROUP BY r.queue
), queues AS MATERIALIZED (
    SELECT COALESCE(a.queue, r.queue) AS queue,
           COALESCE(a.jobs, 0) AS available,
           COALESCE(r.jobs, 0) AS running,
           COALESCE(r.expired, 0) AS expired,
           a.oldest_ready,
           r.oldest_expiry
    FROM available a
    FULL JOIN running r ON r.queue = a.queue
), top AS (
    SELECT q.queue, row_number() OVER (ORDER BY q.available + q.running DESC, q.queue COLLATE "C") AS rank
    FROM (SELECT q.queue, q.available, q.running FROM queues q WHERE q.queue <> @other_label::text
          ORDER BY q.available + q.running DESC, q.queue COLLATE "C" LIMIT @top_n::bigint) q
)
SELECT COALESCE(t.queue, @other_label::text)::text AS label,
       count(*)::bigint AS queues,
       sum(k.available)::bigint AS available,
       sum(k.running)::bigint AS running,
       sum(k.expired)::bigint AS expired_claims,
       COALESCE(extract(epoch FROM now() - min(k.oldest_ready)), 0)::float8 AS ready_age_seconds,
       COALESCE(extract(epoch FROM now() - min(k.oldest_expiry)), 0)::float8 AS claim_expired_seconds,
       COALESCE(min(t.rank), 0)::bigint AS rank
FROM queues k
LEFT JOIN top t ON t.queue = k.queue
GROUP BY t.queue
ORDER BY t.queue IS NULL, min(t.rank);

-- name: ExporterDeadCounts :many
-- ExporterDeadCounts returns the top_n queues with the most dead jobs
-- (counted by the trigger of migration 00011, never decremented) and, on every
-- row, the total over all queues.
SELECT d.queue, d.dead, (sum(d.dead) OVER ())::bigint AS total
FROM pgfence.job_dead_counts d
ORDER BY d.dead DESC, d.queue COLLATE "C"
LIMIT @top_n::bigint;
