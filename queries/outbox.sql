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
