-- Queries on pgfence.jobs used by package skiplocked. Every change of a job
-- is a call of the job functions of the schema (migrations/00001_pgfence.sql,
-- "Functions: jobs"), which hold every rule; the reads are plain SELECTs.
-- Durations are milliseconds added to now() by the functions: every time that
-- decides anything is the clock of the database.

-- name: EnqueueJobs :many
-- EnqueueJobs inserts one job per element of the arrays (pgfence.job_enqueue)
-- and returns the rows in the order given. run_nows[i] means now() on the
-- database clock (a NULL run_at for the function).
SELECT j.id, j.queue, j.payload, j.priority, j.run_at, j.attempts, j.max_attempts, j.state, j.holder, j.claim_token, j.claim_expires_at, j.last_error, j.created_at, j.updated_at, j.finished_at, j.claim_outcome, j.claim_key_hash
FROM pgfence.job_enqueue(sqlc.arg(queues)::pg_catalog.text[], sqlc.arg(payloads)::pg_catalog.jsonb[], sqlc.arg(priorities)::smallint[],
                         ARRAY(SELECT CASE WHEN u.run_now THEN NULL ELSE u.run_at END
                               FROM (SELECT pg_catalog.unnest(sqlc.arg(run_ats)::pg_catalog.timestamptz[]) AS run_at,
                                            pg_catalog.unnest(sqlc.arg(run_nows)::boolean[]) AS run_now) AS u),
                         sqlc.arg(max_attempts)::integer[]) AS j;

-- name: ClaimJobs :many
-- ClaimJobs is the leased claim (pgfence.job_claim): up to max_jobs
-- claimable jobs of a queue, each with a new claim token, an expiry of now()
-- + ttl_ms and the hash of key, in claim order.
SELECT j.id, j.queue, j.payload, j.priority, j.run_at, j.attempts, j.max_attempts, j.state, j.holder, j.claim_token, j.claim_expires_at, j.last_error, j.created_at, j.updated_at, j.finished_at, j.claim_outcome, j.claim_key_hash
FROM pgfence.job_claim(sqlc.arg(queue)::pg_catalog.text, sqlc.arg(holder)::pg_catalog.text, sqlc.arg(ttl_ms)::bigint,
                       sqlc.arg(max_jobs)::integer, sqlc.arg(key)::pg_catalog.bytea) AS j;

-- name: CompleteJobs :many
-- CompleteJobs marks jobs completed, each only if it is still running under
-- its claim token and key (pgfence.job_complete); returns the ids that changed.
SELECT c.id::bigint AS id
FROM pgfence.job_complete(sqlc.arg(ids)::bigint[], sqlc.arg(claim_tokens)::bigint[], sqlc.arg(keys)::pg_catalog.bytea[]) AS c;

-- name: FailJob :one
-- FailJob records a failed attempt of a job still running under its claim
-- token and key (pgfence.job_fail). No row: the claim was lost.
SELECT j.id, j.queue, j.payload, j.priority, j.run_at, j.attempts, j.max_attempts, j.state, j.holder, j.claim_token, j.claim_expires_at, j.last_error, j.created_at, j.updated_at, j.finished_at, j.claim_outcome, j.claim_key_hash
FROM pgfence.job_fail(sqlc.arg(id)::bigint, sqlc.arg(claim_token)::bigint, sqlc.arg(key)::pg_catalog.bytea,
                      sqlc.arg(last_error)::pg_catalog.text, sqlc.arg(retry_in_ms)::bigint, sqlc.arg(give_up)::boolean) AS j;

-- name: HeartbeatJobs :many
-- HeartbeatJobs extends the claims still held under their tokens and keys to
-- now() + ttl_ms (pgfence.job_renew) and returns them with their new expiry.
-- A row locked by another transaction at that moment is skipped.
SELECT r.id::bigint AS id, r.claim_expires_at::pg_catalog.timestamptz AS claim_expires_at
FROM pgfence.job_renew(sqlc.arg(ids)::bigint[], sqlc.arg(claim_tokens)::bigint[], sqlc.arg(keys)::pg_catalog.bytea[],
                       sqlc.arg(ttl_ms)::bigint) AS r;

-- name: ReleaseJobs :many
-- ReleaseJobs gives claims back unfinished (pgfence.job_release): available
-- at once, the attempt not counted; returns the ids that changed.
SELECT c.id::bigint AS id
FROM pgfence.job_release(sqlc.arg(ids)::bigint[], sqlc.arg(claim_tokens)::bigint[], sqlc.arg(keys)::pg_catalog.bytea[]) AS c;

-- name: GetJob :one
-- GetJob returns one job.
SELECT id, queue, payload, priority, run_at, attempts, max_attempts, state, holder, claim_token, claim_expires_at, last_error, created_at, updated_at, finished_at, claim_outcome, claim_key_hash FROM pgfence.jobs WHERE (id OPERATOR(pg_catalog.=) @id);

-- name: GetJobClaims :many
-- GetJobClaims returns the claim columns of some jobs, to say why a
-- conditional update changed nothing: the claim was taken over, the key is
-- not the claim's, or it already ended with the outcome the caller is
-- retrying.
SELECT id, state, claim_token, holder, claim_outcome, claim_key_hash FROM pgfence.jobs WHERE (id OPERATOR(pg_catalog.=) ANY(@ids::bigint[]));

-- name: ClaimJobsTx :many
-- ClaimJobsTx locks up to max_jobs available, due jobs of a queue with FOR
-- UPDATE SKIP LOCKED for the calling transaction (pgfence.job_claim_tx).
-- Nothing is written: the row lock is the claim, and it ends with the
-- transaction.
SELECT j.id, j.queue, j.payload, j.priority, j.run_at, j.attempts, j.max_attempts, j.state, j.holder, j.claim_token, j.claim_expires_at, j.last_error, j.created_at, j.updated_at, j.finished_at, j.claim_outcome, j.claim_key_hash
FROM pgfence.job_claim_tx(sqlc.arg(queue)::pg_catalog.text, sqlc.arg(max_jobs)::integer) AS j;

-- name: CompleteJobTx :one
-- CompleteJobTx marks a job claimed by ClaimJobsTx completed, in the same
-- transaction (pgfence.job_complete_tx): false if no available job has the id.
SELECT pgfence.job_complete_tx(sqlc.arg(id)::bigint)::boolean AS completed;

-- name: FailJobTx :one
-- FailJobTx records a failed attempt of a job claimed by ClaimJobsTx, in the
-- same transaction (pgfence.job_fail_tx). No row: no available job has the id.
SELECT j.id, j.queue, j.payload, j.priority, j.run_at, j.attempts, j.max_attempts, j.state, j.holder, j.claim_token, j.claim_expires_at, j.last_error, j.created_at, j.updated_at, j.finished_at, j.claim_outcome, j.claim_key_hash
FROM pgfence.job_fail_tx(sqlc.arg(id)::bigint, sqlc.arg(last_error)::pg_catalog.text, sqlc.arg(retry_in_ms)::bigint,
                         sqlc.arg(give_up)::boolean) AS j;

-- name: DeleteFinishedJobs :one
-- DeleteFinishedJobs deletes up to max_jobs completed or dead jobs that
-- finished before the given time (pgfence.job_purge) and returns how many.
SELECT pgfence.job_purge(sqlc.arg(finished_before)::pg_catalog.timestamptz, sqlc.arg(max_jobs)::integer)::bigint AS deleted;

-- name: QueueHasUnfinished :one
-- QueueHasUnfinished reports whether a queue has a job that is available
-- (due or not) or running (claim expired or not). It reads only the partial
-- indexes of unfinished jobs.
SELECT EXISTS (SELECT 1 FROM pgfence.jobs a WHERE (a.queue OPERATOR(pg_catalog.=) @queue) AND (a.state OPERATOR(pg_catalog.=) 'available'))
    OR EXISTS (SELECT 1 FROM pgfence.jobs r WHERE (r.queue OPERATOR(pg_catalog.=) @queue) AND (r.state OPERATOR(pg_catalog.=) 'running')) AS unfinished;

-- name: QueueHasJobs :one
-- QueueHasJobs reports whether a queue has any job, finished or not (a
-- misspelt queue has none).
SELECT EXISTS (SELECT 1 FROM pgfence.jobs WHERE (queue OPERATOR(pg_catalog.=) @queue)) AS found;

-- name: QueueDepthsOf :many
-- QueueDepthsOf counts the jobs of the queues named per state, on the database clock.
SELECT queue,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'available') AND (run_at OPERATOR(pg_catalog.<=) pg_catalog.now()))          AS available,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'available') AND (run_at OPERATOR(pg_catalog.>) pg_catalog.now()))           AS scheduled,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'running') AND (claim_expires_at OPERATOR(pg_catalog.>) pg_catalog.now()))   AS running,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'running') AND (claim_expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()))  AS expired,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'completed'))                              AS completed,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'dead'))                                   AS dead
FROM pgfence.jobs
WHERE (queue OPERATOR(pg_catalog.=) ANY (@queues::pg_catalog.text[]))
GROUP BY queue
ORDER BY queue;

-- name: QueueDepths :many
-- QueueDepths counts the jobs of every queue per state, on the database clock.
SELECT queue,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'available') AND (run_at OPERATOR(pg_catalog.<=) pg_catalog.now()))          AS available,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'available') AND (run_at OPERATOR(pg_catalog.>) pg_catalog.now()))           AS scheduled,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'running') AND (claim_expires_at OPERATOR(pg_catalog.>) pg_catalog.now()))   AS running,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'running') AND (claim_expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()))  AS expired,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'completed'))                              AS completed,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'dead'))                                   AS dead
FROM pgfence.jobs
GROUP BY queue
ORDER BY queue;
