-- pgfence.outbox: fenced side-effect intents (an email, a payment, an HTTP
-- call), recorded in the holder's own transaction and delivered at least once
-- by a dispatcher with an idempotency key. See the outbox package.
--
-- An intent names the lock and token that authorised it. It is recorded only
-- while that token is the latest grant of the lock, the rule of the guard
-- (migration 00008): a superseded holder is refused with SQLSTATE PF003 (stale
-- token, through pgfence.fence_refused, so its DETAIL reads "token N, fence M,
-- table pgfence.outbox, key K" with M the lock's latest token), a token the
-- lock never issued (or no such lock) with PF002. The check runs twice:
--   at the insert, without locking, so a stale holder learns it at once;
--   at COMMIT (a deferred constraint trigger), with the lock row locked FOR
--   SHARE until the commit ends, so a grant cannot commit between the check
--   and the commit. The lock is taken at COMMIT only: a holder paused between
--   its insert and its COMMIT does not hold back the next grant, and its
--   COMMIT is then refused.
-- Every insert and every change of lock_name or token is checked, whether it
-- comes from pgfence.outbox_enqueue() or from plain SQL.
--
-- Each intent is delivered through one row of pgfence.jobs on queue
-- 'outbox:' || topic; the intent's id is that job's id. There is no foreign
-- key: pruning (or truncating) pgfence.jobs keeps working as before, and an
-- intent outlives its delivery job, so its idempotency key stays taken until
-- the application deletes the intent.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

CREATE TABLE pgfence.outbox (
    id              bigint      PRIMARY KEY,
    topic           text        NOT NULL,
    idempotency_key text        NOT NULL,
    lock_name       text        NOT NULL,
    token           bigint      NOT NULL,
    payload         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_topic_format CHECK (topic ~ '^[A-Za-z0-9._:/-]{1,100}$'),
    CONSTRAINT outbox_key_format CHECK (idempotency_key ~ '^[!-~]{1,255}$'),
    CONSTRAINT outbox_lock_name_length CHECK (octet_length(lock_name) BETWEEN 1 AND 512),
    CONSTRAINT outbox_token_positive CHECK (token > 0),
    CONSTRAINT outbox_key_unique UNIQUE (idempotency_key)
);

COMMENT ON TABLE pgfence.outbox IS
  'Side-effect intents recorded by lock holders in their own transaction, each only while its token is the latest '
  'grant of its lock. Delivered at least once, with the idempotency key, through the pgfence.jobs row of the same id '
  '(queue outbox:<topic>). Kept after delivery (the key stays taken) until the application deletes it. '
  'See pgfence.outbox_status.';
COMMENT ON COLUMN pgfence.outbox.id IS
  'Intent id: the id of the pgfence.jobs row that delivers it (no foreign key: the job may be pruned first).';
COMMENT ON COLUMN pgfence.outbox.topic IS
  'Kind of side effect (email, payment, ...): 1..100 bytes of ASCII letters, digits and . _ : / -. '
  'Dispatchers deliver one topic each.';
COMMENT ON COLUMN pgfence.outbox.idempotency_key IS
  'Idempotency key, unique across the outbox: 1..255 visible ASCII characters. A second intent with the same key is '
  'not recorded (the first wins). Sent to the receiver, which deduplicates by it.';
COMMENT ON COLUMN pgfence.outbox.lock_name IS
  'Lock whose grant authorised the intent (pgfence.locks.name).';
COMMENT ON COLUMN pgfence.outbox.token IS
  'Fencing token of that grant: the lock''s latest token when the intent committed.';
COMMENT ON COLUMN pgfence.outbox.payload IS
  'What to send, as JSON, opaque to pgfence.';
COMMENT ON COLUMN pgfence.outbox.created_at IS
  'Database time of the insert.';
COMMENT ON INDEX pgfence.outbox_pkey IS
  'Primary key; dispatchers read an intent by the id of the job they claimed.';
COMMENT ON INDEX pgfence.outbox_key_unique IS
  'One intent per idempotency key.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.outbox_token_refused(lock_name text, idempotency_key text, token bigint, latest bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    key text := pg_catalog.jsonb_build_object('idempotency_key', idempotency_key)::text;
BEGIN
    IF token IS NULL OR token <= 0 THEN
        PERFORM pgfence.fence_refused('pgfence.outbox', key, 'strict', token, latest, true);  -- PF007
    ELSIF latest IS NULL OR token > latest THEN
        RAISE EXCEPTION 'pgfence outbox: intent % carries token % but lock % issued only %',
                key, token, quote_literal(lock_name), coalesce(latest::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = 'pgfence', TABLE = 'outbox', COLUMN = 'token',
                  DETAIL = format('op INSERT, key %s, token %s, lock %s, latest token %s', key, token, lock_name,
                                  coalesce(latest::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks: pass the token of your lease.';
    ELSIF token < latest THEN
        PERFORM pgfence.fence_refused('pgfence.outbox', key, 'strict', token, latest, true);  -- PF003
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.outbox_token_refused(text, text, bigint, bigint) IS
  'Raises the refusal of an intent whose token is not the latest of its lock: PF003 (stale: a newer grant exists; '
  'DETAIL token, fence = latest token, table, key), PF002 (never issued, or no such lock), PF007 (token <= 0). '
  'Returns when token = latest.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.outbox_check_token() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    latest bigint;
BEGIN
    -- FOR SHARE: a grant (an UPDATE of the lock row) waits until this
    -- transaction ends, so none can commit between this check and the commit.
    SELECT l.token INTO latest FROM pgfence.locks l WHERE l.name = NEW.lock_name FOR SHARE;
    PERFORM pgfence.outbox_token_refused(NEW.lock_name, NEW.idempotency_key, NEW.token, latest);
    RETURN NULL;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.outbox_check_token() IS
  'Deferred constraint trigger of pgfence.outbox: at COMMIT, locks the intent''s lock row FOR SHARE and refuses the '
  'intent unless its token is the lock''s latest (see pgfence.outbox_token_refused).';

CREATE CONSTRAINT TRIGGER outbox_check_token AFTER INSERT OR UPDATE OF lock_name, token ON pgfence.outbox
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgfence.outbox_check_token();
ALTER TABLE pgfence.outbox ENABLE ALWAYS TRIGGER outbox_check_token;
COMMENT ON TRIGGER outbox_check_token ON pgfence.outbox IS
  'At COMMIT: the intent''s token must still be the latest grant of its lock (lock row locked FOR SHARE until the '
  'commit ends). ENABLE ALWAYS: also with session_replication_role = replica.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.outbox_enqueue(
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
        -- 2. A key already recorded: the first intent wins.
        RETURN QUERY SELECT o.id, true, o.topic, o.lock_name, o.token, o.created_at
                       FROM pgfence.outbox o WHERE o.idempotency_key = outbox_enqueue.idempotency_key;
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
        -- A concurrent enqueue of the same key committed first: drop the job
        -- and report that intent.
        DELETE FROM pgfence.jobs j WHERE j.id = jid;
    END LOOP;
    RAISE EXCEPTION 'pgfence outbox: key % keeps appearing and disappearing; not recorded',
            outbox_enqueue.idempotency_key
        USING ERRCODE = '40001';
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.outbox_enqueue(text, bigint, text, text, jsonb, integer, timestamptz) IS
  'Record a side-effect intent in the current transaction, only if token is the latest grant of lock_name: returns '
  'the new intent (duplicate = false), or the intent already recorded under idempotency_key (duplicate = true, '
  'nothing recorded). Refused with PF003 (stale token), PF002 (token never issued, or no such lock) or PF007 '
  '(token <= 0); the check is repeated at COMMIT under a lock of the lock row. Delivered through a pgfence.jobs row '
  'on queue outbox:<topic> (max_attempts attempts, not before run_at).';

CREATE VIEW pgfence.outbox_status AS
SELECT o.topic,
       count(*) FILTER (WHERE j.state = 'available' AND j.run_at <= now()) AS pending,
       count(*) FILTER (WHERE j.state = 'available' AND j.run_at > now()) AS retry_waiting,
       count(*) FILTER (WHERE j.state = 'running' AND j.claim_expires_at > now()) AS in_flight,
       count(*) FILTER (WHERE j.state = 'running' AND j.claim_expires_at <= now()) AS expired_claims,
       count(*) FILTER (WHERE j.state = 'completed') AS delivered,
       count(*) FILTER (WHERE j.state = 'dead') AS dead,
       round(extract(epoch FROM now() - min(o.created_at) FILTER (WHERE j.state IN ('available', 'running')))::numeric, 3)
           AS oldest_undelivered_seconds,
       max(j.attempts) FILTER (WHERE j.state IN ('available', 'running')) AS max_attempts_undelivered
FROM pgfence.outbox o
JOIN pgfence.jobs j ON j.id = o.id
GROUP BY o.topic;

COMMENT ON VIEW pgfence.outbox_status IS
  'pgfence.outbox per topic, on the database clock: intents pending (due, not claimed), waiting for a retry, in '
  'flight (claimed by a dispatcher), with an expired claim (a dispatcher died or stalled), delivered, dead (gave up '
  'after max_attempts, or refused permanently), and the age of the oldest undelivered intent. Reads every intent.';
COMMENT ON COLUMN pgfence.outbox_status.pending IS
  'Intents due for delivery and not claimed.';
COMMENT ON COLUMN pgfence.outbox_status.retry_waiting IS
  'Intents whose last attempt failed, waiting for their retry (or scheduled for later).';
COMMENT ON COLUMN pgfence.outbox_status.in_flight IS
  'Intents claimed by a dispatcher whose claim has not expired.';
COMMENT ON COLUMN pgfence.outbox_status.expired_claims IS
  'Intents claimed by a dispatcher that died or stalled: the next claim takes them over.';
COMMENT ON COLUMN pgfence.outbox_status.dead IS
  'Intents that will not be delivered: every attempt failed, or the receiver refused them permanently. Needs a human.';
COMMENT ON COLUMN pgfence.outbox_status.oldest_undelivered_seconds IS
  'Seconds since the oldest intent not yet delivered (nor dead) was recorded; NULL if none.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
-- Refuse to drop intents that are not delivered yet: they would be lost.
-- +goose StatementBegin
DO $chk$
BEGIN
    IF EXISTS (SELECT 1 FROM pgfence.outbox o JOIN pgfence.jobs j ON j.id = o.id
                WHERE j.state IN ('available', 'running')) THEN
        RAISE EXCEPTION 'pgfence: pgfence.outbox has undelivered intents; deliver them (or delete their jobs) before migrating down';
    END IF;
END
$chk$;
-- +goose StatementEnd
DROP VIEW pgfence.outbox_status;
DROP FUNCTION pgfence.outbox_enqueue(text, bigint, text, text, jsonb, integer, timestamptz);
DROP TABLE pgfence.outbox;
DROP FUNCTION pgfence.outbox_check_token();
DROP FUNCTION pgfence.outbox_token_refused(text, text, bigint, bigint);
