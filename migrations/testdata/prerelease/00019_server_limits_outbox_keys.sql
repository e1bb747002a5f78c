-- Limits the server enforces itself, and outbox keys scoped by lock.
--
-- 1. Size limits. The Go packages refused a job payload or an outbox payload
--    over 1 MiB before sending it, but a statement of the application's role
--    (another client, psql) could store any size up to PostgreSQL's own
--    limits. Each limit is now a named CHECK of the table, measured on the
--    text form of the stored value (jsonb is stored normalised: the bytes a
--    client sent may differ), and the Go packages turn a violation of one of
--    these constraints into the same error as their own check. Lock metadata,
--    which no pgfence API writes, is bounded the same way. The constraints are
--    added in the plain form (a scan that fails if an existing row is over):
--    pgfence has no release, and a row over the limit is one to look at.
-- 2. Outbox idempotency keys are unique per lock, not across every lock:
--    before, the holder of any lock could record an intent under a key another
--    lock's holder was about to use, and the later enqueue got the first
--    intent back as its duplicate (the other lock's intent was delivered in its
--    place). A receiver that deduplicates across locks must use the lock name
--    and the key together (the Intent carries both).

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE pgfence.jobs ADD CONSTRAINT jobs_payload_size
    CHECK (pg_catalog.octet_length(payload::pg_catalog.text) OPERATOR(pg_catalog.<=) 1048576);
ALTER TABLE pgfence.outbox ADD CONSTRAINT outbox_payload_size
    CHECK (pg_catalog.octet_length(payload::pg_catalog.text) OPERATOR(pg_catalog.<=) 1048576);
ALTER TABLE pgfence.locks ADD CONSTRAINT locks_metadata_size
    CHECK (pg_catalog.octet_length(metadata::pg_catalog.text) OPERATOR(pg_catalog.<=) 1048576);
COMMENT ON CONSTRAINT jobs_payload_size ON pgfence.jobs IS
  'A job payload is at most 1 MiB in its text form (skiplocked refuses larger ones before sending them).';
COMMENT ON CONSTRAINT outbox_payload_size ON pgfence.outbox IS
  'An intent payload is at most 1 MiB in its text form (outbox refuses larger ones before sending them).';
COMMENT ON CONSTRAINT locks_metadata_size ON pgfence.locks IS
  'Lock metadata is at most 1 MiB in its text form.';

ALTER TABLE pgfence.outbox DROP CONSTRAINT outbox_key_unique;
ALTER TABLE pgfence.outbox ADD CONSTRAINT outbox_key_unique UNIQUE (lock_name, idempotency_key);
COMMENT ON CONSTRAINT outbox_key_unique ON pgfence.outbox IS
  'One intent per idempotency key and lock: the holders of other locks cannot take a lock''s keys.';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue(
    lock_name       text,
    token           bigint,
    topic           text,
    idempotency_key text,
    payload         jsonb,
    max_attempts    integer DEFAULT 25,
    run_at          timestamptz DEFAULT NULL
) RETURNS TABLE (intent_id bigint, duplicate boolean, intent_topic text, intent_lock_name text, intent_token bigint,
                 enqueued_at timestamptz)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    latest bigint;
    jid    bigint;
BEGIN
    IF outbox_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'pgfence outbox: payload must not be NULL' USING ERRCODE = '22004';
    END IF;
    -- 1. The token must be the lock's latest grant (checked again at COMMIT,
    --    under a lock, by trigger outbox_check_token).
    SELECT l.token INTO latest FROM pgfence.locks l WHERE l.name = outbox_enqueue.lock_name;
    PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                         outbox_enqueue.token, latest);
    FOR attempt IN 1..3 LOOP
        -- 2. A key already recorded for this lock: the first intent wins.
        RETURN QUERY SELECT o.id, true, o.topic, o.lock_name, o.token, o.created_at
                       FROM pgfence.outbox o
                      WHERE o.lock_name = outbox_enqueue.lock_name
                        AND o.idempotency_key = outbox_enqueue.idempotency_key;
        IF FOUND THEN
            RETURN;
        END IF;
        -- 3. The delivery job, then the intent under the job's id.
        INSERT INTO pgfence.jobs (queue, run_at, max_attempts)
        VALUES ('outbox:' || outbox_enqueue.topic, coalesce(outbox_enqueue.run_at, now()), outbox_enqueue.max_attempts)
        RETURNING id INTO jid;
        INSERT INTO pgfence.outbox AS o (id, topic, idempotency_key, lock_name, token, payload)
        VALUES (jid, outbox_enqueue.topic, outbox_enqueue.idempotency_key, outbox_enqueue.lock_name,
                outbox_enqueue.token, outbox_enqueue.payload)
        ON CONFLICT ON CONSTRAINT outbox_key_unique DO NOTHING
        RETURNING o.id, false, o.topic, o.lock_name, o.token, o.created_at
             INTO intent_id, duplicate, intent_topic, intent_lock_name, intent_token, enqueued_at;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        -- A concurrent enqueue of the same lock and key committed first: drop
        -- the job and report that intent.
        DELETE FROM pgfence.jobs j WHERE j.id = jid;
    END LOOP;
    RAISE EXCEPTION 'pgfence outbox: key % of lock % keeps appearing and disappearing; not recorded',
            outbox_enqueue.idempotency_key, outbox_enqueue.lock_name
        USING ERRCODE = '40001';
END
$fn$;
-- +goose StatementEnd

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE pgfence.jobs DROP CONSTRAINT jobs_payload_size;
ALTER TABLE pgfence.outbox DROP CONSTRAINT outbox_payload_size;
ALTER TABLE pgfence.locks DROP CONSTRAINT locks_metadata_size;
ALTER TABLE pgfence.outbox DROP CONSTRAINT outbox_key_unique;
ALTER TABLE pgfence.outbox ADD CONSTRAINT outbox_key_unique UNIQUE (idempotency_key);

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue(
    lock_name       text,
    token           bigint,
    topic           text,
    idempotency_key text,
    payload         jsonb,
    max_attempts    integer DEFAULT 25,
    run_at          timestamptz DEFAULT NULL
) RETURNS TABLE (intent_id bigint, duplicate boolean, intent_topic text, intent_lock_name text, intent_token bigint,
                 enqueued_at timestamptz)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    latest bigint;
    jid    bigint;
BEGIN
    IF outbox_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'pgfence outbox: payload must not be NULL' USING ERRCODE = '22004';
    END IF;
    SELECT l.token INTO latest FROM pgfence.locks l WHERE l.name = outbox_enqueue.lock_name;
    PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                         outbox_enqueue.token, latest);
    FOR attempt IN 1..3 LOOP
        RETURN QUERY SELECT o.id, true, o.topic, o.lock_name, o.token, o.created_at
                       FROM pgfence.outbox o WHERE o.idempotency_key = outbox_enqueue.idempotency_key;
        IF FOUND THEN
            RETURN;
        END IF;
        INSERT INTO pgfence.jobs (queue, run_at, max_attempts)
        VALUES ('outbox:' || outbox_enqueue.topic, coalesce(outbox_enqueue.run_at, now()), outbox_enqueue.max_attempts)
        RETURNING id INTO jid;
        INSERT INTO pgfence.outbox AS o (id, topic, idempotency_key, lock_name, token, payload)
        VALUES (jid, outbox_enqueue.topic, outbox_enqueue.idempotency_key, outbox_enqueue.lock_name,
                outbox_enqueue.token, outbox_enqueue.payload)
        ON CONFLICT ON CONSTRAINT outbox_key_unique DO NOTHING
        RETURNING o.id, false, o.topic, o.lock_name, o.token, o.created_at
             INTO intent_id, duplicate, intent_topic, intent_lock_name, intent_token, enqueued_at;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        DELETE FROM pgfence.jobs j WHERE j.id = jid;
    END LOOP;
    RAISE EXCEPTION 'pgfence outbox: key % keeps appearing and disappearing; not recorded',
            outbox_enqueue.idempotency_key
        USING ERRCODE = '40001';
END
$fn$;
-- +goose StatementEnd
