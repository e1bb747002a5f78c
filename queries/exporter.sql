-- name: ExporterTables :one
-- ExporterTables says which of the optional tables exist (a database may be
-- migrated to an older version than the exporter knows).
SELECT (pg_catalog.to_regclass('pgfence.jobs') IS NOT NULL)::boolean AS jobs,
       (pg_catalog.to_regclass('pgfence.job_dead_counts') IS NOT NULL)::boolean AS dead_counts;

-- name: ExporterLockStats :one
-- ExporterLockStats sums up the pgfence.lock_status view: rows held, expired
-- (lease ran out without a release) and free, the longest-expired lease, the
-- longest time since grant among held leases and the highest token.
SELECT pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'held')) AS held,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'expired')) AS expired,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'free')) AS free,
       COALESCE(pg_catalog.max((OPERATOR(pg_catalog.-) seconds_left)) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'expired')), 0)::pg_catalog.float8 AS expired_seconds_max,
       COALESCE(pg_catalog.max(seconds_since_grant) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'held')), 0)::pg_catalog.float8 AS held_seconds_max,
       COALESCE(pg_catalog.max(token), 0)::bigint AS token_max
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
    SELECT a.queue, pg_catalog.count(*) AS jobs,
           pg_catalog.min(a.run_at) FILTER (WHERE (a.run_at OPERATOR(pg_catalog.<=) pg_catalog.now())) AS oldest_ready
    FROM pgfence.jobs a
    WHERE (a.state OPERATOR(pg_catalog.=) 'available')
    GROUP BY a.queue
), running AS (
    SELECT r.queue, pg_catalog.count(*) AS jobs,
           pg_catalog.count(*) FILTER (WHERE (r.claim_expires_at OPERATOR(pg_catalog.<=) pg_catalog.now())) AS expired,
           pg_catalog.min(r.claim_expires_at) FILTER (WHERE (r.claim_expires_at OPERATOR(pg_catalog.<=) pg_catalog.now())) AS oldest_expiry
    FROM pgfence.jobs r
    WHERE (r.state OPERATOR(pg_catalog.=) 'running')
    GROUP BY r.queue
), queues AS MATERIALIZED (
    SELECT COALESCE(a.queue, r.queue) AS queue,
           COALESCE(a.jobs, 0) AS available,
           COALESCE(r.jobs, 0) AS running,
           COALESCE(r.expired, 0) AS expired,
           a.oldest_ready,
           r.oldest_expiry
    FROM available a
    FULL JOIN running r ON (r.queue OPERATOR(pg_catalog.=) a.queue)
), top AS (
    SELECT q.queue, pg_catalog.row_number() OVER (ORDER BY (q.available OPERATOR(pg_catalog.+) q.running) DESC, q.queue COLLATE pg_catalog."C") AS rank
    FROM (SELECT q.queue, q.available, q.running FROM queues q WHERE (q.queue OPERATOR(pg_catalog.<>) @other_label::pg_catalog.text)
          ORDER BY (q.available OPERATOR(pg_catalog.+) q.running) DESC, q.queue COLLATE pg_catalog."C" LIMIT @top_n::bigint) q
)
SELECT COALESCE(t.queue, @other_label::pg_catalog.text)::pg_catalog.text AS label,
       pg_catalog.count(*)::bigint AS queues,
       pg_catalog.sum(k.available)::bigint AS available,
       pg_catalog.sum(k.running)::bigint AS running,
       pg_catalog.sum(k.expired)::bigint AS expired_claims,
       COALESCE(extract(epoch FROM (pg_catalog.now() OPERATOR(pg_catalog.-) pg_catalog.min(k.oldest_ready))), 0)::pg_catalog.float8 AS ready_age_seconds,
       COALESCE(extract(epoch FROM (pg_catalog.now() OPERATOR(pg_catalog.-) pg_catalog.min(k.oldest_expiry))), 0)::pg_catalog.float8 AS claim_expired_seconds,
       COALESCE(pg_catalog.min(t.rank), 0)::bigint AS rank
FROM queues k
LEFT JOIN top t ON (t.queue OPERATOR(pg_catalog.=) k.queue)
GROUP BY t.queue
ORDER BY t.queue IS NULL, pg_catalog.min(t.rank);

-- name: ExporterDeadCounts :many
-- ExporterDeadCounts returns the top_n queues with the most dead jobs
-- (counted by the trigger jobs_count_dead, never decremented) and, on every
-- row, the total over all queues. A queue's count is the sum over its rows
-- (it has several while transactions that counted its dead jobs are open).
SELECT d.queue, d.dead, (pg_catalog.sum(d.dead) OVER ())::bigint AS total
FROM (
    SELECT c.queue, pg_catalog.sum(c.dead)::bigint AS dead
    FROM pgfence.job_dead_counts c
    GROUP BY c.queue
) d
ORDER BY d.dead DESC, d.queue COLLATE pg_catalog."C"
LIMIT @top_n::bigint;
