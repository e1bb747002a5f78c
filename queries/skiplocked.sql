-- Queries on pgfence.jobs used by package skiplocked. Durations are passed as
-- milliseconds and added to now(): every time that decides anything is the
-- clock of the database.

-- name: EnqueueJob :one
-- EnqueueJob inserts one job. A NULL run_at means now() on the database clock.
INSERT INTO pgfence.jobs (queue, payload, priority, run_at, max_attempts)
VALUES (@queue, @payload, @priority, coalesce(sqlc.narg('run_at')::pg_catalog.timestamptz, pg_catalog.now()), @max_attempts)
RETURNING id, queue, payload, priority, run_at, attempts, max_attempts, state, holder, claim_token, claim_expires_at, last_error, created_at, updated_at, finished_at, claim_outcome;

-- name: EnqueueJobs :many
-- EnqueueJobs inserts many jobs in one statement (one NOTIFY per queue).
INSERT INTO pgfence.jobs (queue, payload, priority, run_at, max_attempts)
SELECT t.queue, t.payload::pg_catalog.jsonb, t.priority,
       CASE WHEN t.run_now THEN pg_catalog.now() ELSE t.run_at END, t.max_attempts
FROM (SELECT pg_catalog.unnest(@queues::pg_catalog.text[]) AS queue, pg_catalog.unnest(@payloads::pg_catalog.text[]) AS payload,
             pg_catalog.unnest(@priorities::smallint[]) AS priority, pg_catalog.unnest(@run_ats::pg_catalog.timestamptz[]) AS run_at,
             pg_catalog.unnest(@run_nows::boolean[]) AS run_now, pg_catalog.unnest(@max_attempts::integer[]) AS max_attempts) AS t
RETURNING id;

-- name: ClaimJobs :many
-- ClaimJobs is the leased claim: it takes up to max_jobs claimable rows of a
-- queue (available and due, or running with an expired claim) with FOR UPDATE
-- SKIP LOCKED, gives each a new claim token and a claim expiry, and returns
-- them. An expired claim on a row that has no attempts left sends the row to
-- dead instead (not returned). The picked rows stay locked until the
-- UPDATE, so a running one is one whose claim expired (dead when it has no
-- attempts left). The UPDATE finds them by primary key (id = ANY): a join
-- with picked becomes, on a small table, a hash join over every row.
WITH due AS (
    SELECT a.id, a.priority, a.run_at
    FROM pgfence.jobs a
    WHERE (a.queue OPERATOR(pg_catalog.=) @queue) AND (a.state OPERATOR(pg_catalog.=) 'available') AND (a.run_at OPERATOR(pg_catalog.<=) pg_catalog.now())
    ORDER BY a.priority, a.run_at, a.id
    LIMIT @max_jobs
    FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT r.id, r.priority, r.run_at
    FROM pgfence.jobs r
    WHERE (r.queue OPERATOR(pg_catalog.=) @queue) AND (r.state OPERATOR(pg_catalog.=) 'running') AND (r.claim_expires_at OPERATOR(pg_catalog.<=) pg_catalog.now())
    ORDER BY r.claim_expires_at
    LIMIT @max_jobs
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT c.id
    FROM (SELECT d.id, d.priority, d.run_at FROM due d
          UNION ALL
          SELECT e.id, e.priority, e.run_at FROM expired e) AS c
    ORDER BY c.priority, c.run_at, c.id
    LIMIT @max_jobs
), claimed AS (
    UPDATE pgfence.jobs j
    SET state            = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running') AND (j.attempts OPERATOR(pg_catalog.>=) j.max_attempts) THEN 'dead' ELSE 'running' END,
        attempts         = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running') AND (j.attempts OPERATOR(pg_catalog.>=) j.max_attempts) THEN j.attempts ELSE (j.attempts OPERATOR(pg_catalog.+) 1) END,
        holder       = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running') AND (j.attempts OPERATOR(pg_catalog.>=) j.max_attempts) THEN j.holder ELSE @holder::pg_catalog.text END,
        claim_token      = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running') AND (j.attempts OPERATOR(pg_catalog.>=) j.max_attempts) THEN j.claim_token
                                ELSE pg_catalog.nextval('pgfence.jobs_claim_token_seq') END,
        claim_expires_at = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running') AND (j.attempts OPERATOR(pg_catalog.>=) j.max_attempts) THEN NULL
                                ELSE (pg_catalog.now() OPERATOR(pg_catalog.+) (interval '1 millisecond' OPERATOR(pg_catalog.*) @ttl_ms::bigint)) END,
        last_error       = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running')
                                THEN ((((('claim ' OPERATOR(pg_catalog.||) j.claim_token) OPERATOR(pg_catalog.||) ' of ') OPERATOR(pg_catalog.||) j.holder) OPERATOR(pg_catalog.||) ' expired at ') OPERATOR(pg_catalog.||) j.claim_expires_at)
                                ELSE j.last_error END,
        finished_at      = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running') AND (j.attempts OPERATOR(pg_catalog.>=) j.max_attempts) THEN pg_catalog.now() END,
        claim_outcome    = CASE WHEN (j.state OPERATOR(pg_catalog.=) 'running') AND (j.attempts OPERATOR(pg_catalog.>=) j.max_attempts) THEN 'expired' END,
        updated_at       = pg_catalog.now()
    WHERE (j.id OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT p.id FROM picked p)))
    RETURNING j.id, j.queue, j.payload, j.priority, j.run_at, j.attempts, j.max_attempts, j.state, j.holder, j.claim_token, j.claim_expires_at, j.last_error, j.created_at, j.updated_at, j.finished_at, j.claim_outcome
)
SELECT id, queue, payload, priority, run_at, attempts, max_attempts, state, holder, claim_token, claim_expires_at, last_error, created_at, updated_at, finished_at, claim_outcome FROM claimed
WHERE (claimed.state OPERATOR(pg_catalog.=) 'running')
ORDER BY claimed.priority, claimed.run_at, claimed.id;

-- name: CompleteJobs :many
-- CompleteJobs marks jobs completed, each only if it is still running under
-- the given claim token, and records the claim's outcome. It returns the ids
-- that changed.
UPDATE pgfence.jobs j
SET state = 'completed', claim_outcome = 'completed', claim_expires_at = NULL, finished_at = pg_catalog.now(), updated_at = pg_catalog.now()
FROM (SELECT pg_catalog.unnest(@ids::bigint[]) AS id, pg_catalog.unnest(@claim_tokens::bigint[]) AS claim_token) AS c
WHERE (j.id OPERATOR(pg_catalog.=) c.id) AND (j.claim_token OPERATOR(pg_catalog.=) c.claim_token) AND (j.state OPERATOR(pg_catalog.=) 'running')
RETURNING j.id;

-- name: FailJob :one
-- FailJob records a failed attempt of a job still running under the given
-- claim token: back to available with run_at pushed by retry_in_ms, or dead
-- when no attempts are left or give_up is set.
UPDATE pgfence.jobs
SET state            = CASE WHEN (attempts OPERATOR(pg_catalog.>=) max_attempts) OR @give_up::boolean THEN 'dead' ELSE 'available' END,
    run_at           = CASE WHEN (attempts OPERATOR(pg_catalog.>=) max_attempts) OR @give_up::boolean THEN run_at
                            ELSE (pg_catalog.now() OPERATOR(pg_catalog.+) (interval '1 millisecond' OPERATOR(pg_catalog.*) @retry_in_ms::bigint)) END,
    finished_at      = CASE WHEN (attempts OPERATOR(pg_catalog.>=) max_attempts) OR @give_up::boolean THEN pg_catalog.now() END,
    last_error       = @last_error::pg_catalog.text,
    claim_expires_at = NULL,
    claim_outcome    = 'failed',
    updated_at       = pg_catalog.now()
WHERE (id OPERATOR(pg_catalog.=) @id) AND (claim_token OPERATOR(pg_catalog.=) @claim_token::bigint) AND (state OPERATOR(pg_catalog.=) 'running')
RETURNING id, queue, payload, priority, run_at, attempts, max_attempts, state, holder, claim_token, claim_expires_at, last_error, created_at, updated_at, finished_at, claim_outcome;

-- name: HeartbeatJobs :many
-- HeartbeatJobs extends the claims still held under the given tokens to
-- now() + ttl_ms and returns them with their new expiry. It never waits: a
-- row locked by another transaction at that moment is skipped (not extended).
WITH c AS (
    SELECT pg_catalog.unnest(@ids::bigint[]) AS id, pg_catalog.unnest(@claim_tokens::bigint[]) AS claim_token
), held AS (
    SELECT h.id
    FROM pgfence.jobs h JOIN c ON (c.id OPERATOR(pg_catalog.=) h.id) AND (c.claim_token OPERATOR(pg_catalog.=) h.claim_token)
    WHERE (h.state OPERATOR(pg_catalog.=) 'running')
    FOR UPDATE OF h SKIP LOCKED
)
UPDATE pgfence.jobs j
SET claim_expires_at = (pg_catalog.now() OPERATOR(pg_catalog.+) (interval '1 millisecond' OPERATOR(pg_catalog.*) @ttl_ms::bigint)), updated_at = pg_catalog.now()
FROM held, c
WHERE (j.id OPERATOR(pg_catalog.=) held.id) AND (c.id OPERATOR(pg_catalog.=) j.id) AND (j.claim_token OPERATOR(pg_catalog.=) c.claim_token) AND (j.state OPERATOR(pg_catalog.=) 'running')
RETURNING j.id, j.claim_expires_at;

-- name: ReleaseJobs :many
-- ReleaseJobs gives claims back unfinished: the jobs become available at once
-- and the attempt is not counted. Only claims still held under the token change.
UPDATE pgfence.jobs j
SET state = 'available', attempts = greatest((j.attempts OPERATOR(pg_catalog.-) 1), 0), claim_expires_at = NULL, claim_outcome = 'released',
    updated_at = pg_catalog.now()
FROM (SELECT pg_catalog.unnest(@ids::bigint[]) AS id, pg_catalog.unnest(@claim_tokens::bigint[]) AS claim_token) AS c
WHERE (j.id OPERATOR(pg_catalog.=) c.id) AND (j.claim_token OPERATOR(pg_catalog.=) c.claim_token) AND (j.state OPERATOR(pg_catalog.=) 'running')
RETURNING j.id;

-- name: GetJob :one
-- GetJob returns one job.
SELECT id, queue, payload, priority, run_at, attempts, max_attempts, state, holder, claim_token, claim_expires_at, last_error, created_at, updated_at, finished_at, claim_outcome FROM pgfence.jobs WHERE (id OPERATOR(pg_catalog.=) @id);

-- name: GetJobClaims :many
-- GetJobClaims returns the claim columns of some jobs, to say why a
-- conditional update changed nothing: the claim was taken over, or it already
-- ended with the outcome the caller is retrying.
SELECT id, state, claim_token, holder, claim_outcome FROM pgfence.jobs WHERE (id OPERATOR(pg_catalog.=) ANY(@ids::bigint[]));

-- name: ClaimJobsTx :many
-- ClaimJobsTx locks up to max_jobs available, due jobs of a queue with FOR
-- UPDATE SKIP LOCKED, for the transaction that runs it. Nothing is written:
-- the row lock is the claim, and it ends with the transaction.
SELECT id, queue, payload, priority, run_at, attempts, max_attempts, state, holder, claim_token, claim_expires_at, last_error, created_at, updated_at, finished_at, claim_outcome FROM pgfence.jobs
WHERE (queue OPERATOR(pg_catalog.=) @queue) AND (state OPERATOR(pg_catalog.=) 'available') AND (run_at OPERATOR(pg_catalog.<=) pg_catalog.now())
ORDER BY priority, run_at, id
LIMIT @max_jobs
FOR UPDATE SKIP LOCKED;

-- name: CompleteJobTx :execrows
-- CompleteJobTx marks a job claimed by ClaimJobsTx completed, in the same
-- transaction.
UPDATE pgfence.jobs
SET state = 'completed', finished_at = pg_catalog.now(), updated_at = pg_catalog.now()
WHERE (id OPERATOR(pg_catalog.=) @id) AND (state OPERATOR(pg_catalog.=) 'available');

-- name: FailJobTx :one
-- FailJobTx records a failed attempt of a job claimed by ClaimJobsTx, in the
-- same transaction (in-transaction claims count attempts only on failure).
UPDATE pgfence.jobs
SET attempts    = (attempts OPERATOR(pg_catalog.+) 1),
    state       = CASE WHEN ((attempts OPERATOR(pg_catalog.+) 1) OPERATOR(pg_catalog.>=) max_attempts) OR @give_up::boolean THEN 'dead' ELSE 'available' END,
    run_at      = CASE WHEN ((attempts OPERATOR(pg_catalog.+) 1) OPERATOR(pg_catalog.>=) max_attempts) OR @give_up::boolean THEN run_at
                       ELSE (pg_catalog.now() OPERATOR(pg_catalog.+) (interval '1 millisecond' OPERATOR(pg_catalog.*) @retry_in_ms::bigint)) END,
    finished_at = CASE WHEN ((attempts OPERATOR(pg_catalog.+) 1) OPERATOR(pg_catalog.>=) max_attempts) OR @give_up::boolean THEN pg_catalog.now() END,
    last_error  = @last_error::pg_catalog.text,
    updated_at  = pg_catalog.now()
WHERE (id OPERATOR(pg_catalog.=) @id) AND (state OPERATOR(pg_catalog.=) 'available')
RETURNING id, queue, payload, priority, run_at, attempts, max_attempts, state, holder, claim_token, claim_expires_at, last_error, created_at, updated_at, finished_at, claim_outcome;

-- name: DeleteFinishedJobs :execrows
-- DeleteFinishedJobs deletes up to max_jobs completed or dead jobs that
-- finished before the given time.
DELETE FROM pgfence.jobs
WHERE id OPERATOR(pg_catalog.=) ANY (SELECT f.id FROM pgfence.jobs f
             WHERE (f.state OPERATOR(pg_catalog.=) ANY (ARRAY['completed', 'dead']::pg_catalog.text[])) AND (f.finished_at OPERATOR(pg_catalog.<) @finished_before::pg_catalog.timestamptz)
             ORDER BY f.finished_at
             LIMIT @max_jobs);

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

-- name: QueueDepth :one
-- QueueDepth counts the jobs of one queue per state, on the database clock.
SELECT pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'available') AND (run_at OPERATOR(pg_catalog.<=) pg_catalog.now()))          AS available,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'available') AND (run_at OPERATOR(pg_catalog.>) pg_catalog.now()))           AS scheduled,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'running') AND (claim_expires_at OPERATOR(pg_catalog.>) pg_catalog.now()))   AS running,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'running') AND (claim_expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()))  AS expired,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'completed'))                              AS completed,
       pg_catalog.count(*) FILTER (WHERE (state OPERATOR(pg_catalog.=) 'dead'))                                   AS dead
FROM pgfence.jobs
WHERE (queue OPERATOR(pg_catalog.=) @queue);

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
