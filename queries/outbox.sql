-- name: OutboxEnqueue :one
-- OutboxEnqueue records one intent through pgfence.outbox_enqueue, which
-- refuses a token that is not the latest grant of the lock (SQLSTATE PF003
-- stale, PF002 never issued, PF007 <= 0), a lease not held with key (PF012:
-- released, expired, or another key) and bad arguments (PF011), and returns
-- the intent already recorded under the idempotency key (duplicate = true)
-- instead of a second one. A NULL run_at means now() on the database clock.
SELECT e.intent_id::bigint AS id, e.duplicate::boolean AS duplicate, e.intent_topic::pg_catalog.text AS topic,
       e.intent_lock_name::pg_catalog.text AS lock_name, e.intent_token::bigint AS token, e.enqueued_at::pg_catalog.timestamptz AS created_at
FROM pgfence.outbox_enqueue(
    sqlc.arg(lock_name)::pg_catalog.text, sqlc.arg(token)::bigint, sqlc.arg(key)::pg_catalog.bytea,
    sqlc.arg(topic)::pg_catalog.text, sqlc.arg(idempotency_key)::pg_catalog.text,
    sqlc.arg(payload)::pg_catalog.jsonb, sqlc.arg(max_attempts)::integer, sqlc.narg(run_at)::pg_catalog.timestamptz) AS e;

-- name: GetOutboxIntent :one
-- GetOutboxIntent reads the intent a dispatcher's job delivers (same id).
SELECT id, topic, idempotency_key, lock_name, token, payload, created_at
FROM pgfence.outbox
WHERE (id OPERATOR(pg_catalog.=) @id);

-- name: ClaimOutboxJobs :many
-- ClaimOutboxJobs is ClaimJobs for a dispatcher: the leased claim
-- (pgfence.job_claim) of up to max_jobs jobs of an outbox queue, in claim
-- order, each with the intent it delivers (same id) read in the same
-- statement, so that a delivery sends no statement of its own. The lateral
-- read (LIMIT 1: never flattened into a join) is one primary-key lookup per
-- claimed job. It reads with the statement's snapshot, taken before the claim
-- ran: intent_found is false (and the intent columns are placeholders) for a
-- job that is not an intent, and for an intent whose transaction committed
-- after that snapshot but before the claim; the dispatcher reads those by id
-- (GetOutboxIntent).
SELECT j.id, j.queue, j.payload, j.priority, j.run_at, j.attempts, j.max_attempts, j.state, j.holder, j.claim_token,
       j.claim_expires_at, j.last_error, j.created_at, j.updated_at, j.finished_at, j.claim_outcome, j.claim_key_hash,
       (i.id IS NOT NULL)::boolean AS intent_found,
       COALESCE(i.topic, '')::pg_catalog.text AS intent_topic,
       COALESCE(i.idempotency_key, '')::pg_catalog.text AS intent_idempotency_key,
       COALESCE(i.lock_name, '')::pg_catalog.text AS intent_lock_name,
       COALESCE(i.token, 0)::bigint AS intent_token,
       COALESCE(i.payload, 'null'::pg_catalog.jsonb)::pg_catalog.jsonb AS intent_payload,
       COALESCE(i.created_at, j.created_at)::pg_catalog.timestamptz AS intent_created_at
FROM pgfence.job_claim(sqlc.arg(queue)::pg_catalog.text, sqlc.arg(holder)::pg_catalog.text, sqlc.arg(ttl_ms)::bigint,
                       sqlc.arg(max_jobs)::integer, sqlc.arg(key)::pg_catalog.bytea) AS j
LEFT JOIN LATERAL (
    SELECT o.id, o.topic, o.idempotency_key, o.lock_name, o.token, o.payload, o.created_at
    FROM pgfence.outbox o
    WHERE (o.id OPERATOR(pg_catalog.=) j.id)
    LIMIT 1
) AS i ON true
ORDER BY j.priority, j.run_at, j.id;

-- name: OutboxStatus :many
-- OutboxStatus reads the pgfence.outbox_status view, one row per topic.
SELECT topic,
       pending::bigint AS pending,
       retry_waiting::bigint AS retry_waiting,
       in_flight::bigint AS in_flight,
       expired_claims::bigint AS expired_claims,
       delivered::bigint AS delivered,
       dead::bigint AS dead,
       COALESCE(oldest_undelivered_seconds, 0)::pg_catalog.float8 AS oldest_undelivered_seconds
FROM pgfence.outbox_status
ORDER BY topic;
