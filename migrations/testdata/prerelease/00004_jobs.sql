-- pgfence.jobs: a ready-made job queue claimed with FOR UPDATE SKIP LOCKED,
-- either inside the caller's transaction or as leased claims fenced by a
-- per-row claim token. See the skiplocked package and the README.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
CREATE SCHEMA IF NOT EXISTS pgfence;

CREATE SEQUENCE pgfence.jobs_claim_token_seq
    AS bigint START WITH 1 INCREMENT BY 1 MINVALUE 1 NO MAXVALUE CACHE 1 NO CYCLE;
COMMENT ON SEQUENCE pgfence.jobs_claim_token_seq IS
  'Source of claim tokens for pgfence.jobs: one nextval per claimed row, never cycles (overflow is an error, '
  'never a wrap), CACHE 1 so tokens are issued in one global order.';

CREATE TABLE pgfence.jobs (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue            text        NOT NULL,
    payload          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    priority         smallint    NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL DEFAULT 25,
    state            text        NOT NULL DEFAULT 'available',
    claimed_by       text,
    claim_token      bigint,
    claim_expires_at timestamptz,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    CONSTRAINT jobs_queue_length CHECK (octet_length(queue) BETWEEN 1 AND 128),
    CONSTRAINT jobs_state_known CHECK (state IN ('available', 'running', 'completed', 'dead')),
    CONSTRAINT jobs_attempts_nonnegative CHECK (attempts >= 0),
    CONSTRAINT jobs_max_attempts_positive CHECK (max_attempts BETWEEN 1 AND 1000000),
    CONSTRAINT jobs_claim_token_positive CHECK (claim_token IS NULL OR claim_token > 0),
    CONSTRAINT jobs_claimed_by_length CHECK (claimed_by IS NULL OR octet_length(claimed_by) BETWEEN 1 AND 512),
    CONSTRAINT jobs_running_has_claim CHECK (
        (state = 'running') = (claim_expires_at IS NOT NULL)
        AND (state <> 'running' OR (claim_token IS NOT NULL AND claimed_by IS NOT NULL))),
    CONSTRAINT jobs_finished_has_time CHECK ((state IN ('completed', 'dead')) = (finished_at IS NOT NULL))
);

COMMENT ON TABLE pgfence.jobs IS
  'Job queue. A row is available (waiting until run_at), running (claimed until claim_expires_at, database '
  'clock), completed or dead (failed max_attempts times, last_error kept). Leased claims give each claimed row '
  'a new claim_token; complete, fail, heartbeat and release are conditional on (id, claim_token), so a worker '
  'whose claim expired and was re-claimed changes nothing. Finished rows are kept until the application deletes them.';
COMMENT ON COLUMN pgfence.jobs.id IS
  'Job id, assigned by the database.';
COMMENT ON COLUMN pgfence.jobs.queue IS
  'Queue name, 1..128 bytes. Workers claim from one queue; inserts NOTIFY channel pgfence_jobs with it as payload.';
COMMENT ON COLUMN pgfence.jobs.payload IS
  'Job arguments as JSON, opaque to pgfence.';
COMMENT ON COLUMN pgfence.jobs.priority IS
  'Claim order: lower numbers are claimed first; ties by run_at, then id.';
COMMENT ON COLUMN pgfence.jobs.run_at IS
  'Earliest database time at which the job may be claimed; a failed attempt pushes it by the retry backoff.';
COMMENT ON COLUMN pgfence.jobs.attempts IS
  'Number of leased claims so far (a release gives one back). When a failure leaves attempts >= max_attempts '
  'the job is dead.';
COMMENT ON COLUMN pgfence.jobs.max_attempts IS
  'Attempts allowed before the job goes to state dead (1..1000000).';
COMMENT ON COLUMN pgfence.jobs.state IS
  'available | running | completed | dead. Only available rows whose run_at has passed, and running rows whose '
  'claim expired, can be claimed.';
COMMENT ON COLUMN pgfence.jobs.claimed_by IS
  'Worker identity of the latest leased claim (kept after the claim ends, for operators).';
COMMENT ON COLUMN pgfence.jobs.claim_token IS
  'Claim token of the latest leased claim, from pgfence.jobs_claim_token_seq: a new, larger token on every claim, '
  'never reset. Complete, fail, heartbeat and release must present it; a stale worker''s token no longer matches.';
COMMENT ON COLUMN pgfence.jobs.claim_expires_at IS
  'Database time at which the current leased claim ends and the row becomes claimable again; '
  'set only while state = running.';
COMMENT ON COLUMN pgfence.jobs.last_error IS
  'Error message of the latest failed attempt (or of an expired claim), kept when the job goes dead.';
COMMENT ON COLUMN pgfence.jobs.created_at IS
  'Database time of the insert.';
COMMENT ON COLUMN pgfence.jobs.updated_at IS
  'Database time of the latest change made by pgfence.';
COMMENT ON COLUMN pgfence.jobs.finished_at IS
  'Database time at which the job was completed or went dead; NULL otherwise.';

COMMENT ON INDEX pgfence.jobs_pkey IS
  'Primary key; complete, fail, heartbeat and release find the job by id.';
COMMENT ON SEQUENCE pgfence.jobs_id_seq IS
  'Identity sequence of pgfence.jobs.id.';

-- Claiming reads only these two partial indexes, so finished rows piling up
-- do not slow it down.
CREATE INDEX jobs_available_idx ON pgfence.jobs (queue, priority, run_at, id) WHERE state = 'available';
COMMENT ON INDEX pgfence.jobs_available_idx IS
  'Claim order for available jobs of a queue; partial, so completed and dead rows are not in it.';
CREATE INDEX jobs_running_expiry_idx ON pgfence.jobs (queue, claim_expires_at) WHERE state = 'running';
COMMENT ON INDEX pgfence.jobs_running_expiry_idx IS
  'Running jobs of a queue by claim expiry, to re-claim expired claims.';
CREATE INDEX jobs_finished_idx ON pgfence.jobs (finished_at) WHERE state IN ('completed', 'dead');
COMMENT ON INDEX pgfence.jobs_finished_idx IS
  'Finished jobs by finish time, for deleting old ones.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.jobs_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pgfence_jobs', q.queue) FROM (SELECT DISTINCT queue FROM new_jobs) AS q;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.jobs_notify() IS
  'Statement trigger: NOTIFY pgfence_jobs once per queue that received rows, delivered at commit.';

CREATE TRIGGER jobs_notify AFTER INSERT ON pgfence.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence.jobs_notify();
COMMENT ON TRIGGER jobs_notify ON pgfence.jobs IS
  'Wakes listening workers when jobs are inserted (NOTIFY pgfence_jobs, payload = queue).';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
DROP TABLE IF EXISTS pgfence.jobs;
DROP FUNCTION IF EXISTS pgfence.jobs_notify();
DROP SEQUENCE IF EXISTS pgfence.jobs_claim_token_seq;
