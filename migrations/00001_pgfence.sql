-- pgfence's schema: lease locks with fencing tokens and their waiter queue,
-- fenced writes and the guard, the job queue, the outbox, and views for
-- operators. This one migration creates all of it; every later change is a
-- migration of its own (docs/migrations.md says how they are written).
--
-- The migration runner creates schema pgfence before goose runs (its version
-- table, pgfence.goose_db_version, lives there), so "IF NOT EXISTS" is needed
-- here; the same file also works when copied into an application's own goose
-- directory.
--
-- search_path. Every function of the schema runs with search_path pinned to
-- pg_catalog, pg_temp, and so does this migration (SET LOCAL at its start, until
-- its transaction ends), whatever the search_path of the migrating role. A
-- function without a pinned search_path resolves unqualified names with the
-- caller's search_path. Anyone who can create objects in a schema on that path
-- (schema public on PostgreSQL 14 and older, by default) can define a better
-- matching overload (public.format(text, text, regclass) beats
-- pg_catalog.format(text, VARIADIC "any")) and have it run with the caller's
-- rights: a superuser reading pgfence.guarded_fences, an application writing
-- through a guard trigger, any role inserting a job. Pinned to pg_catalog,
-- pg_temp, unqualified names resolve in pg_catalog only (pg_temp, last, is never
-- searched for functions or operators), and the views, constraints and column
-- defaults created here are bound to pg_catalog's functions and operators.
-- Pinning adds one configuration save and restore per call of a function: once
-- per INSERT statement on pgfence.jobs, once per row for the triggers of
-- pgfence.locks and of guarded tables. The statements pglock, skiplocked, the
-- outbox, fencedwrite and the CLI send from the client qualify the names they
-- use instead (OPERATOR(pg_catalog.=), pg_catalog.now()).
--
-- SQLSTATEs raised by the schema's functions and triggers (class PF, "pgfence"):
--   PF001  guard: the change does not raise the row's fence, or carries no token
--          (stale token, replay, or a writer that sends no token at all)
--   PF002  guard, outbox: the token was never issued for the row's lock
--          (forged or mistyped), or no lock governs the row
--   PF003  fenced statement or outbox intent refused: stale token (a newer
--          grant wrote the row; for an intent, a newer grant exists)
--   PF004  fenced statement refused: already applied (strict: this grant wrote the row)
--   PF005  fenced statement refused: no row with that key
--   PF006  fenced statement refused: the row changed concurrently; not applied
--   PF007  fenced statement or outbox intent refused: invalid token (must be > 0)
--   PF008  guard: the token is not the latest grant of the row's lock (a superseded holder)
--   PF011  a lease function refused an argument (NULL, empty or oversized name
--          or holder, TTL out of bounds, token <= 0, key not 16..64 bytes); the
--          message names the argument and the rule
--          (the fenced value functions too: key, token, value, reentrant)
--          (pgfence.outbox_enqueue too: lock name, key, topic, idempotency key,
--          max_attempts)
--   PF012  outbox intent refused: the lease (lock, token) is not held with the
--          key given (released, expired, or another key)
--   (PF009 and PF010 were the pre-release integrity trigger's; no longer raised)
--
-- Contents, in order: the schema; the tables with their constraints and
-- indexes (leases, the waiter queue, fenced writes, jobs, the outbox); the
-- functions (leases, fenced writes and the guard, fenced values, jobs, the
-- outbox, operator views); the triggers; the views. Nothing is granted here:
-- the grants of the role an application runs as are in docs/migrations.md.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
CREATE SCHEMA IF NOT EXISTS pgfence;
COMMENT ON SCHEMA pgfence IS
  'pgfence: lease locks with fencing tokens, fenced writes and row claiming. See the pgfence README.';

-- Tables ---------------------------------------------------------------------

-- pgfence.locks: one row per lease lock. A grant raises the token by one; rows
-- are never deleted, so a token is never issued twice for a name. Only the
-- lease functions below write it (the application's role has no INSERT,
-- UPDATE or DELETE on it). key_hash is sha256 of the holder's lease key, NULL
-- when the lease was released.
--
-- waiting_since is pglock's waiter flag: a release sends NOTIFY
-- pgfence_lock_released only while a waiter's mark is under 100 seconds old
-- (waiters refresh it every 30 seconds; grants and releases keep it), so
-- uncontended acquire/release cycles never take PostgreSQL's cluster-wide NOTIFY
-- commit lock.
--
-- Size limits are named CHECKs the server enforces whoever writes, measured on
-- the text form of the stored value (jsonb is stored normalised: the bytes a
-- client sent may differ). Lock metadata, which no pgfence API writes, is
-- bounded like the job and outbox payloads; the Go packages turn a violation of
-- one of these constraints into the same error as their own check.
CREATE TABLE pgfence.locks (
    name          text        PRIMARY KEY,
    token         bigint      NOT NULL DEFAULT 0,
    holder        text,
    acquired_at   timestamptz,
    renewed_at    timestamptz,
    expires_at    timestamptz,
    metadata      jsonb,
    waiting_since timestamptz,
    key_hash      bytea,
    CONSTRAINT locks_name_length CHECK (octet_length(name) BETWEEN 1 AND 512),
    CONSTRAINT locks_token_nonnegative CHECK (token >= 0),
    CONSTRAINT locks_holder_length CHECK (holder IS NULL OR octet_length(holder) BETWEEN 1 AND 512),
    CONSTRAINT locks_holder_has_expiry CHECK ((holder IS NULL) = (expires_at IS NULL)),
    CONSTRAINT locks_metadata_size
        CHECK (pg_catalog.octet_length(metadata::pg_catalog.text) OPERATOR(pg_catalog.<=) 1048576)
);

COMMENT ON TABLE pgfence.locks IS
  'One row per lease lock. A lock is held while holder is set and expires_at > now() (database clock); '
  'free when holder is NULL; expired when holder is set and expires_at <= now(). Rows are never deleted '
  'and token never goes down, so a fence column can compare against it.';
COMMENT ON COLUMN pgfence.locks.name IS
  'Lock name chosen by the application, 1..512 bytes, e.g. ''invoice:42''.';
COMMENT ON COLUMN pgfence.locks.token IS
  'Fencing token of the latest grant: incremented by 1 on every grant, never reset. 0 = never granted. '
  'Writers pass it to fenced writes; storage refuses tokens lower than its fence.';
COMMENT ON COLUMN pgfence.locks.holder IS
  'Identity of the current holder (default hostname/pid/random), NULL when the lock was released.';
COMMENT ON COLUMN pgfence.locks.acquired_at IS
  'Database time of the latest grant.';
COMMENT ON COLUMN pgfence.locks.renewed_at IS
  'Database time of the latest renewal of the current grant (NULL if never renewed).';
COMMENT ON COLUMN pgfence.locks.expires_at IS
  'Database time at which the current grant ends; after it anyone may take the lock. NULL when released.';
COMMENT ON COLUMN pgfence.locks.metadata IS
  'Optional JSON set by the holder for operators (job id, version, ...). Never used for decisions.';
COMMENT ON COLUMN pgfence.locks.waiting_since IS
  'Database time at which a waiter last asked to be woken when this lock is released (written only while the lock '
  'is held, at most every 30 seconds; grants and releases keep it). A release sends NOTIFY pgfence_lock_released '
  'only while it is less than 100 seconds old. Never used to decide who holds the lock.';
COMMENT ON COLUMN pgfence.locks.key_hash IS
  'sha256 of the holder''s lease key (the key itself is never stored); renewals and releases must present the key. '
  'NULL when released.';
COMMENT ON CONSTRAINT locks_metadata_size ON pgfence.locks IS
  'Lock metadata is at most 1 MiB in its text form.';

-- pgfence.lock_queue: the waiter queue of pglock. A release hands the lease to
-- the longest-waiting live waiter in the same statement, instead of freeing it
-- and waking every waiter of the name (who would then race for it).
--
-- A waiter (Locker.Acquire, LISTEN mode) whose first attempt finds the lock
-- held queues itself in a row keyed by wkey, a random key it listens for: a new
-- ticket (FIFO order), a random wait_id for this wait, its holder, the TTL it
-- asked for and alive_until, now() + that TTL, which the waiter pushes forward
-- while it waits. ReleaseLock takes the first live row of the name (skipping
-- rows locked by a concurrent refresh or departure), grants the lease to it
-- (token + 1, expiry now() + its TTL), records the token in the row
-- (granted_token) and notifies pgfence_lock_handoff with "wkey wait_id token
-- expiry_us". The waiter reads its grant (HandedLock) without writing. The
-- wait_id keeps a waiter from taking a late notification meant for an earlier
-- wait of the same key, and a listener that saw the key used cannot forge a
-- handoff for the next wait (it would need the new wait_id). A waiter that went
-- away is skipped once alive_until has passed, so a dead waiter holds the lock
-- at most one TTL.
--
-- Rows are reusable slots, so that a hot lock name does not leave a dead index
-- entry behind every grant: a Locker keeps the key of a row whose wait ended and
-- reuses it for its next wait of the same name, updating the row in place (a new
-- ticket, a new wait_id, granted_token NULL again). No column that changes is
-- indexed, so these are HOT updates: no new index entry, and the old row
-- versions are pruned from the heap page without VACUUM. (Deleting each row and
-- inserting a new one, with tickets that only grow, piles dead entries up at the
-- left end of a (name, ticket) index, exactly where every handoff's scan for the
-- first waiter starts: measured on a 2-core server, a hot name served 667
-- grants/s with autovacuum alone and 899 with the queue vacuumed every second.)
-- So the primary key is wkey, the only other index is on name, and a handoff
-- sorts the few rows of one name by ticket. A row whose wait ended keeps a
-- granted_token (0 if nothing was handed to it), is never served again until
-- it is queued again, and is kept 10 seconds (its alive_until) for that; rows
-- whose alive_until has passed are deleted by the next release of the name.
--
-- key_hash is sha256 of the waiter's lease key: a handoff copies it to the
-- lock row, and only that key can read, renew, release or leave the row's
-- wait. Only the lease functions below read or write the queue.
CREATE TABLE pgfence.lock_queue (
    ticket        bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    wkey          bigint      NOT NULL,
    name          text        NOT NULL,
    holder        text        NOT NULL,
    ttl_us        bigint      NOT NULL,
    alive_until   timestamptz NOT NULL,
    granted_token bigint,
    wait_id       bigint      NOT NULL DEFAULT 0,
    key_hash      bytea       NOT NULL,
    CONSTRAINT lock_queue_pkey PRIMARY KEY (wkey),
    CONSTRAINT lock_queue_name_length CHECK (octet_length(name) BETWEEN 1 AND 512),
    CONSTRAINT lock_queue_holder_length CHECK (octet_length(holder) BETWEEN 1 AND 512),
    CONSTRAINT lock_queue_ttl CHECK (ttl_us > 0 AND ttl_us <= 86400000000)
);
CREATE INDEX lock_queue_name ON pgfence.lock_queue (name);

COMMENT ON TABLE pgfence.lock_queue IS
  'Waiters of held pglock leases, in arrival order (ticket), one reusable row per waiter key. A release hands the '
  'lease to the first live waiter of its name. Never used to decide who holds a lock: pgfence.locks does.';
COMMENT ON COLUMN pgfence.lock_queue.ticket IS
  'Arrival order: the lowest live ticket of a name is served first. A new ticket for every wait of the row.';
COMMENT ON COLUMN pgfence.lock_queue.wkey IS
  'Key the waiter listens for on channel pgfence_lock_handoff; random, reused by its Locker for the next wait.';
COMMENT ON COLUMN pgfence.lock_queue.name IS 'Lock name waited for.';
COMMENT ON COLUMN pgfence.lock_queue.holder IS 'Holder identity the lease is granted to.';
COMMENT ON COLUMN pgfence.lock_queue.ttl_us IS 'TTL the waiter asked for, in microseconds.';
COMMENT ON COLUMN pgfence.lock_queue.alive_until IS
  'The waiter is skipped (and its row deleted) once this time passes: it refreshes it while it waits.';
COMMENT ON COLUMN pgfence.lock_queue.granted_token IS
  'Token of the lease a release handed to this wait; NULL while it waits; 0 once the wait ended without one.';
COMMENT ON COLUMN pgfence.lock_queue.key_hash IS
  'sha256 of the waiter''s lease key: a handoff gives the lease this hash, so only the waiter can renew or release it.';
COMMENT ON COLUMN pgfence.lock_queue.wait_id IS
  'Random number of the current wait of the row, drawn by the waiter; sent with wkey in the handoff notification.';

-- Fenced writes: a small fenced key/value table used by the generated helpers,
-- and the registry of the database-side guard a DBA can attach to any table
-- with a fence column (pgfence.guard, below). Only the fenced value functions
-- (pgfence.fenced_value_update and the others, below) change fenced_values:
-- the application's role reads it.
CREATE TABLE pgfence.fenced_values (
    key        text        PRIMARY KEY,
    value      jsonb       NOT NULL,
    fence      bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT fenced_values_key_length CHECK (octet_length(key) BETWEEN 1 AND 512),
    CONSTRAINT fenced_values_fence_nonnegative CHECK (fence >= 0)
);
COMMENT ON TABLE pgfence.fenced_values IS
  'Small fenced key/value store (checkpoints, cursors, a leader''s decisions). Every write carries a fencing '
  'token from pgfence.locks; a write whose token is lower than the row''s fence is refused.';
COMMENT ON COLUMN pgfence.fenced_values.key IS
  'Key chosen by the application, 1..512 bytes.';
COMMENT ON COLUMN pgfence.fenced_values.value IS
  'The stored JSON value.';
COMMENT ON COLUMN pgfence.fenced_values.fence IS
  'Highest fencing token this row accepted (0 = never written under a token). Writes with a lower token are refused.';
COMMENT ON COLUMN pgfence.fenced_values.updated_at IS
  'Database time of the latest accepted write.';

-- One row per guarded table. The governing lock comes from exactly one source:
-- a fixed name, a column of the table (plain or GENERATED ... STORED) or an SQL
-- expression over the row's columns.
CREATE TABLE pgfence.guarded_tables (
    relid                regclass    PRIMARY KEY,
    fence_column         text        NOT NULL,
    lock_name            text,
    lock_name_column     text,
    mode                 text        NOT NULL,
    trigger_function     text        NOT NULL,
    guarded_at           timestamptz NOT NULL DEFAULT now(),
    guarded_by           text        NOT NULL DEFAULT current_user,
    lock_name_expression text,
    CONSTRAINT guarded_tables_one_lock_source
        CHECK (pg_catalog.num_nonnulls(lock_name, lock_name_column, lock_name_expression) = 1),
    CONSTRAINT guarded_tables_mode CHECK (mode IN ('strict', 'reentrant'))
);
COMMENT ON TABLE pgfence.guarded_tables IS
  'Tables with a pgfence guard trigger (see pgfence.guard / pgfence.unguard). One row per table.';
COMMENT ON COLUMN pgfence.guarded_tables.relid IS
  'The guarded table.';
COMMENT ON COLUMN pgfence.guarded_tables.fence_column IS
  'The bigint column holding the highest token each row accepted.';
COMMENT ON COLUMN pgfence.guarded_tables.lock_name IS
  'Name of the pgfence.locks row that governs every row of the table (NULL when lock_name_column is used).';
COMMENT ON COLUMN pgfence.guarded_tables.lock_name_column IS
  'Column of the guarded table whose value is the name of the governing lock (NULL when lock_name is used).';
COMMENT ON COLUMN pgfence.guarded_tables.mode IS
  'strict: every UPDATE must raise the fence; reentrant: an UPDATE that assigns the fence column may keep it equal. '
  'INSERT and DELETE are checked in both modes.';
COMMENT ON COLUMN pgfence.guarded_tables.trigger_function IS
  'Name of the trigger function in schema pgfence that pgfence.guard generated for this table.';
COMMENT ON COLUMN pgfence.guarded_tables.guarded_at IS
  'Database time at which the guard was attached (or last re-attached).';
COMMENT ON COLUMN pgfence.guarded_tables.guarded_by IS
  'Role that attached the guard.';
COMMENT ON COLUMN pgfence.guarded_tables.lock_name_expression IS
  'SQL expression over the columns of the guarded table giving the name of the governing lock (NULL when lock_name '
  'or lock_name_column is used).';

-- pgfence.jobs: a ready-made job queue claimed with FOR UPDATE SKIP LOCKED,
-- either inside the caller's transaction or as leased claims fenced by a
-- per-row claim token. See the skiplocked package and the README.
CREATE SEQUENCE pgfence.jobs_claim_token_seq
    AS bigint START WITH 1 INCREMENT BY 1 MINVALUE 1 NO MAXVALUE CACHE 1 NO CYCLE;
COMMENT ON SEQUENCE pgfence.jobs_claim_token_seq IS
  'Source of claim tokens for pgfence.jobs: one nextval per claimed row, never cycles (overflow is an error, '
  'never a wrap), CACHE 1 so tokens are issued in one global order.';

-- holder is the identity of whoever holds the latest leased claim, named as in
-- pgfence.locks.holder.
--
-- claim_outcome says how the latest leased claim ended, so that completing,
-- failing or releasing a claim is idempotent: a retried Complete whose first
-- attempt committed but whose reply was lost (a killed connection) finds the
-- row no longer running, and tells "already completed under my token"
-- (success) from "another claim took the job over" (claim lost): the token of
-- the latest claim stays on the row, and claim_outcome says how that claim
-- ended. It is NULL while a claim runs and for jobs never claimed; claiming a
-- job again resets it to NULL together with the new token. In-transaction
-- claims (ClaimJobsTx, CompleteJobTx, FailJobTx) do not write it: they hold no
-- token.
--
-- The payload is at most 1 MiB in its text form, checked by the server (see
-- pgfence.locks for how the limits are measured).
CREATE TABLE pgfence.jobs (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue            text        NOT NULL,
    payload          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    priority         smallint    NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL DEFAULT 25,
    state            text        NOT NULL DEFAULT 'available',
    holder           text,
    claim_token      bigint,
    claim_expires_at timestamptz,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    claim_outcome    text,
    claim_key_hash   bytea,
    CONSTRAINT jobs_queue_length CHECK (octet_length(queue) BETWEEN 1 AND 128),
    CONSTRAINT jobs_state_known CHECK (state IN ('available', 'running', 'completed', 'dead')),
    CONSTRAINT jobs_attempts_nonnegative CHECK (attempts >= 0),
    CONSTRAINT jobs_max_attempts_positive CHECK (max_attempts BETWEEN 1 AND 1000000),
    CONSTRAINT jobs_claim_token_positive CHECK (claim_token IS NULL OR claim_token > 0),
    CONSTRAINT jobs_holder_length CHECK (holder IS NULL OR octet_length(holder) BETWEEN 1 AND 512),
    CONSTRAINT jobs_running_has_claim CHECK (
        (state = 'running') = (claim_expires_at IS NOT NULL)
        AND (state <> 'running' OR (claim_token IS NOT NULL AND holder IS NOT NULL))),
    CONSTRAINT jobs_finished_has_time CHECK ((state IN ('completed', 'dead')) = (finished_at IS NOT NULL)),
    CONSTRAINT jobs_payload_size
        CHECK (pg_catalog.octet_length(payload::pg_catalog.text) OPERATOR(pg_catalog.<=) 1048576)
);
-- jobs_claim_outcome_known is NOT VALID, as it is in every database migrated
-- by pgfence's pre-release builds, where it was added to a populated table
-- without a scan: this migration makes exactly that schema
-- (migrations/baseline_test.go compares the two). Every row written is checked
-- all the same; only rows older than the constraint would not be, and this
-- table has none. CREATE TABLE marks its CHECK constraints valid whatever they
-- say, hence the ALTER TABLE.
ALTER TABLE pgfence.jobs ADD CONSTRAINT jobs_claim_outcome_known CHECK (
    claim_outcome IS NULL
    OR (claim_outcome IN ('completed', 'failed', 'released', 'expired') AND state <> 'running')) NOT VALID;

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
COMMENT ON COLUMN pgfence.jobs.holder IS
  'Holder identity of the latest leased claim (kept after the claim ends, for operators).';
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
COMMENT ON COLUMN pgfence.jobs.claim_outcome IS
  'How the latest leased claim (claim_token) ended: completed (Complete), failed (Fail: available for a retry, '
  'or dead), released (Release), expired (its claim ran out on the last attempt and the job went dead). NULL while '
  'the claim runs and before the first claim. A retried Complete, '
  'Fail or Release under the same token that finds its own outcome here succeeds instead of reporting a lost claim.';
COMMENT ON COLUMN pgfence.jobs.claim_key_hash IS
  'sha256 of the claim key of the latest leased claim, a secret of the claimer: renewing, completing, failing and '
  'releasing the claim must present the key. NULL for jobs never claimed with a lease.';
COMMENT ON CONSTRAINT jobs_payload_size ON pgfence.jobs IS
  'A job payload is at most 1 MiB in its text form (skiplocked refuses larger ones before sending them).';

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

-- Dead-job counters for `pgfence exporter`, so that it never has to count
-- finished rows of pgfence.jobs. Unfinished jobs (available, running) are
-- counted from the partial indexes above, whose size is the backlog, not the
-- history. Finished rows are kept until the application deletes them, so
-- counting them would make every scrape read the whole history, and a gauge of
-- them goes down when old rows are pruned (a false "increase" for alert rules).
-- Instead, a row trigger (pgfence.jobs_count_dead, below) adds one to
-- pgfence.job_dead_counts each time a job goes dead: a counter that never goes
-- down, whatever is deleted from pgfence.jobs.
--
-- Completed jobs are not counted here: completing is the hot path of every
-- worker, and a counter row per queue would make concurrent completions of a
-- queue wait for each other's commit. Going dead is rare (a job that failed its
-- last attempt), so its counter costs nothing in normal operation. Completion
-- rates come from the workers' own metrics (pgfence_rows_completed_total).
CREATE TABLE pgfence.job_dead_counts (
    queue      text        PRIMARY KEY,
    dead       bigint      NOT NULL DEFAULT 0,
    first_at   timestamptz NOT NULL DEFAULT pg_catalog.now(),
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    CONSTRAINT job_dead_counts_dead_nonnegative CHECK (dead >= 0)
);
COMMENT ON TABLE pgfence.job_dead_counts IS
  'Jobs that went dead, per queue, counted by trigger (jobs_count_dead) since the schema was created. '
  'Never decremented: deleting finished jobs does not lower it. Read by pgfence exporter '
  '(pgfence_jobs_dead_total); the application role needs no grant on it.';
COMMENT ON COLUMN pgfence.job_dead_counts.queue IS
  'Queue name, as in pgfence.jobs.queue.';
COMMENT ON COLUMN pgfence.job_dead_counts.dead IS
  'Number of times a job of this queue went to state dead (a job revived by hand and dead again counts twice).';
COMMENT ON COLUMN pgfence.job_dead_counts.first_at IS
  'Database time at which this queue''s first counted job went dead.';
COMMENT ON COLUMN pgfence.job_dead_counts.updated_at IS
  'Database time of the latest job of this queue that went dead.';
COMMENT ON INDEX pgfence.job_dead_counts_pkey IS
  'One counter row per queue.';

-- pgfence.outbox: fenced side-effect intents (an email, a payment, an HTTP
-- call), recorded in the holder's own transaction and delivered at least once
-- by a dispatcher with an idempotency key. See the outbox package.
--
-- An intent names the lock and token that authorised it. It is recorded only
-- while that token is the latest grant of the lock, the rule of the guard: a
-- superseded holder is refused with SQLSTATE PF003 (stale token, through
-- pgfence.fence_refused, so its DETAIL reads "token N, fence M, table
-- pgfence.outbox, key K" with M the lock's latest token), a token the lock
-- never issued (or no such lock) with PF002. The check runs twice:
--   at the insert, without locking, so a stale holder learns it at once;
--   at COMMIT (a deferred constraint trigger), with the lock row locked FOR
--   SHARE until the commit ends, so a grant cannot commit between the check
--   and the commit. The lock is taken at COMMIT only: a holder paused between
--   its insert and its COMMIT does not hold back the next grant, and its
--   COMMIT is then refused.
-- Every insert and every change of lock_name or token is checked, whether it
-- comes from pgfence.outbox_enqueue() or from plain SQL. Applications record
-- intents only through pgfence.outbox_enqueue(), which also requires the
-- lease's key (their role has no INSERT on this table): a token is public, the
-- key is a secret of the holder.
--
-- Each intent is delivered through one row of pgfence.jobs on queue
-- 'outbox:' || topic; the intent's id is that job's id. There is no foreign
-- key: pruning (or truncating) pgfence.jobs keeps working, and an intent
-- outlives its delivery job, so its idempotency key stays taken until the
-- application deletes the intent.
--
-- Idempotency keys are unique per lock, not across every lock: otherwise the
-- holder of any lock could record an intent under a key another lock's holder
-- was about to use, and the later enqueue would get the first intent back as
-- its duplicate (the other lock's intent delivered in its place). A receiver
-- that deduplicates across locks must use the lock name and the key together
-- (the Intent carries both). The payload is at most 1 MiB in its text form (see
-- pgfence.locks for how the limits are measured).
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
    CONSTRAINT outbox_key_unique UNIQUE (lock_name, idempotency_key),
    CONSTRAINT outbox_payload_size
        CHECK (pg_catalog.octet_length(payload::pg_catalog.text) OPERATOR(pg_catalog.<=) 1048576)
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
  'Idempotency key, unique per lock (lock_name): 1..255 visible ASCII characters. A second intent of the lock with '
  'the same key is not recorded (the first wins). Sent to the receiver, which deduplicates by it.';
COMMENT ON COLUMN pgfence.outbox.lock_name IS
  'Lock whose grant authorised the intent (pgfence.locks.name).';
COMMENT ON COLUMN pgfence.outbox.token IS
  'Fencing token of that grant: the lock''s latest token when the intent committed.';
COMMENT ON COLUMN pgfence.outbox.payload IS
  'What to send, as JSON, opaque to pgfence.';
COMMENT ON COLUMN pgfence.outbox.created_at IS
  'Database time of the insert.';
COMMENT ON CONSTRAINT outbox_key_unique ON pgfence.outbox IS
  'One intent per idempotency key and lock: the holders of other locks cannot take a lock''s keys.';
COMMENT ON CONSTRAINT outbox_payload_size ON pgfence.outbox IS
  'An intent payload is at most 1 MiB in its text form (outbox refuses larger ones before sending them).';
COMMENT ON INDEX pgfence.outbox_pkey IS
  'Primary key; dispatchers read an intent by the id of the job they claimed.';

-- pgfence.ha_epoch and pgfence.ha_bumps: the epoch of a cluster that fails
-- over to asynchronous standbys (docs/ha.md). Empty, and unused, until the
-- owner runs SELECT pgfence.ha_enable(). A promoted standby has only the WAL it
-- received: grants the old primary acknowledged last can be missing, and the
-- new primary would issue those tokens again. pgfence.ha_bump(), run on
-- promotion (a Patroni on_role_change callback), raises every token and the
-- claim token sequence by 2^32, above anything the old primary can have
-- issued; until it has run on the server's timeline, the gate triggers refuse
-- every grant and claim.
CREATE TABLE pgfence.ha_epoch (
    one       boolean PRIMARY KEY DEFAULT true CHECK (one),
    timeline  integer NOT NULL,
    bumps     integer NOT NULL DEFAULT 0,
    bumped_at timestamptz
);

COMMENT ON TABLE pgfence.ha_epoch IS
  'The timeline whose grants are allowed (one row once pgfence.ha_enable() ran; none otherwise) and how many epoch '
  'bumps were made. Written only by pgfence.ha_enable() and pgfence.ha_bump().';
COMMENT ON COLUMN pgfence.ha_epoch.timeline IS
  'The server timeline the latest bump (or ha_enable) ran on; grants and claims are refused on any other.';
COMMENT ON COLUMN pgfence.ha_epoch.bumps IS
  'Epoch bumps made so far (one per promotion): tokens issued since are at least bumps * 2^32.';

CREATE TABLE pgfence.ha_bumps (
    timeline     integer     NOT NULL,
    bumped_at    timestamptz NOT NULL,
    name         text        NOT NULL,
    token_before bigint      NOT NULL,
    PRIMARY KEY (timeline, name)
);

COMMENT ON TABLE pgfence.ha_bumps IS
  'Every lock''s token on the new primary just before each epoch bump: compare with the tokens your clients were '
  'granted to see what the promotion lost.';

-- Functions: leases and the lock queue ----------------------------------------

-- The lease door. Every change of pgfence.locks and pgfence.lock_queue is one
-- of these functions: pglock calls them, and so can a client in any language.
-- Each is SECURITY DEFINER (it runs as the owner of the tables, the role that
-- ran the migrations), has search_path pinned to pg_catalog, pg_temp, checks
-- every argument itself and is executable only by the roles granted EXECUTE
-- (docs/migrations.md). The caller needs no privilege on the tables.
--
-- The lease key. A grant stores sha256(key) (locks.key_hash), never the key:
-- renewing or releasing a lease takes its name, its token and the key. The
-- token is public (it is in every fenced row and in pgfence.lock_status); the
-- key is a secret of the holder, drawn at random (pglock: 16 bytes per Locker
-- from crypto/rand), 16 to 64 bytes. A session that can read the lock row but
-- does not know the key cannot renew, release or take over the lease, and a
-- hash read from the table is no key. The holder is a label for operators: it
-- authenticates nothing.
--
-- Arguments are checked before anything is read or written; a bad one raises
-- SQLSTATE PF011 with the argument's name and the rule in the message, and
-- changes nothing: name and holder 1..512 bytes, ttl_us 1000..86400000000
-- (1 ms to 24 hours, pglock.MinTTL..MaxTTL), token > 0, key 16..64 bytes, no
-- NULLs.
--
-- Durability. A statement that grants a lease (a first grant, a grant of a free
-- or expired lease, a handoff) or renews one sets synchronous_commit on for its
-- transaction: a grant acknowledged to the client survives a crash, so its
-- token is never issued twice. A release that grants nothing, and a queue row
-- or wait mark, commit without waiting for the flush (off): lost in a crash, a
-- release only keeps the lock until its expiry (the token is not re-issued),
-- and a waiter writes its row again. The setting is local to the transaction:
-- set_config(..., true) inside these functions lasts to the end of the caller's
-- transaction (a function's SET clause restores only the settings it names).

-- pgfence.lock_grant grants the lease name to holder for ttl_us microseconds
-- (database clock) if it is free, expired or has no row yet: token + 1 (1 for
-- a new name), key_hash = sha256(key). Granted: token and expires_at are set,
-- held_by is NULL. Held by someone else: token is NULL, held_by and expires_at
-- say by whom and until when. All three NULL: the lease changed under the call
-- (released or expired between its statements): call again. At the bigint
-- maximum it fails with SQLSTATE 22003 and changes nothing.
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_grant(name text, holder text, ttl_us bigint, key bytea,
    OUT token bigint, OUT expires_at timestamptz, OUT held_by text, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_grant.name IS NULL OR octet_length(lock_grant.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.holder IS NULL OR octet_length(lock_grant.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_grant.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.ttl_us IS NULL OR lock_grant.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_grant.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_grant.key IS NULL OR octet_length(lock_grant.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_grant: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_grant.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    UPDATE pgfence.locks AS l
    SET token = l.token + 1, holder = lock_grant.holder, key_hash = sha256(lock_grant.key),
        acquired_at = now(), renewed_at = NULL,
        expires_at = now() + lock_grant.ttl_us * interval '1 microsecond'
    WHERE l.name = lock_grant.name AND (l.holder IS NULL OR l.expires_at <= now())
    RETURNING l.token, l.expires_at INTO lock_grant.token, lock_grant.expires_at;
    IF NOT FOUND THEN
        SELECT l.holder, l.expires_at INTO lock_grant.held_by, lock_grant.expires_at
        FROM pgfence.locks AS l WHERE l.name = lock_grant.name;
        IF FOUND THEN
            IF lock_grant.held_by IS NULL OR lock_grant.expires_at <= now() THEN
                lock_grant.held_by := NULL;  -- released or expired since the UPDATE: call again
                lock_grant.expires_at := NULL;
            END IF;
            RETURN;
        END IF;
        -- No row yet: the first grant of the name.
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        VALUES (lock_grant.name, 1, lock_grant.holder, sha256(lock_grant.key), now(), NULL,
                now() + lock_grant.ttl_us * interval '1 microsecond')
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at INTO lock_grant.token, lock_grant.expires_at;
        IF NOT FOUND THEN
            RETURN;  -- a concurrent first grant: call again
        END IF;
    END IF;
    PERFORM set_config('synchronous_commit', 'on', true);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_grant(text, text, bigint, bytea) IS
  'Grants the lease name to holder for ttl_us microseconds if it is free, expired or new: token + 1, the key''s '
  'sha256 stored. Returns token and expires_at when granted; token NULL and held_by, expires_at of the holder when '
  'held; all NULL when the lease changed during the call (call again). Bad arguments: PF011. Durable when granted.';

-- pgfence.lock_renew extends the lease (name, token) held with key to ttl_us
-- microseconds from now (database clock). expires_at NULL: the lease is lost
-- (expired, released, granted again, or the key is not its key); nothing
-- changed.
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_renew(name text, token bigint, key bytea, ttl_us bigint,
    OUT expires_at timestamptz, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_renew.name IS NULL OR octet_length(lock_renew.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_renew.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.token IS NULL OR lock_renew.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: token must be > 0, got %',
            coalesce(lock_renew.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.key IS NULL OR octet_length(lock_renew.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_renew.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_renew.ttl_us IS NULL OR lock_renew.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_renew: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_renew.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    UPDATE pgfence.locks AS l
    SET expires_at = now() + lock_renew.ttl_us * interval '1 microsecond', renewed_at = now()
    WHERE l.name = lock_renew.name AND l.token = lock_renew.token
      AND l.key_hash = sha256(lock_renew.key) AND l.expires_at > now()
    RETURNING l.expires_at INTO lock_renew.expires_at;
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_renew(text, bigint, bytea, bigint) IS
  'Extends the lease (name, token) held with key to ttl_us microseconds from now. expires_at NULL: the lease is lost '
  '(expired, released, granted again, or not this key); nothing changed. Bad arguments: PF011. Durable.';

-- pgfence.lock_release ends the lease (name, token) held with key. released
-- false: the lease is lost; nothing changed. If a live waiter is queued for the
-- name (pgfence.lock_queue), the lease is handed to the first one in the same
-- call (token + 1, expiry now() + its TTL, its key's hash, durable;
-- handed_off) and pgfence_lock_handoff is notified with its wkey, the wait_id
-- of its wait, the new token and the new expiry in microseconds since the Unix
-- epoch (payload "wkey wait_id token expiry_us"); otherwise holder, key_hash and
-- expiry become NULL (the token stays) and, if a waiter marked the row in the
-- last 100 seconds, pgfence_lock_released is notified with the name
-- (notified). Rows of the name whose alive_until has passed are deleted: dead
-- waiters, and ended waits (kept 10 seconds for their Locker's next wait).
--
-- Most locks have nobody waiting: the first statement is one plain UPDATE,
-- which ends the lease only if no waiter is queued for the name (no queue row
-- still waiting, none past its alive_until) and no waiter marked the row in the
-- last 100 seconds; the full release would then hand nothing over, delete no
-- queue row and notify nobody. A waiter whose queue row or mark is not
-- committed yet either conflicts on the lock row (its mark) or sees the release
-- and tries again.
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_release(name text, token bigint, key bytea,
    OUT released boolean, OUT handed_off boolean, OUT notified boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kh bytea;
BEGIN
    IF lock_release.name IS NULL OR octet_length(lock_release.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_release: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_release.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release.token IS NULL OR lock_release.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.lock_release: token must be > 0, got %',
            coalesce(lock_release.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_release.key IS NULL OR octet_length(lock_release.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_release: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_release.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_release.key);
    released := false;
    handed_off := false;
    notified := false;
    UPDATE pgfence.locks AS l
    SET holder = NULL, key_hash = NULL, renewed_at = NULL, expires_at = NULL
    WHERE l.name = lock_release.name AND l.token = lock_release.token
      AND l.key_hash = kh AND l.expires_at > now()
      AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '100 seconds')
      AND NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS q
                      WHERE q.name = lock_release.name
                        AND (q.granted_token IS NULL OR q.alive_until <= now()));
    IF FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        released := true;
        RETURN;
    END IF;
    WITH nxt AS (
        SELECT q.ticket, q.wkey, q.wait_id, q.holder, q.ttl_us, q.key_hash
        FROM pgfence.lock_queue AS q
        WHERE q.name = lock_release.name AND q.granted_token IS NULL AND q.alive_until > now()
        ORDER BY q.ticket
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    ), sc AS (
        -- A handoff is a grant: durable. A plain release is not.
        SELECT set_config('synchronous_commit',
                          CASE WHEN EXISTS (SELECT 1 FROM nxt) THEN 'on' ELSE 'off' END, true) AS sync
    ), rel AS (
        UPDATE pgfence.locks AS l
        SET token       = l.token + CASE WHEN n.ticket IS NULL THEN 0 ELSE 1 END,
            holder      = n.holder,
            key_hash    = n.key_hash,
            acquired_at = CASE WHEN n.ticket IS NULL THEN l.acquired_at ELSE now() END,
            renewed_at  = NULL,
            expires_at  = now() + n.ttl_us * interval '1 microsecond'
        FROM sc LEFT JOIN nxt AS n ON true
        WHERE l.name = lock_release.name AND l.token = lock_release.token
          AND l.key_hash = kh AND l.expires_at > now()
        RETURNING n.ticket, n.wkey, n.wait_id, l.token, l.name, l.waiting_since, l.expires_at
    ), handed AS (
        -- The wait is over: the row stays for its Locker's next wait of the
        -- name for 10 seconds, then the next release deletes it (gc). Only a
        -- release of this lease (by the waiter) can run gc before it expires,
        -- so the row is there for the waiter to read its lease.
        UPDATE pgfence.lock_queue AS q
        SET granted_token = rel.token,
            alive_until   = now() + interval '10 seconds'
        FROM rel
        WHERE q.wkey = rel.wkey AND q.ticket = rel.ticket
        RETURNING q.ticket
    ), gc AS (
        DELETE FROM pgfence.lock_queue AS q
        USING rel
        WHERE q.name = rel.name AND q.alive_until <= now()
        RETURNING q.ticket
    )
    SELECT true,
           rel.ticket IS NOT NULL,
           (CASE WHEN rel.ticket IS NOT NULL
                     THEN pg_notify('pgfence_lock_handoff',
                                    rel.wkey || ' ' || rel.wait_id || ' ' || rel.token || ' '
                                    || (extract(epoch FROM rel.expires_at) * 1000000)::bigint)::text
                 WHEN rel.waiting_since > now() - interval '100 seconds'
                     THEN pg_notify('pgfence_lock_released', rel.name)::text END) IS NOT NULL
    INTO released, handed_off, notified
    FROM rel;
    IF NOT FOUND THEN
        released := false;
        handed_off := false;
        notified := false;
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_release(text, bigint, bytea) IS
  'Ends the lease (name, token) held with key; released false: the lease is lost, nothing changed. Hands the lease '
  'to the first live waiter of pgfence.lock_queue if there is one (handed_off, NOTIFY pgfence_lock_handoff, durable), '
  'else frees it (token kept) and notifies pgfence_lock_released if a waiter marked it (notified). Bad arguments: PF011.';

-- pgfence.lock_wait is a waiter's attempt (pglock's LISTEN mode): it grants a
-- free, expired or new lease exactly as lock_grant does and ends the waiter's
-- wait (granted_token 0: no release serves the row again); returns a lease a
-- release handed to this wait (wkey, wait_id) with this key; or, the lease
-- being held by someone else, queues the wait (or, once half its TTL is gone,
-- pushes its alive_until to now() + its TTL), marks the lock row for wake-up
-- (waiting_since, at most every 30 seconds) and returns granted = false with
-- the holder and its expiry. wkey is a random number the waiter listens for
-- (channel pgfence_lock_handoff) and reuses for its next wait of the name;
-- wait_id is random per wait. A row of wkey left by an ended wait is reused
-- with a new ticket (an update in place), but only by the key whose hash it
-- holds. Granted NULL: the lease changed under the call: call again at once.
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_wait(name text, holder text, ttl_us bigint, key bytea, wkey bigint, wait_id bigint,
    OUT granted boolean, OUT token bigint, OUT expires_at timestamptz, OUT held_by text, OUT db_now timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kh bytea;
BEGIN
    IF lock_wait.name IS NULL OR octet_length(lock_wait.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_wait.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.holder IS NULL OR octet_length(lock_wait.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(lock_wait.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.ttl_us IS NULL OR lock_wait.ttl_us NOT BETWEEN 1000 AND 86400000000 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: ttl_us must be 1000 to 86400000000 (1 ms to 24 hours), got %',
            coalesce(lock_wait.ttl_us::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.key IS NULL OR octet_length(lock_wait.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_wait: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_wait.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_wait.wkey IS NULL OR lock_wait.wait_id IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_wait: wkey and wait_id must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(lock_wait.key);
    WITH handed AS (
        SELECT l.token, l.expires_at
        FROM pgfence.lock_queue AS q
        JOIN pgfence.locks AS l ON l.name = q.name AND l.token = q.granted_token AND l.key_hash = q.key_hash
        WHERE q.wkey = lock_wait.wkey AND q.wait_id = lock_wait.wait_id AND q.key_hash = kh
          AND l.expires_at > now()
    ), upd AS (
        UPDATE pgfence.locks AS l
        SET token       = l.token + 1,
            holder      = lock_wait.holder,
            key_hash    = kh,
            acquired_at = now(),
            renewed_at  = NULL,
            expires_at  = now() + lock_wait.ttl_us * interval '1 microsecond'
        WHERE l.name = lock_wait.name AND (l.holder IS NULL OR l.expires_at <= now())
          AND NOT EXISTS (SELECT 1 FROM handed)
        RETURNING l.token, l.expires_at
    ), ins AS (
        INSERT INTO pgfence.locks AS l (name, token, holder, key_hash, acquired_at, renewed_at, expires_at)
        SELECT lock_wait.name, 1, lock_wait.holder, kh, now(), NULL,
               now() + lock_wait.ttl_us * interval '1 microsecond'
        WHERE NOT EXISTS (SELECT 1 FROM pgfence.locks AS e WHERE e.name = lock_wait.name)
        ON CONFLICT ON CONSTRAINT locks_pkey DO NOTHING
        RETURNING l.token, l.expires_at
    ), cur AS (
        SELECT l.holder, l.expires_at, l.waiting_since
        FROM pgfence.locks AS l
        WHERE l.name = lock_wait.name AND l.holder IS NOT NULL AND l.expires_at > now()
          AND NOT EXISTS (SELECT 1 FROM handed)
    ), m AS (
        UPDATE pgfence.locks AS l
        SET waiting_since = now()
        WHERE l.name = lock_wait.name AND l.holder IS NOT NULL AND l.expires_at > now()
          AND (l.waiting_since IS NULL OR l.waiting_since <= now() - interval '30 seconds')
          AND NOT EXISTS (SELECT 1 FROM handed)
        RETURNING l.holder, l.expires_at
    ), enq AS (
        -- Unless this wait is queued already: a new wait, or this wait's row
        -- is gone (deleted as dead) or was handed a lease that has ended
        -- since. Queue with a new ticket, reusing the row of wkey if it holds
        -- this key's hash.
        INSERT INTO pgfence.lock_queue AS q (wkey, wait_id, name, holder, key_hash, ttl_us, alive_until)
        SELECT lock_wait.wkey, lock_wait.wait_id, lock_wait.name, lock_wait.holder, kh,
               lock_wait.ttl_us, now() + lock_wait.ttl_us * interval '1 microsecond'
        FROM cur
        WHERE NOT EXISTS (SELECT 1 FROM pgfence.lock_queue AS e
                          WHERE e.wkey = lock_wait.wkey AND e.wait_id = lock_wait.wait_id
                            AND e.granted_token IS NULL)
        ON CONFLICT ON CONSTRAINT lock_queue_pkey DO UPDATE
        SET ticket        = DEFAULT,
            wait_id       = EXCLUDED.wait_id,
            name          = EXCLUDED.name,
            holder        = EXCLUDED.holder,
            ttl_us        = EXCLUDED.ttl_us,
            alive_until   = EXCLUDED.alive_until,
            granted_token = NULL
        WHERE q.key_hash = EXCLUDED.key_hash
        RETURNING q.ticket
    ), refresh AS (
        -- Only once half of the waiter's TTL is gone: a row locked by a
        -- refresh is skipped by a concurrent release.
        UPDATE pgfence.lock_queue AS q
        SET alive_until = now() + lock_wait.ttl_us * interval '1 microsecond'
        FROM cur
        WHERE q.wkey = lock_wait.wkey AND q.wait_id = lock_wait.wait_id AND q.key_hash = kh
          AND q.name = lock_wait.name AND q.granted_token IS NULL
          AND q.alive_until < now() + (lock_wait.ttl_us / 2) * interval '1 microsecond'
        RETURNING q.ticket
    ), end_own AS (
        -- Granted here: this wait is over, no release may serve its row; it
        -- stays for the Locker's next wait for 10 seconds, as after a handoff.
        UPDATE pgfence.lock_queue AS q
        SET granted_token = 0,
            alive_until   = now() + interval '10 seconds'
        WHERE q.wkey = lock_wait.wkey AND q.key_hash = kh AND q.granted_token IS NULL
          AND EXISTS (SELECT 1 FROM upd UNION ALL SELECT 1 FROM ins)
        RETURNING q.ticket
    ), dur AS (
        -- Read at commit: only a grant must survive a crash (on); a queue row
        -- or wait mark lost with the server is written again by the waiter
        -- when its listener reconnects (off). It reads upd and ins, so it runs
        -- after them.
        SELECT set_config('synchronous_commit',
                          CASE WHEN EXISTS (SELECT 1 FROM upd) OR EXISTS (SELECT 1 FROM ins) THEN 'on' ELSE 'off' END,
                          true) AS sync
    )
    SELECT r.granted, r.token, r.expires_at, r.holder, now()
    INTO lock_wait.granted, lock_wait.token, lock_wait.expires_at, lock_wait.held_by, lock_wait.db_now
    FROM (
        SELECT true AS granted, handed.token, handed.expires_at, NULL::text AS holder FROM handed
        UNION ALL
        SELECT true, upd.token, upd.expires_at, NULL::text FROM upd
        UNION ALL
        SELECT true, ins.token, ins.expires_at, NULL::text FROM ins
        UNION ALL
        SELECT false, NULL::bigint, COALESCE(m.expires_at, cur.expires_at), COALESCE(m.holder, cur.holder)
        FROM cur LEFT JOIN m ON true
        WHERE m.holder IS NOT NULL OR cur.waiting_since > now() - interval '30 seconds'
    ) AS r CROSS JOIN dur;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_wait(text, text, bigint, bytea, bigint, bigint) IS
  'A waiter''s attempt: grants a free, expired or new lease as lock_grant does, returns a lease a release handed to '
  'the wait (wkey, wait_id) with this key, or queues the wait in pgfence.lock_queue and returns granted = false '
  'with the holder and its expiry. granted NULL: call again. Bad arguments: PF011.';

-- pgfence.lock_handed returns the lease a release handed to the wait (wkey,
-- wait_id) queued with key, if it is still held: token, expiry, database time.
-- All NULL: nothing was handed (or it already expired). Reads only. A handoff
-- notification only wakes a waiter: anyone may send one; this says what the
-- database holds.
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_handed(wkey bigint, wait_id bigint, key bytea,
    OUT token bigint, OUT expires_at timestamptz, OUT db_now timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_handed.key IS NULL OR octet_length(lock_handed.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_handed: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_handed.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    db_now := now();
    SELECT l.token, l.expires_at INTO lock_handed.token, lock_handed.expires_at
    FROM pgfence.lock_queue AS q
    JOIN pgfence.locks AS l ON l.name = q.name AND l.token = q.granted_token AND l.key_hash = q.key_hash
    WHERE q.wkey = lock_handed.wkey AND q.wait_id = lock_handed.wait_id
      AND q.key_hash = sha256(lock_handed.key) AND l.expires_at > now();
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_handed(bigint, bigint, bytea) IS
  'The lease a release handed to the wait (wkey, wait_id) queued with key, if still held (token, expires_at, db_now); '
  'all NULL otherwise. Reads only.';

-- pgfence.lock_leave takes the waiter wkey, queued with key, out of the queue
-- and returns the token of a lease a release handed to its wait wait_id
-- meanwhile (0 if none, or if the row holds another wait's grant): the caller
-- releases that lease. removed false: no row of wkey with this key (never queued,
-- or already deleted). A concurrent release that picked this row finishes
-- first (the row is locked), so its handoff is seen here.
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_leave(wkey bigint, wait_id bigint, key bytea,
    OUT removed boolean, OUT granted_token bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_leave.key IS NULL OR octet_length(lock_leave.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_leave: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_leave.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.lock_queue AS q
    WHERE q.wkey = lock_leave.wkey AND q.key_hash = sha256(lock_leave.key)
    RETURNING CASE WHEN q.wait_id = lock_leave.wait_id THEN COALESCE(q.granted_token, 0) ELSE 0 END
    INTO lock_leave.granted_token;
    lock_leave.removed := FOUND;
    lock_leave.granted_token := COALESCE(lock_leave.granted_token, 0);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_leave(bigint, bigint, bytea) IS
  'Takes the waiter wkey queued with key out of pgfence.lock_queue; granted_token is a lease handed to its wait '
  'wait_id meanwhile (0 if none), which the caller releases. removed false: no such row.';

-- Functions: fenced writes and the guard --------------------------------------

-- +goose StatementBegin
CREATE FUNCTION pgfence.use_token(token bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF token IS NULL OR token <= 0 THEN
        RAISE EXCEPTION 'pgfence: invalid fencing token %: must be > 0', coalesce(token::text, 'NULL')
            USING ERRCODE = 'PF007', DETAIL = format('token %s', coalesce(token::text, 'NULL'));
    END IF;
    PERFORM pg_catalog.set_config('pgfence.token', token::text, true);
    RETURN token;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.use_token(bigint) IS
  'Name the fencing token the current transaction acts under (transaction-local setting pgfence.token). The guard '
  'reads it to allow a DELETE; generated FencedDelete statements call it themselves. Returns the token.';

-- The statements pgfence generates for fenced writes fail closed: when their
-- write changed no row they call this, so a refused write is never a success.
-- +goose StatementBegin
CREATE FUNCTION pgfence.fence_refused(
    table_name text,
    key        text,
    mode       text,
    token      bigint,
    fence      bigint,
    row_found  boolean
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    detail text := format('token %s, fence %s, table %s, key %s',
                          coalesce(token::text, 'NULL'), coalesce(fence::text, 'NULL'), table_name, key);
BEGIN
    IF token IS NULL OR token <= 0 THEN
        RAISE EXCEPTION 'pgfence: write to % refused: invalid token %', table_name, coalesce(token::text, 'NULL')
            USING ERRCODE = 'PF007', DETAIL = detail;
    ELSIF NOT row_found THEN
        RAISE EXCEPTION 'pgfence: write to % refused: no row with key %', table_name, key
            USING ERRCODE = 'PF005', DETAIL = detail;
    ELSIF fence > token THEN
        RAISE EXCEPTION 'pgfence: write to % refused: stale token % (the row''s fence is %: a newer grant wrote it)',
                table_name, token, fence
            USING ERRCODE = 'PF003', DETAIL = detail;
    ELSIF fence = token AND mode = 'strict' THEN
        RAISE EXCEPTION 'pgfence: write to % refused: already applied (this grant, token %, wrote the row)',
                table_name, token
            USING ERRCODE = 'PF004', DETAIL = detail;
    END IF;
    RAISE EXCEPTION 'pgfence: write to % refused: the row changed concurrently; the write was not applied', table_name
        USING ERRCODE = 'PF006', DETAIL = detail;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.fence_refused(text, text, text, bigint, bigint, boolean) IS
  'Raises the error of a refused fenced statement (SQLSTATE PF003 stale token, PF004 already applied, PF005 no '
  'such row, PF006 concurrent change, PF007 invalid token) with token, fence, table and key in DETAIL. Called by '
  'the statements pgfence generates when their write changed no row, so a refused write is never a success.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.unguard(tbl regclass) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    fn text;
    had_trigger boolean;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'pgfence.unguard: table must not be NULL' USING ERRCODE = '22004';
    END IF;
    had_trigger := false;
    FOR fn IN SELECT tgname FROM pg_trigger
              WHERE tgrelid = tbl AND tgname IN ('pgfence_guard_a_mark', 'pgfence_guard_b_check')
    LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', fn, tbl);
        had_trigger := true;
    END LOOP;
    fn := NULL;
    DELETE FROM pgfence.guarded_tables WHERE relid = tbl RETURNING trigger_function INTO fn;
    IF fn IS NOT NULL THEN
        EXECUTE format('DROP FUNCTION IF EXISTS pgfence.%I()', fn);
        had_trigger := true;
    END IF;
    -- Housekeeping: forget tables that were dropped while guarded.
    FOR fn IN DELETE FROM pgfence.guarded_tables g
              WHERE NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = g.relid)
              RETURNING trigger_function
    LOOP
        EXECUTE format('DROP FUNCTION IF EXISTS pgfence.%I()', fn);
    END LOOP;
    RETURN had_trigger;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.unguard(regclass) IS
  'Detach the pgfence guard from a table: drops its triggers and generated function and its pgfence.guarded_tables '
  'row. Returns true if a guard was attached. Safe to call on an unguarded table.';

-- The guard. pgfence.guard() (below) checks the lock source and calls
-- pgfence.attach_guard(), which writes one trigger function per guarded table
-- (pgfence.guard_<table oid>, search_path pinned) with the column names and
-- the lock source compiled in, and attaches it as BEFORE row triggers, so a
-- guarded change pays for one plpgsql call and one primary-key lookup in
-- pgfence.locks. It checks every change to a guarded table:
--   INSERT  the new row's fence must be the latest token of its lock (a row
--           inserted without a token, with a forged token or by a superseded
--           holder is refused);
--   UPDATE  the fence must go up (strict), or stay equal when the UPDATE
--           assigns it (reentrant), and the new fence must be the latest token
--           of the row's lock;
--   DELETE  the deleting transaction must have named its token with
--           pgfence.use_token(token) (the generated FencedDelete statements
--           do it in the same statement); the token must be the latest of
--           the row's lock and not below the row's fence.
-- The governing lock comes from a fixed name, a column (plain or GENERATED
-- ... STORED: the trigger computes a generated column from the row, because a
-- BEFORE trigger sees it as NULL) or an SQL expression over the row's columns.
-- Refusals are SQLSTATE PF001, PF002 and PF008 (see the top of this file), with
-- the row's primary key in DETAIL.
-- +goose StatementBegin
CREATE FUNCTION pgfence.attach_guard(
    tbl                  regclass,
    lock_name            text DEFAULT NULL,
    lock_name_column     text DEFAULT NULL,
    fence_column         text DEFAULT 'fence',
    mode                 text DEFAULT 'strict',
    lock_name_expression text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kind       "char";
    col_type   regtype;
    generated  "char";
    fn_name    text;
    lock_src   text;  -- an expression over the table's columns
    new_src    text;  -- the lock name of NEW / OLD in the trigger: a subquery or a literal
    old_src    text;
    new_key    text;  -- the row's primary key as JSON text, from NEW / OLD
    old_key    text;
    assigned   text;
    body       text;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'pgfence.guard: table must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF num_nonnulls(lock_name, lock_name_column, lock_name_expression) <> 1 THEN
        RAISE EXCEPTION 'pgfence.guard: pass exactly one of lock_name, lock_name_column and lock_name_expression'
            USING ERRCODE = '22023';
    END IF;
    IF lock_name IS NOT NULL AND octet_length(lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.guard: lock_name must be 1..512 bytes' USING ERRCODE = '22023';
    END IF;
    IF mode IS NULL OR mode NOT IN ('strict', 'reentrant') THEN
        RAISE EXCEPTION 'pgfence.guard: mode must be ''strict'' or ''reentrant'', not %', quote_nullable(mode)
            USING ERRCODE = '22023';
    END IF;
    SELECT relkind INTO kind FROM pg_class WHERE oid = tbl;
    IF kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION 'pgfence.guard: % is not a table', tbl USING ERRCODE = '42809';
    END IF;
    SELECT atttypid::regtype INTO col_type FROM pg_attribute
     WHERE attrelid = tbl AND attname = fence_column AND attnum > 0 AND NOT attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(fence_column)
            USING ERRCODE = '42703',
                  HINT = 'Add it first: ALTER TABLE ... ADD COLUMN fence bigint NOT NULL DEFAULT 0';
    END IF;
    IF col_type <> 'bigint'::regtype THEN
        RAISE EXCEPTION 'pgfence.guard: column %.% is %, want bigint', tbl, quote_ident(fence_column), col_type
            USING ERRCODE = '42804';
    END IF;
    IF lock_name_column IS NOT NULL THEN
        SELECT a.attgenerated INTO generated FROM pg_attribute a
         WHERE a.attrelid = tbl AND a.attname = lock_name_column AND a.attnum > 0 AND NOT a.attisdropped;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(lock_name_column)
                USING ERRCODE = '42703';
        END IF;
        IF generated = 's' THEN
            -- A BEFORE trigger sees a stored generated column as NULL: compute it
            -- from the row with the column's own generation expression.
            SELECT pg_get_expr(d.adbin, d.adrelid) INTO lock_src
              FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
             WHERE d.adrelid = tbl AND a.attname = lock_name_column;
        ELSE
            -- A plain column is read from the row directly (no subquery).
            new_src := format('NEW.%I::text', lock_name_column);
            old_src := format('OLD.%I::text', lock_name_column);
        END IF;
    ELSIF lock_name_expression IS NOT NULL THEN
        IF octet_length(lock_name_expression) NOT BETWEEN 1 AND 4096 THEN
            RAISE EXCEPTION 'pgfence.guard: lock_name_expression must be 1..4096 bytes' USING ERRCODE = '22023';
        END IF;
        lock_src := lock_name_expression;
    END IF;
    IF lock_src IS NOT NULL THEN
        -- Check that the expression compiles against the table's columns (and
        -- is one expression): nothing is read.
        BEGIN
            EXECUTE format('SELECT (%s)::text FROM %s AS pgfence_row LIMIT 0', lock_src, tbl);
        EXCEPTION WHEN OTHERS THEN
            RAISE EXCEPTION 'pgfence.guard: lock name expression % does not work on %: %', lock_src, tbl, SQLERRM
                USING ERRCODE = '22023';
        END;
        new_src := format('(SELECT (%s)::text FROM (SELECT (NEW).*) AS pgfence_row)', lock_src);
        old_src := format('(SELECT (%s)::text FROM (SELECT (OLD).*) AS pgfence_row)', lock_src);
    ELSIF lock_name IS NOT NULL THEN
        new_src := quote_literal(lock_name);
        old_src := new_src;
    END IF;

    -- The row's primary key, for the errors (evaluated only when raising).
    SELECT 'pg_catalog.jsonb_build_object(' || string_agg(quote_literal(a.attname) || ', NEW.' || quote_ident(a.attname),
                                                          ', ' ORDER BY k.ord) || ')::text'
      INTO new_key
      FROM pg_index i
      CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = tbl AND i.indisprimary;
    IF new_key IS NULL THEN
        new_key := quote_literal('(no primary key)');
        old_key := new_key;
    ELSE
        old_key := replace(new_key, ', NEW.', ', OLD.');
    END IF;

    PERFORM pgfence.unguard(tbl);
    fn_name := 'guard_' || tbl::oid;

    -- In reentrant mode an UPDATE may keep the fence equal, but only if it
    -- assigns the fence column: trigger a_mark (BEFORE UPDATE OF fence, fires
    -- first by name) encodes the new fence as -1 - fence and b_check decodes it.
    -- An UPDATE that does not name the fence column arrives unmarked.
    -- (Inside these templates %% is a literal percent for RAISE; %N$ are
    -- substituted by format() here.)
    IF mode = 'reentrant' THEN
        assigned := format($b$
        IF TG_ARGV[0] = 'mark' THEN
            IF NEW.%1$I IS NULL OR NEW.%1$I < 0 THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% must not be NULL or negative',
                        quote_ident(%2$L), TG_TABLE_SCHEMA, TG_TABLE_NAME
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %2$L;
            END IF;
            NEW.%1$I := -1 - NEW.%1$I;
            RETURN NEW;
        END IF;
        IF NEW.%1$I < 0 THEN
            NEW.%1$I := -1 - NEW.%1$I;
            IF NEW.%1$I = pgf_old_fence THEN
                RETURN NEW;
            END IF;
        END IF;$b$, fence_column, fence_column);
    ELSE
        assigned := '';
    END IF;

    -- The lock name of a row: a literal, or lock_src evaluated on NEW / OLD.
    body := format($b$
#variable_conflict use_column
DECLARE
    pgf_issued    bigint;
    pgf_lock      text;
    pgf_token     bigint;
    pgf_old_fence bigint;
BEGIN
    IF TG_OP = 'DELETE' THEN
        pgf_lock := %6$s;
        pgf_token := nullif(current_setting('pgfence.token', true), '')::bigint;
        pgf_old_fence := coalesce(OLD.%1$I, 0);
        IF pgf_token IS NULL THEN
            RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% carries no fencing token', TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op DELETE, key %%s, row fence %%s, token none, lock %%s', %8$s, pgf_old_fence,
                                      coalesce(pgf_lock, 'NULL')),
                      HINT = 'Delete through a fenced statement, or call pgfence.use_token(<token>) earlier in the transaction.';
        END IF;
        IF pgf_old_fence > pgf_token THEN
            RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% with stale token %% (row fence %%)',
                    TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, pgf_old_fence
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op DELETE, key %%s, row fence %%s, token %%s, lock %%s', %8$s, pgf_old_fence,
                                      pgf_token, coalesce(pgf_lock, 'NULL'));
        END IF;
    ELSE
        IF TG_OP = 'INSERT' THEN
            pgf_old_fence := 0;
        ELSE
            pgf_old_fence := coalesce(OLD.%1$I, 0);%2$s
        END IF;
        IF NEW.%1$I IS NULL OR NEW.%1$I <= pgf_old_fence THEN
            IF TG_OP = 'INSERT' OR (NEW.%1$I IS NOT NULL AND NEW.%1$I = pgf_old_fence) THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% does not raise %% (still %%): no fencing token?',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, new fence %%s, mode %%s', TG_OP, %7$s,
                                          pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L),
                          HINT = 'Write through a fenced statement: SET ' || quote_ident(%3$L)
                                 || ' = <token> ... WHERE <key> AND ' || quote_ident(%3$L) || ' < <token>';
            END IF;
            RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% would lower %% from %% to %% (stale token)',
                    TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL')
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op UPDATE, key %%s, row fence %%s, new fence %%s, mode %%s', %7$s,
                                      pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L);
        END IF;
        pgf_lock := %5$s;
        pgf_token := NEW.%1$I;
    END IF;
    SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = pgf_lock;
    IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                coalesce(pgf_issued::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  CASE TG_OP WHEN 'DELETE' THEN %8$s ELSE %7$s END, pgf_old_fence, pgf_token,
                                  coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
    END IF;
    IF pgf_token < pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
            USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  CASE TG_OP WHEN 'DELETE' THEN %8$s ELSE %7$s END, pgf_old_fence, pgf_token,
                                  pgf_lock, pgf_issued),
                  HINT = 'The lease was granted to someone else: stop and re-acquire.';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$b$, fence_column, assigned, fence_column, mode,
      new_src, old_src, new_key, old_key);

    EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
                   fn_name, body);
    -- A trigger function needs no EXECUTE to fire; nobody calls it directly.
    EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name);
    EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name,
                   'pgfence guard for ' || tbl::text || ', generated by pgfence.guard(); dropped by pgfence.unguard().');
    IF mode = 'reentrant' THEN
        EXECUTE format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %I ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                       fence_column, tbl, fn_name, 'mark');
        EXECUTE format('COMMENT ON TRIGGER pgfence_guard_a_mark ON %s IS %L', tbl,
                       'pgfence guard (reentrant): marks UPDATEs that assign the fence column. See pgfence.guarded_tables.');
    END IF;
    EXECUTE format('CREATE TRIGGER pgfence_guard_b_check BEFORE INSERT OR UPDATE OR DELETE ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                   tbl, fn_name, 'check');
    EXECUTE format('COMMENT ON TRIGGER pgfence_guard_b_check ON %s IS %L', tbl,
                   'pgfence guard (' || mode || '): refuses INSERT, UPDATE and DELETE without the latest token of the row''s lock. '
                   'See pgfence.guarded_tables; detach with pgfence.unguard().');
    INSERT INTO pgfence.guarded_tables (relid, fence_column, lock_name, lock_name_column, lock_name_expression, mode, trigger_function)
    VALUES (tbl, fence_column, lock_name, lock_name_column, lock_name_expression, mode, fn_name);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.attach_guard(regclass, text, text, text, text, text) IS
  'The body of pgfence.guard, without its checks of the lock source: call pgfence.guard.';

-- Whoever attaches a guard or reads pgfence.guarded_fences (often a superuser
-- DBA) must not run code the guarded table's owner can define. A lock-name
-- column of another type than text, varchar, char or name (a domain, a type
-- with its own cast) would run the owner's cast; a lock-name expression, or
-- the generation expression of a lock-name column, that calls a function,
-- operator or type outside pg_catalog would run the owner's code, even when
-- only planned (the planner runs an IMMUTABLE function on constants). These
-- two functions say why a lock source is unsafe, without evaluating it.
-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_source_unsafe(tbl regclass, src text) RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    why text;
BEGIN
    -- A temporary view of the expression: creating it parses the expression
    -- and records what it uses in pg_depend, and runs none of it.
    BEGIN
        EXECUTE format('CREATE TEMPORARY VIEW pgfence_lock_source_check AS SELECT (%s)::pg_catalog.text AS l FROM %s AS pgfence_row',
                       src, tbl);
    EXCEPTION WHEN OTHERS THEN
        RETURN format('it cannot be checked (%s)', SQLERRM);
    END;
    SELECT string_agg(DISTINCT pg_catalog.pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid), ', ') INTO why
      FROM pg_catalog.pg_depend d
      JOIN pg_catalog.pg_rewrite r ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
                                  AND d.objid OPERATOR(pg_catalog.=) r.oid
     WHERE r.ev_class OPERATOR(pg_catalog.=) 'pg_temp.pgfence_lock_source_check'::pg_catalog.regclass
       AND ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
             AND (SELECT p.pronamespace FROM pg_catalog.pg_proc p WHERE p.oid OPERATOR(pg_catalog.=) d.refobjid)
                 OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace)
         OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_operator'::pg_catalog.regclass
             AND (SELECT o.oprnamespace FROM pg_catalog.pg_operator o WHERE o.oid OPERATOR(pg_catalog.=) d.refobjid)
                 OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace)
         OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass
             AND (SELECT ty.typnamespace FROM pg_catalog.pg_type ty WHERE ty.oid OPERATOR(pg_catalog.=) d.refobjid)
                 OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace)
         OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
             AND d.refobjsubid OPERATOR(pg_catalog.>) 0
             AND EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type ty ON ty.oid OPERATOR(pg_catalog.=) a.atttypid
                          WHERE a.attrelid OPERATOR(pg_catalog.=) d.refobjid AND a.attnum OPERATOR(pg_catalog.=) d.refobjsubid
                            AND (ty.typnamespace OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace
                                 OR ty.typtype OPERATOR(pg_catalog.=) 'd'))));
    DROP VIEW pg_temp.pgfence_lock_source_check;
    IF why IS NOT NULL THEN
        RETURN format('it uses %s, which the table''s owner or another role may define', why);
    END IF;
    RETURN NULL;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_source_unsafe(regclass, text) IS
  'Why evaluating the lock-name expression src on tbl could run code of another role than pg_catalog''s (a function, '
  'operator or type outside pg_catalog, a column of a domain or of a type outside pg_catalog), or NULL when it '
  'cannot. Runs nothing of src: it inspects a temporary view of it.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_column_unsafe(tbl regclass, col text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE
        WHEN a.attnum IS NULL THEN NULL  -- no such column: the caller says so
        WHEN a.atttypid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.text'::pg_catalog.regtype,
                 'pg_catalog.varchar'::pg_catalog.regtype, 'pg_catalog.bpchar'::pg_catalog.regtype,
                 'pg_catalog.name'::pg_catalog.regtype]::pg_catalog.oid[]) THEN NULL
        ELSE pg_catalog.format('its lock-name column %I is of type %s, not text, varchar, char or name (its cast to text could run the owner''s code)',
                               col, a.atttypid::pg_catalog.regtype)
    END
    FROM (SELECT 1) AS one
    LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) tbl AND a.attname OPERATOR(pg_catalog.=) col
                                        AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_column_unsafe(regclass, text) IS
  'Why reading column col of tbl as a lock name could run code of the table''s owner (a type other than text, '
  'varchar, char or name: a domain or a type with its own cast), or NULL.';

-- pgfence.guard refuses, before it evaluates anything, a lock source that
-- pgfence.lock_column_unsafe or pgfence.lock_source_unsafe finds unsafe, then
-- attaches the guard with pgfence.attach_guard.
-- +goose StatementBegin
CREATE FUNCTION pgfence.guard(
    tbl                  regclass,
    lock_name            text DEFAULT NULL,
    lock_name_column     text DEFAULT NULL,
    fence_column         text DEFAULT 'fence',
    mode                 text DEFAULT 'strict',
    lock_name_expression text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    why text;
    gen text;
BEGIN
    IF tbl IS NOT NULL AND lock_name_column IS NOT NULL THEN
        why := pgfence.lock_column_unsafe(tbl, lock_name_column);
        IF why IS NULL THEN
            SELECT pg_catalog.pg_get_expr(d.adbin, d.adrelid) INTO gen
              FROM pg_catalog.pg_attrdef d
              JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) d.adrelid AND a.attnum OPERATOR(pg_catalog.=) d.adnum
             WHERE d.adrelid OPERATOR(pg_catalog.=) tbl AND a.attname OPERATOR(pg_catalog.=) lock_name_column
               AND a.attgenerated OPERATOR(pg_catalog.=) 's';
            IF gen IS NOT NULL THEN
                why := pgfence.lock_source_unsafe(tbl, gen);
            END IF;
        END IF;
    ELSIF tbl IS NOT NULL AND lock_name_expression IS NOT NULL
          AND pg_catalog.octet_length(lock_name_expression) OPERATOR(pg_catalog.<=) 4096 THEN
        why := pgfence.lock_source_unsafe(tbl, lock_name_expression);
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'pgfence.guard: lock name of % refused: %', tbl, why
            USING ERRCODE = '22023',
                  HINT = 'Lock names must come from text columns, or from expressions of built-in functions over columns of built-in types.';
    END IF;
    PERFORM pgfence.attach_guard(tbl, lock_name, lock_name_column, fence_column, mode, lock_name_expression);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.guard(regclass, text, text, text, text, text) IS
  'Attach the fencing guard to tbl: every UPDATE, INSERT and DELETE must carry the latest token of the row''s lock '
  '(lock_name, lock_name_column or lock_name_expression; fence_column; mode strict or reentrant). Refuses a lock '
  'source that could run code of another role than pg_catalog''s.';

-- Functions: fenced values -----------------------------------------------------

-- The fenced values door. Every change of pgfence.fenced_values is one of the
-- four functions below: fencedwrite (UpdateValue, UpsertValue, DeleteValue,
-- ReadValue, ModifyValue) calls them, and so can a client in any language.
-- The application's role has EXECUTE on them and SELECT on the table, no
-- INSERT, UPDATE or DELETE: every change it makes carries a token and passes
-- the fence check. Like the lease functions, each is SECURITY DEFINER (it
-- runs as the table's owner, the role that ran the migrations), has
-- search_path pinned to pg_catalog, pg_temp and checks every argument before
-- it reads or writes the table: key 1..512 bytes, token > 0, value and
-- reentrant not NULL (a JSON null is the jsonb value 'null'). A bad one raises
-- SQLSTATE PF011 naming the argument and the rule, and changes nothing. A token
-- is not checked against pgfence.locks: the row's fence is the check.
--
-- Modes: reentrant false (strict) writes only when fence < token, once per row
-- per grant; reentrant true also when fence = token (a grant writes a row
-- again). A delete and a fenced read need fence <= token.
--
-- Results: one row, whose row_found says whether the key exists.
--   row_found false  there is no such key; nothing changed (applied false,
--                    the other columns NULL)
--   applied true     the call changed the row; fence is the token
--   applied false    refused, nothing changed; fence (and updated_at, value)
--                    are the row's as a second statement reads it after the
--                    refusal: fence > token, a newer grant wrote or read the
--                    row; fence = token in strict mode, this grant already
--                    wrote it; a fence that would allow the token, the row
--                    changed between the two statements (read it again)
-- Under READ COMMITTED the second statement sees what committed meanwhile,
-- such as the write that made the first one wait and then refuse. An upsert
-- returns row_found false only when the row it conflicted with was deleted
-- before the second statement: it changed nothing. (The column is not named
-- found: in PL/pgSQL that name is the FOUND variable.)

-- pgfence.fenced_value_update writes value under an existing key if the
-- row's fence allows token (strict: fence < token; reentrant: fence <=
-- token): fence = token, updated_at = now().
-- +goose StatementBegin
CREATE FUNCTION pgfence.fenced_value_update(key text, value jsonb, token bigint, reentrant boolean,
    OUT applied boolean, OUT fence bigint, OUT updated_at timestamptz, OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_update.key IS NULL OR octet_length(fenced_value_update.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_update.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.token IS NULL OR fenced_value_update.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: token must be > 0, got %',
            coalesce(fenced_value_update.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.value IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: value must be a jsonb value (JSON null is ''null''), got NULL'
            USING ERRCODE = 'PF011';
    ELSIF fenced_value_update.reentrant IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_update: reentrant must be true or false, got NULL'
            USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.fenced_values AS v
    SET value = fenced_value_update.value, fence = fenced_value_update.token, updated_at = now()
    WHERE v.key = fenced_value_update.key
      AND (v.fence < fenced_value_update.token
           OR (fenced_value_update.reentrant AND v.fence = fenced_value_update.token))
    RETURNING true, v.fence, v.updated_at
    INTO fenced_value_update.applied, fenced_value_update.fence, fenced_value_update.updated_at;
    fenced_value_update.row_found := FOUND;
    IF NOT fenced_value_update.row_found THEN
        SELECT c.fence, c.updated_at
        INTO fenced_value_update.fence, fenced_value_update.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_update.key;
        fenced_value_update.row_found := FOUND;
        fenced_value_update.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.fenced_value_update(text, jsonb, bigint, boolean) IS
  'Writes value under an existing key of pgfence.fenced_values if the row''s fence allows token (fence < token; '
  'reentrant: fence <= token); fence becomes token. applied true: written; applied false: refused, nothing changed, '
  'with the row''s fence and updated_at. row_found false: no such key. Bad arguments: PF011.';

-- pgfence.fenced_value_upsert inserts key with value and fence = token, or,
-- if the key exists, updates it as fenced_value_update does. inserted: the row
-- is new.
-- +goose StatementBegin
CREATE FUNCTION pgfence.fenced_value_upsert(key text, value jsonb, token bigint, reentrant boolean,
    OUT applied boolean, OUT fence bigint, OUT updated_at timestamptz, OUT inserted boolean,
    OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_upsert.key IS NULL OR octet_length(fenced_value_upsert.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_upsert.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.token IS NULL OR fenced_value_upsert.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: token must be > 0, got %',
            coalesce(fenced_value_upsert.token::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.value IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: value must be a jsonb value (JSON null is ''null''), got NULL'
            USING ERRCODE = 'PF011';
    ELSIF fenced_value_upsert.reentrant IS NULL THEN
        RAISE EXCEPTION 'pgfence.fenced_value_upsert: reentrant must be true or false, got NULL'
            USING ERRCODE = 'PF011';
    END IF;
    INSERT INTO pgfence.fenced_values AS t (key, value, fence, updated_at)
    VALUES (fenced_value_upsert.key, fenced_value_upsert.value, fenced_value_upsert.token, now())
    ON CONFLICT ON CONSTRAINT fenced_values_pkey DO UPDATE
    SET value = excluded.value, fence = excluded.fence, updated_at = excluded.updated_at
    WHERE t.fence < excluded.fence
       OR (fenced_value_upsert.reentrant AND t.fence = excluded.fence)
    RETURNING true, t.fence, t.updated_at, t.xmax = 0
    INTO fenced_value_upsert.applied, fenced_value_upsert.fence, fenced_value_upsert.updated_at,
         fenced_value_upsert.inserted;
    fenced_value_upsert.row_found := FOUND;
    IF NOT fenced_value_upsert.row_found THEN
        SELECT c.fence, c.updated_at
        INTO fenced_value_upsert.fence, fenced_value_upsert.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_upsert.key;
        fenced_value_upsert.row_found := FOUND;
        fenced_value_upsert.applied := false;
        fenced_value_upsert.inserted := false;
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.fenced_value_upsert(text, jsonb, bigint, boolean) IS
  'Inserts key with value and fence = token into pgfence.fenced_values, or updates the existing row if its fence '
  'allows token (fence < token; reentrant: fence <= token). applied true: written (inserted: the row is new); '
  'applied false: refused, nothing changed, with the row''s fence and updated_at. row_found false: the conflicting '
  'row was deleted during the call, nothing changed. Bad arguments: PF011.';

-- pgfence.fenced_value_delete deletes key unless a newer grant wrote it
-- (fence <= token: a grant may delete a row it wrote). A deleted key keeps no
-- fence: an older grant may insert it again.
-- +goose StatementBegin
CREATE FUNCTION pgfence.fenced_value_delete(key text, token bigint,
    OUT applied boolean, OUT fence bigint, OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_delete.key IS NULL OR octet_length(fenced_value_delete.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_delete: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_delete.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_delete.token IS NULL OR fenced_value_delete.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_delete: token must be > 0, got %',
            coalesce(fenced_value_delete.token::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.fenced_values AS v
    WHERE v.key = fenced_value_delete.key AND v.fence <= fenced_value_delete.token
    RETURNING true, v.fence
    INTO fenced_value_delete.applied, fenced_value_delete.fence;
    fenced_value_delete.row_found := FOUND;
    IF NOT fenced_value_delete.row_found THEN
        SELECT c.fence
        INTO fenced_value_delete.fence
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_delete.key;
        fenced_value_delete.row_found := FOUND;
        fenced_value_delete.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.fenced_value_delete(text, bigint) IS
  'Deletes key from pgfence.fenced_values if its fence <= token. applied true: deleted (fence: the deleted row''s); '
  'applied false: refused, nothing changed, with the row''s fence. row_found false: no such key. Bad arguments: '
  'PF011.';

-- pgfence.fenced_value_read is the fenced read of a read-modify-write: it
-- returns the row and raises its fence to token (fence <= token), so a later
-- write by an older grant is refused. It locks the row until the caller's
-- transaction ends; updated_at is kept (the value did not change).
-- +goose StatementBegin
CREATE FUNCTION pgfence.fenced_value_read(key text, token bigint,
    OUT applied boolean, OUT value jsonb, OUT fence bigint, OUT updated_at timestamptz,
    OUT row_found boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF fenced_value_read.key IS NULL OR octet_length(fenced_value_read.key) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_read: key must be 1 to 512 bytes, got %',
            coalesce(octet_length(fenced_value_read.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF fenced_value_read.token IS NULL OR fenced_value_read.token <= 0 THEN
        RAISE EXCEPTION 'pgfence.fenced_value_read: token must be > 0, got %',
            coalesce(fenced_value_read.token::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.fenced_values AS v
    SET fence = fenced_value_read.token
    WHERE v.key = fenced_value_read.key AND v.fence <= fenced_value_read.token
    RETURNING true, v.value, v.fence, v.updated_at
    INTO fenced_value_read.applied, fenced_value_read.value, fenced_value_read.fence, fenced_value_read.updated_at;
    fenced_value_read.row_found := FOUND;
    IF NOT fenced_value_read.row_found THEN
        SELECT c.value, c.fence, c.updated_at
        INTO fenced_value_read.value, fenced_value_read.fence, fenced_value_read.updated_at
        FROM pgfence.fenced_values AS c WHERE c.key = fenced_value_read.key;
        fenced_value_read.row_found := FOUND;
        fenced_value_read.applied := false;
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.fenced_value_read(text, bigint) IS
  'Fenced read of pgfence.fenced_values: returns key''s row and raises its fence to token if fence <= token (applied '
  'true), locking the row until the transaction ends. applied false: refused, nothing changed; the row as it is. '
  'row_found false: no such key. Bad arguments: PF011.';

-- Functions: jobs -------------------------------------------------------------

-- +goose StatementBegin
CREATE FUNCTION pgfence.jobs_notify() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_catalog.pg_notify('pgfence_jobs', q.queue) FROM (SELECT DISTINCT queue FROM new_jobs) AS q;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.jobs_notify() IS
  'Statement trigger: NOTIFY pgfence_jobs once per queue that received rows, delivered at commit.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.jobs_count_dead() RETURNS trigger
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

-- The job door. Every change of pgfence.jobs by an application is one of the
-- functions below: SECURITY DEFINER (they run as the tables' owner, the role
-- that migrated), search_path pinned, every argument checked first (SQLSTATE
-- PF011 naming the argument and the rule; nothing changes). Durations are
-- milliseconds added to now(): the database clock decides.
--
-- A leased claim stores the SHA-256 of a claim key (claim_key_hash), a random
-- secret of the claimer (skiplocked draws 16 bytes per Claim). Renewing,
-- completing, failing and releasing a claim take the job id, the claim token
-- and the key: the token is public (any role that reads pgfence.jobs sees it),
-- the key is not, so a session that knows only the token cannot end or extend
-- another worker's claim. The batch forms take parallel arrays (one element
-- per claim, at most 10000) and return the ids they changed.

-- pgfence.job_enqueue inserts one job per element of its arrays (at most
-- 100000; all of the same length), in order: a NULL run_at means now(). It
-- returns the inserted rows in the order given. pgfence_jobs is notified with
-- each queue's name when the transaction commits (trigger jobs_notify).
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_enqueue(queue text[], payload jsonb[], priority smallint[], run_at timestamptz[],
    max_attempts integer[])
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    n integer := cardinality(job_enqueue.queue);
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'pgfence.job_enqueue: queue must be an array of 1 to 100000 names, got %',
            coalesce(n::text || ' elements', 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(job_enqueue.payload) IS DISTINCT FROM n OR cardinality(job_enqueue.priority) IS DISTINCT FROM n
       OR cardinality(job_enqueue.run_at) IS DISTINCT FROM n OR cardinality(job_enqueue.max_attempts) IS DISTINCT FROM n THEN
        RAISE EXCEPTION 'pgfence.job_enqueue: queue, payload, priority, run_at and max_attempts must have the same length (%)', n
            USING ERRCODE = 'PF011';
    ELSIF EXISTS (SELECT 1 FROM unnest(job_enqueue.queue) AS q(v) WHERE q.v IS NULL OR octet_length(q.v) NOT BETWEEN 1 AND 128) THEN
        RAISE EXCEPTION 'pgfence.job_enqueue: every queue must be 1 to 128 bytes' USING ERRCODE = 'PF011';
    ELSIF array_position(job_enqueue.payload, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'pgfence.job_enqueue: payload must not contain NULL' USING ERRCODE = 'PF011';
    ELSIF array_position(job_enqueue.priority, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'pgfence.job_enqueue: priority must not contain NULL' USING ERRCODE = 'PF011';
    ELSIF EXISTS (SELECT 1 FROM unnest(job_enqueue.max_attempts) AS m(v) WHERE m.v IS NULL OR m.v NOT BETWEEN 1 AND 1000000) THEN
        RAISE EXCEPTION 'pgfence.job_enqueue: every max_attempts must be 1 to 1000000' USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    INSERT INTO pgfence.jobs AS j (queue, payload, priority, run_at, max_attempts)
    SELECT t.q, t.p, t.pr, coalesce(t.r, now()), t.m
    FROM unnest(job_enqueue.queue, job_enqueue.payload, job_enqueue.priority, job_enqueue.run_at,
                job_enqueue.max_attempts) WITH ORDINALITY AS t(q, p, pr, r, m, ord)
    ORDER BY t.ord
    RETURNING j.*;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_enqueue(text[], jsonb[], smallint[], timestamptz[], integer[]) IS
  'Inserts one job per element of the arrays (same length, 1 to 100000; run_at NULL = now()) and returns the rows '
  'in the order given. NOTIFY pgfence_jobs with each queue at commit. Bad arguments: PF011.';

-- pgfence.job_claim is the leased claim: it takes up to max_jobs claimable
-- jobs of queue (available and due, or running with an expired claim) with
-- FOR UPDATE SKIP LOCKED, gives each a new claim token, holder, an expiry of
-- now() + ttl_ms and claim_key_hash = sha256(key), counts an attempt, and
-- returns them in claim order (priority, run_at, id). An expired claim on a
-- job with no attempts left sends the job to dead instead (not returned).
-- holder 1..512 bytes, ttl_ms 100..86400000, max_jobs 1..10000, key 16..64
-- bytes.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_claim(queue text, holder text, ttl_ms bigint, max_jobs integer, key bytea)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    kh bytea;
BEGIN
    IF job_claim.queue IS NULL OR octet_length(job_claim.queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION 'pgfence.job_claim: queue must be 1 to 128 bytes, got %',
            coalesce(octet_length(job_claim.queue)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.holder IS NULL OR octet_length(job_claim.holder) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.job_claim: holder must be 1 to 512 bytes, got %',
            coalesce(octet_length(job_claim.holder)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.ttl_ms IS NULL OR job_claim.ttl_ms NOT BETWEEN 100 AND 86400000 THEN
        RAISE EXCEPTION 'pgfence.job_claim: ttl_ms must be 100 to 86400000 (100 ms to 24 hours), got %',
            coalesce(job_claim.ttl_ms::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.max_jobs IS NULL OR job_claim.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_claim: max_jobs must be 1 to 10000, got %',
            coalesce(job_claim.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim.key IS NULL OR octet_length(job_claim.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.job_claim: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(job_claim.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    kh := sha256(job_claim.key);
    -- The picked rows stay locked until the UPDATE, so a running one is one
    -- whose claim expired. The UPDATE finds them by primary key (id = ANY): a
    -- join with picked becomes, on a small table, a hash join over every row.
    RETURN QUERY
    WITH due AS (
        SELECT a.id, a.priority, a.run_at
        FROM pgfence.jobs a
        WHERE a.queue = job_claim.queue AND a.state = 'available' AND a.run_at <= now()
        ORDER BY a.priority, a.run_at, a.id
        LIMIT job_claim.max_jobs
        FOR UPDATE SKIP LOCKED
    ), expired AS (
        SELECT r.id, r.priority, r.run_at
        FROM pgfence.jobs r
        WHERE r.queue = job_claim.queue AND r.state = 'running' AND r.claim_expires_at <= now()
        ORDER BY r.claim_expires_at
        LIMIT job_claim.max_jobs
        FOR UPDATE SKIP LOCKED
    ), picked AS (
        SELECT c.id
        FROM (SELECT d.id, d.priority, d.run_at FROM due d
              UNION ALL
              SELECT e.id, e.priority, e.run_at FROM expired e) AS c
        ORDER BY c.priority, c.run_at, c.id
        LIMIT job_claim.max_jobs
    ), claimed AS (
        UPDATE pgfence.jobs j
        SET state            = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN 'dead' ELSE 'running' END,
            attempts         = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.attempts ELSE j.attempts + 1 END,
            holder           = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.holder ELSE job_claim.holder END,
            claim_token      = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.claim_token
                                    ELSE nextval('pgfence.jobs_claim_token_seq') END,
            claim_key_hash   = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN j.claim_key_hash ELSE kh END,
            claim_expires_at = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN NULL
                                    ELSE now() + job_claim.ttl_ms * interval '1 millisecond' END,
            last_error       = CASE WHEN j.state = 'running'
                                    THEN 'claim ' || j.claim_token || ' of ' || j.holder || ' expired at ' || j.claim_expires_at
                                    ELSE j.last_error END,
            finished_at      = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN now() END,
            claim_outcome    = CASE WHEN j.state = 'running' AND j.attempts >= j.max_attempts THEN 'expired' END,
            updated_at       = now()
        WHERE j.id = ANY (ARRAY(SELECT p.id FROM picked p))
        RETURNING j.*
    )
    SELECT c.* FROM claimed c
    WHERE c.state = 'running'
    ORDER BY c.priority, c.run_at, c.id;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_claim(text, text, bigint, integer, bytea) IS
  'Leased claim: up to max_jobs claimable jobs of queue (FOR UPDATE SKIP LOCKED), each with a new claim token, '
  'holder, expiry now() + ttl_ms and the sha256 of key; returned in claim order. An expired claim with no attempts '
  'left sends its job to dead. Bad arguments: PF011.';

-- pgfence.job_claims_refused checks the arrays of a batch call on claims
-- (ids, tokens, keys: same length, 1..10000, ids and tokens > 0, keys 16..64
-- bytes) and raises PF011 for the calling function fn when they are not.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_claims_refused(fn text, ids bigint[], tokens bigint[], keys bytea[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer := cardinality(ids);
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION '%: ids must be an array of 1 to 10000 job ids, got %', fn,
            coalesce(n::text || ' elements', 'NULL') USING ERRCODE = 'PF011';
    ELSIF cardinality(tokens) IS DISTINCT FROM n OR cardinality(keys) IS DISTINCT FROM n THEN
        RAISE EXCEPTION '%: ids, tokens and keys must have the same length (%)', fn, n USING ERRCODE = 'PF011';
    ELSIF (0 < ALL (ids)) IS NOT TRUE THEN -- a NULL or an id <= 0
        RAISE EXCEPTION '%: every id must be > 0', fn USING ERRCODE = 'PF011';
    ELSIF (0 < ALL (tokens)) IS NOT TRUE THEN
        RAISE EXCEPTION '%: every token must be > 0', fn USING ERRCODE = 'PF011';
    ELSIF EXISTS (SELECT 1 FROM unnest(keys) AS k(v) WHERE k.v IS NULL OR octet_length(k.v) NOT BETWEEN 16 AND 64) THEN
        RAISE EXCEPTION '%: every key must be 16 to 64 random bytes', fn USING ERRCODE = 'PF011';
    END IF;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_claims_refused(text, bigint[], bigint[], bytea[]) IS
  'Raises PF011 for function fn unless ids, tokens and keys are arrays of the same length (1 to 10000), ids and '
  'tokens > 0, keys 16 to 64 bytes. Used by the job functions that act on claims.';

-- pgfence.job_renew extends the claims still held (running, same token, same
-- key) to now() + ttl_ms and returns each extended job's id and new expiry.
-- It never waits: a job whose row another transaction holds at that moment is
-- skipped (not extended, not lost).
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_renew(ids bigint[], tokens bigint[], keys bytea[], ttl_ms bigint)
RETURNS TABLE (id bigint, claim_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_renew.ids) = 1 AND cardinality(job_renew.tokens) = 1 AND cardinality(job_renew.keys) = 1
        AND job_renew.ids[1] > 0 AND job_renew.tokens[1] > 0 AND octet_length(job_renew.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_renew', job_renew.ids, job_renew.tokens, job_renew.keys);
    END IF;
    IF job_renew.ttl_ms IS NULL OR job_renew.ttl_ms NOT BETWEEN 100 AND 86400000 THEN
        RAISE EXCEPTION 'pgfence.job_renew: ttl_ms must be 100 to 86400000 (100 ms to 24 hours), got %',
            coalesce(job_renew.ttl_ms::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    WITH c AS (
        SELECT u.i, u.t, sha256(u.k) AS kh FROM unnest(job_renew.ids, job_renew.tokens, job_renew.keys) AS u(i, t, k)
    ), held AS (
        SELECT h.id
        FROM pgfence.jobs h JOIN c ON c.i = h.id AND c.t = h.claim_token AND c.kh = h.claim_key_hash
        WHERE h.state = 'running'
        FOR UPDATE OF h SKIP LOCKED
    )
    UPDATE pgfence.jobs j
    SET claim_expires_at = now() + job_renew.ttl_ms * interval '1 millisecond', updated_at = now()
    FROM held, c
    WHERE j.id = held.id AND c.i = j.id AND j.claim_token = c.t AND j.claim_key_hash = c.kh AND j.state = 'running'
    RETURNING j.id, j.claim_expires_at;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_renew(bigint[], bigint[], bytea[], bigint) IS
  'Extends the claims (ids[i], tokens[i]) held with keys[i] to now() + ttl_ms; returns the extended ids and expiries. '
  'A row locked by another transaction is skipped. Bad arguments: PF011.';

-- pgfence.job_complete marks jobs completed, each only if it is still running
-- under its token and key, and returns the ids that changed.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_complete(ids bigint[], tokens bigint[], keys bytea[])
RETURNS TABLE (id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_complete.ids) = 1 AND cardinality(job_complete.tokens) = 1 AND cardinality(job_complete.keys) = 1
        AND job_complete.ids[1] > 0 AND job_complete.tokens[1] > 0 AND octet_length(job_complete.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_complete', job_complete.ids, job_complete.tokens, job_complete.keys);
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET state = 'completed', claim_outcome = 'completed', claim_expires_at = NULL, finished_at = now(), updated_at = now()
    FROM unnest(job_complete.ids, job_complete.tokens, job_complete.keys) AS c(i, t, k)
    WHERE j.id = c.i AND j.claim_token = c.t AND j.claim_key_hash = sha256(c.k) AND j.state = 'running'
    RETURNING j.id;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_complete(bigint[], bigint[], bytea[]) IS
  'Completes the jobs (ids[i]) still running under tokens[i] claimed with keys[i]; returns the ids that changed. '
  'Bad arguments: PF011.';

-- pgfence.job_release gives claims back unfinished: each job still running
-- under its token and key becomes available at once, its attempt not counted.
-- Returns the ids that changed.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_release(ids bigint[], tokens bigint[], keys bytea[])
RETURNS TABLE (id bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (cardinality(job_release.ids) = 1 AND cardinality(job_release.tokens) = 1 AND cardinality(job_release.keys) = 1
        AND job_release.ids[1] > 0 AND job_release.tokens[1] > 0 AND octet_length(job_release.keys[1]) BETWEEN 16 AND 64) IS NOT TRUE THEN
        -- One valid claim (the common call) is checked above without a call.
        PERFORM pgfence.job_claims_refused('pgfence.job_release', job_release.ids, job_release.tokens, job_release.keys);
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET state = 'available', attempts = greatest(j.attempts - 1, 0), claim_expires_at = NULL, claim_outcome = 'released',
        updated_at = now()
    FROM unnest(job_release.ids, job_release.tokens, job_release.keys) AS c(i, t, k)
    WHERE j.id = c.i AND j.claim_token = c.t AND j.claim_key_hash = sha256(c.k) AND j.state = 'running'
    RETURNING j.id;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_release(bigint[], bigint[], bytea[]) IS
  'Gives the claims (ids[i], tokens[i], keys[i]) back unfinished: available at once, the attempt not counted; returns '
  'the ids that changed. Bad arguments: PF011.';

-- pgfence.job_fail records a failed attempt of a job still running under
-- token and key: available again at now() + retry_in_ms, or dead (last_error
-- kept) when no attempts are left or give_up. Returns the job as it is now;
-- no row: the claim was lost, nothing changed. last_error at most 8192 bytes,
-- retry_in_ms 0..31536000000 (a year).
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_fail(id bigint, token bigint, key bytea, last_error text, retry_in_ms bigint,
    give_up boolean)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF (job_fail.id > 0 AND job_fail.token > 0 AND octet_length(job_fail.key) BETWEEN 16 AND 64) IS NOT TRUE THEN
        PERFORM pgfence.job_claims_refused('pgfence.job_fail', ARRAY[job_fail.id], ARRAY[job_fail.token], ARRAY[job_fail.key]);
    END IF;
    IF job_fail.last_error IS NULL OR octet_length(job_fail.last_error) > 8192 THEN
        RAISE EXCEPTION 'pgfence.job_fail: last_error must be 0 to 8192 bytes, got %',
            coalesce(octet_length(job_fail.last_error)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail.retry_in_ms IS NULL OR job_fail.retry_in_ms NOT BETWEEN 0 AND 31536000000 THEN
        RAISE EXCEPTION 'pgfence.job_fail: retry_in_ms must be 0 to 31536000000 (a year), got %',
            coalesce(job_fail.retry_in_ms::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail.give_up IS NULL THEN
        RAISE EXCEPTION 'pgfence.job_fail: give_up must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET state            = CASE WHEN j.attempts >= j.max_attempts OR job_fail.give_up THEN 'dead' ELSE 'available' END,
        run_at           = CASE WHEN j.attempts >= j.max_attempts OR job_fail.give_up THEN j.run_at
                                ELSE now() + job_fail.retry_in_ms * interval '1 millisecond' END,
        finished_at      = CASE WHEN j.attempts >= j.max_attempts OR job_fail.give_up THEN now() END,
        last_error       = job_fail.last_error,
        claim_expires_at = NULL,
        claim_outcome    = 'failed',
        updated_at       = now()
    WHERE j.id = job_fail.id AND j.claim_token = job_fail.token AND j.claim_key_hash = sha256(job_fail.key)
      AND j.state = 'running'
    RETURNING j.*;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_fail(bigint, bigint, bytea, text, bigint, boolean) IS
  'Records a failed attempt of the job id still running under token claimed with key: available at now() + '
  'retry_in_ms, or dead when no attempts are left or give_up. Returns the job; no row: the claim was lost. Bad '
  'arguments: PF011.';

-- In-transaction claims: the row lock is the claim, and it lasts until the
-- calling transaction ends (a row lock taken in a function is the
-- transaction's). They write no claim token and need no key: another
-- transaction cannot lock, complete or fail the row while it is held.

-- pgfence.job_claim_tx locks up to max_jobs available, due jobs of queue with
-- FOR UPDATE SKIP LOCKED for the calling transaction and returns them.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_claim_tx(queue text, max_jobs integer)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF job_claim_tx.queue IS NULL OR octet_length(job_claim_tx.queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: queue must be 1 to 128 bytes, got %',
            coalesce(octet_length(job_claim_tx.queue)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_claim_tx.max_jobs IS NULL OR job_claim_tx.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_claim_tx: max_jobs must be 1 to 10000, got %',
            coalesce(job_claim_tx.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    SELECT j.* FROM pgfence.jobs j
    WHERE j.queue = job_claim_tx.queue AND j.state = 'available' AND j.run_at <= now()
    ORDER BY j.priority, j.run_at, j.id
    LIMIT job_claim_tx.max_jobs
    FOR UPDATE SKIP LOCKED;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_claim_tx(text, integer) IS
  'In-transaction claim: locks up to max_jobs available, due jobs of queue (FOR UPDATE SKIP LOCKED) until the calling '
  'transaction ends, and returns them. Nothing is written. Bad arguments: PF011.';

-- pgfence.job_complete_tx marks an available job completed, in the
-- transaction that claimed it with job_claim_tx. false: no available job id.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_complete_tx(id bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF job_complete_tx.id IS NULL OR job_complete_tx.id <= 0 THEN
        RAISE EXCEPTION 'pgfence.job_complete_tx: id must be > 0, got %',
            coalesce(job_complete_tx.id::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.jobs j
    SET state = 'completed', finished_at = now(), updated_at = now()
    WHERE j.id = job_complete_tx.id AND j.state = 'available';
    RETURN FOUND;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_complete_tx(bigint) IS
  'Completes the available job id in the transaction that claimed it with job_claim_tx; false: no available job id. '
  'Bad arguments: PF011.';

-- pgfence.job_fail_tx records a failed attempt of a job claimed with
-- job_claim_tx, in the same transaction: attempts + 1, then available at
-- now() + retry_in_ms, or dead when no attempts are left or give_up. No row:
-- no available job id.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_fail_tx(id bigint, last_error text, retry_in_ms bigint, give_up boolean)
RETURNS SETOF pgfence.jobs
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    IF job_fail_tx.id IS NULL OR job_fail_tx.id <= 0 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: id must be > 0, got %',
            coalesce(job_fail_tx.id::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.last_error IS NULL OR octet_length(job_fail_tx.last_error) > 8192 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: last_error must be 0 to 8192 bytes, got %',
            coalesce(octet_length(job_fail_tx.last_error)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.retry_in_ms IS NULL OR job_fail_tx.retry_in_ms NOT BETWEEN 0 AND 31536000000 THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: retry_in_ms must be 0 to 31536000000 (a year), got %',
            coalesce(job_fail_tx.retry_in_ms::text, 'NULL') USING ERRCODE = 'PF011';
    ELSIF job_fail_tx.give_up IS NULL THEN
        RAISE EXCEPTION 'pgfence.job_fail_tx: give_up must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    RETURN QUERY
    UPDATE pgfence.jobs j
    SET attempts    = j.attempts + 1,
        state       = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN 'dead' ELSE 'available' END,
        run_at      = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN j.run_at
                           ELSE now() + job_fail_tx.retry_in_ms * interval '1 millisecond' END,
        finished_at = CASE WHEN j.attempts + 1 >= j.max_attempts OR job_fail_tx.give_up THEN now() END,
        last_error  = job_fail_tx.last_error,
        updated_at  = now()
    WHERE j.id = job_fail_tx.id AND j.state = 'available'
    RETURNING j.*;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_fail_tx(bigint, text, bigint, boolean) IS
  'Records a failed attempt of the available job id in the transaction that claimed it with job_claim_tx: '
  'attempts + 1, available at now() + retry_in_ms or dead. No row: no available job id. Bad arguments: PF011.';

-- pgfence.job_purge deletes up to max_jobs (1..10000) completed or dead jobs
-- that finished before finished_before, oldest first, and returns how many.
-- +goose StatementBegin
CREATE FUNCTION pgfence.job_purge(finished_before timestamptz, max_jobs integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    n bigint;
BEGIN
    IF job_purge.finished_before IS NULL THEN
        RAISE EXCEPTION 'pgfence.job_purge: finished_before must not be NULL' USING ERRCODE = 'PF011';
    ELSIF job_purge.max_jobs IS NULL OR job_purge.max_jobs NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'pgfence.job_purge: max_jobs must be 1 to 10000, got %',
            coalesce(job_purge.max_jobs::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.jobs
    WHERE id = ANY (ARRAY(SELECT f.id FROM pgfence.jobs f
                          WHERE f.state IN ('completed', 'dead') AND f.finished_at < job_purge.finished_before
                          ORDER BY f.finished_at
                          LIMIT job_purge.max_jobs));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.job_purge(timestamptz, integer) IS
  'Deletes up to max_jobs completed or dead jobs that finished before finished_before (oldest first); returns how '
  'many. Bad arguments: PF011.';

-- Functions: the outbox -------------------------------------------------------

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
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    latest bigint;
BEGIN
    -- FOR SHARE: a grant (an UPDATE of the lock row) waits until this
    -- transaction ends, so none can commit between this check and the commit.
    -- SECURITY DEFINER: FOR SHARE needs UPDATE on pgfence.locks, which only
    -- its owner has; the function reads nothing but NEW's lock row.
    SELECT l.token INTO latest FROM pgfence.locks l WHERE l.name = NEW.lock_name FOR SHARE;
    PERFORM pgfence.outbox_token_refused(NEW.lock_name, NEW.idempotency_key, NEW.token, latest);
    RETURN NULL;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.outbox_check_token() IS
  'Deferred constraint trigger of pgfence.outbox: at COMMIT, locks the intent''s lock row FOR SHARE and refuses the '
  'intent unless its token is the lock''s latest (see pgfence.outbox_token_refused).';

-- pgfence.outbox_enqueue records an intent of the lease (lock_name, token)
-- held with key, in the caller's transaction: the only way the application's
-- role records intents (it has no INSERT on pgfence.outbox). SECURITY DEFINER:
-- it writes pgfence.outbox and pgfence.jobs as their owner.
--
-- Arguments are checked before anything is read or written, and a bad one
-- changes nothing: lock_name 1..512 bytes (PF011); token NULL or <= 0: PF007,
-- as for a fenced statement; key 16..64 bytes (PF011); topic 1..100 bytes of
-- ASCII letters, digits and . _ : / - (PF011); idempotency_key 1..255 visible
-- ASCII characters (PF011); payload not NULL (22004) and at most 1 MiB in its
-- text form (23514, constraint outbox_payload_size, as the table's CHECK says);
-- max_attempts 1..1000000 (PF011). A NULL run_at means now().
--
-- Then the lease. The token must be the lock's latest grant: PF003 when a
-- newer grant exists, PF002 when the lock never issued it (or has no row), as
-- pgfence.outbox_token_refused raises them. And the lease must be held with
-- key: holder set, expires_at > now() (the start of the caller's transaction,
-- the time every pgfence function compares with) and key_hash = sha256(key);
-- otherwise PF012, with the DETAIL of PF002 ("op INSERT, key K, token N, lock
-- L, latest token M"). The token is public (fenced rows, pgfence.lock_status),
-- the key is a secret of the holder: without the key, a session that reads a
-- lease's token could record intents under a lease it does not hold. The
-- deferred trigger outbox_check_token checks the token again at COMMIT, under
-- a lock of the lock row; the key and the expiry are checked here only.
-- +goose StatementBegin
CREATE FUNCTION pgfence.outbox_enqueue(
    lock_name       text,
    token           bigint,
    key             bytea,
    topic           text,
    idempotency_key text,
    payload         jsonb,
    max_attempts    integer DEFAULT 25,
    run_at          timestamptz DEFAULT NULL
) RETURNS TABLE (intent_id bigint, duplicate boolean, intent_topic text, intent_lock_name text, intent_token bigint,
                 enqueued_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    latest  bigint;
    held_by text;
    expires timestamptz;
    kh      bytea;
    jid     bigint;
BEGIN
    -- 1. The arguments.
    IF outbox_enqueue.lock_name IS NULL OR octet_length(outbox_enqueue.lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: lock_name must be 1 to 512 bytes, got %',
            coalesce(octet_length(outbox_enqueue.lock_name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.token IS NULL OR outbox_enqueue.token <= 0 THEN
        PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                             outbox_enqueue.token, NULL);  -- PF007
    ELSIF outbox_enqueue.key IS NULL OR octet_length(outbox_enqueue.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: key must be 16 to 64 random bytes (the lease''s key), got %',
            coalesce(octet_length(outbox_enqueue.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.topic IS NULL OR outbox_enqueue.topic !~ '^[A-Za-z0-9._:/-]{1,100}$' THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: topic must be 1 to 100 bytes of ASCII letters, digits and . _ : / -, got %',
            coalesce(CASE WHEN octet_length(outbox_enqueue.topic) BETWEEN 1 AND 100 THEN 'another character'
                          ELSE octet_length(outbox_enqueue.topic)::text || ' bytes' END, 'NULL')
            USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.idempotency_key IS NULL OR outbox_enqueue.idempotency_key !~ '^[!-~]{1,255}$' THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: idempotency_key must be 1 to 255 visible ASCII characters, got %',
            coalesce(CASE WHEN octet_length(outbox_enqueue.idempotency_key) BETWEEN 1 AND 255 THEN 'another character'
                          ELSE octet_length(outbox_enqueue.idempotency_key)::text || ' bytes' END, 'NULL')
            USING ERRCODE = 'PF011';
    ELSIF outbox_enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: payload must not be NULL' USING ERRCODE = '22004';
    ELSIF octet_length(outbox_enqueue.payload::text) > 1048576 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: payload must be at most 1048576 bytes in its text form, got %',
                octet_length(outbox_enqueue.payload::text) || ' bytes'
            USING ERRCODE = '23514', SCHEMA = 'pgfence', TABLE = 'outbox', CONSTRAINT = 'outbox_payload_size';
    ELSIF outbox_enqueue.max_attempts IS NULL OR outbox_enqueue.max_attempts NOT BETWEEN 1 AND 1000000 THEN
        RAISE EXCEPTION 'pgfence.outbox_enqueue: max_attempts must be 1 to 1000000, got %',
            coalesce(outbox_enqueue.max_attempts::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    -- 2. The token must be the lock's latest grant (checked again at COMMIT,
    --    under a lock, by trigger outbox_check_token), and the lease held
    --    with this key.
    SELECT l.token, l.holder, l.expires_at, l.key_hash INTO latest, held_by, expires, kh
    FROM pgfence.locks l WHERE l.name = outbox_enqueue.lock_name;
    PERFORM pgfence.outbox_token_refused(outbox_enqueue.lock_name, outbox_enqueue.idempotency_key,
                                         outbox_enqueue.token, latest);
    IF held_by IS NULL OR NOT expires > now() OR kh IS DISTINCT FROM sha256(outbox_enqueue.key) THEN
        RAISE EXCEPTION 'pgfence outbox: intent % refused: the lease of lock % with token % is not held with this key (%)',
                jsonb_build_object('idempotency_key', outbox_enqueue.idempotency_key)::text,
                quote_literal(outbox_enqueue.lock_name), outbox_enqueue.token,
                CASE WHEN held_by IS NULL THEN 'released' WHEN NOT expires > now() THEN 'expired'
                     ELSE 'held with another key' END
            USING ERRCODE = 'PF012', SCHEMA = 'pgfence', TABLE = 'outbox',
                  DETAIL = format('op INSERT, key %s, token %s, lock %s, latest token %s',
                                  jsonb_build_object('idempotency_key', outbox_enqueue.idempotency_key)::text,
                                  outbox_enqueue.token, outbox_enqueue.lock_name, latest),
                  HINT = 'Pass the lease of the current holder with its own key (pglock: Lease.Key()).';
    END IF;
    FOR attempt IN 1..3 LOOP
        -- 3. A key already recorded for this lock: the first intent wins.
        RETURN QUERY SELECT o.id, true, o.topic, o.lock_name, o.token, o.created_at
                       FROM pgfence.outbox o
                      WHERE o.lock_name = outbox_enqueue.lock_name
                        AND o.idempotency_key = outbox_enqueue.idempotency_key;
        IF FOUND THEN
            RETURN;
        END IF;
        -- 4. The delivery job, then the intent under the job's id.
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
COMMENT ON FUNCTION pgfence.outbox_enqueue(text, bigint, bytea, text, text, jsonb, integer, timestamptz) IS
  'Record a side-effect intent in the current transaction, only under the live lease (lock_name, token) held with '
  'key: returns the new intent (duplicate = false), or the intent already recorded under idempotency_key '
  '(duplicate = true, nothing recorded). Refused with PF003 (stale token: a newer grant exists), PF002 (token never '
  'issued, or no such lock) or PF012 (lease not held with this key: released, expired, or another key); the token '
  'is checked again at COMMIT under a lock of the lock row. Bad arguments: PF011, PF007 (token <= 0), 22004 (NULL '
  'payload), 23514 (payload over 1 MiB). Delivered through a pgfence.jobs row on queue outbox:<topic> '
  '(max_attempts attempts, not before run_at). SECURITY DEFINER.';

-- Functions: the HA epoch (owner only) ----------------------------------------

-- The server's current timeline (it changes at every promotion).
CREATE FUNCTION pgfence.ha_timeline() RETURNS integer
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer $$;
COMMENT ON FUNCTION pgfence.ha_timeline() IS
  'The timeline of this server (a primary), read from its current WAL file name.';

-- The gate: no token is issued (lock grant or job claim) on a timeline whose
-- bump has not run yet. Its triggers exist only once pgfence.ha_enable() ran.
-- +goose StatementBegin
CREATE FUNCTION pgfence.ha_gate() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF (SELECT e.timeline FROM pgfence.ha_epoch e) IS DISTINCT FROM pgfence.ha_timeline() THEN
        RAISE EXCEPTION 'pgfence: this server was promoted and its epoch bump has not run yet'
            USING ERRCODE = 'PFHA1',
                  HINT = 'the on_role_change callback runs SELECT pgfence.ha_bump()';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.ha_gate() IS
  'Trigger function of the HA epoch gate (pgfence.ha_enable): refuses a grant or claim with PFHA1 until '
  'pgfence.ha_bump() has run on this server''s timeline.';

-- The bump: every lock token and the claim token sequence move up by 2^32,
-- above anything the old primary can have issued, once per timeline. It runs
-- as its caller, the owner of pgfence's tables or a superuser.
-- +goose StatementBegin
CREATE FUNCTION pgfence.ha_bump() RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    tl  integer;
    cur integer;
BEGIN
    IF pg_is_in_recovery() THEN
        RAISE EXCEPTION 'pgfence.ha_bump: this server is a standby' USING ERRCODE = '25006';
    END IF;
    SELECT e.timeline INTO cur FROM pgfence.ha_epoch e FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false; -- the epoch is not enabled in this database
    END IF;
    tl := pgfence.ha_timeline();
    IF cur = tl THEN
        RETURN false; -- already done on this timeline
    END IF;
    INSERT INTO pgfence.ha_bumps (timeline, bumped_at, name, token_before)
        SELECT tl, now(), l.name, l.token FROM pgfence.locks l;
    UPDATE pgfence.ha_epoch SET timeline = tl, bumps = bumps + 1, bumped_at = now();
    UPDATE pgfence.locks SET token = token + 4294967296;
    PERFORM setval('pgfence.jobs_claim_token_seq', nextval('pgfence.jobs_claim_token_seq') + 4294967296);
    RETURN true;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.ha_bump() IS
  'The HA epoch bump, run on promotion: raises every lock token and the claim token sequence by 2^32 and records '
  'the tokens before it in pgfence.ha_bumps, once per timeline. Returns false when it had nothing to do (already '
  'done on this timeline, or pgfence.ha_enable() never ran). Owner only.';

-- ha_enable installs the epoch in this database: its row (the current
-- timeline) and the gate triggers. ha_disable removes both. Idempotent.
-- +goose StatementBegin
CREATE FUNCTION pgfence.ha_enable() RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO pgfence.ha_epoch (timeline) VALUES (pgfence.ha_timeline()) ON CONFLICT (one) DO NOTHING;
    DROP TRIGGER IF EXISTS pgfence_ha_gate ON pgfence.locks;
    DROP TRIGGER IF EXISTS pgfence_ha_gate_token ON pgfence.locks;
    DROP TRIGGER IF EXISTS pgfence_ha_gate ON pgfence.jobs;
    CREATE TRIGGER pgfence_ha_gate BEFORE INSERT ON pgfence.locks
        FOR EACH ROW EXECUTE FUNCTION pgfence.ha_gate();
    -- A release keeps the token: only a grant changes it.
    CREATE TRIGGER pgfence_ha_gate_token BEFORE UPDATE OF token ON pgfence.locks
        FOR EACH ROW WHEN (NEW.token IS DISTINCT FROM OLD.token) EXECUTE FUNCTION pgfence.ha_gate();
    CREATE TRIGGER pgfence_ha_gate BEFORE UPDATE OF claim_token ON pgfence.jobs
        FOR EACH ROW EXECUTE FUNCTION pgfence.ha_gate();
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.ha_enable() IS
  'Enable the HA epoch in this database (docs/ha.md): the epoch row for the current timeline and the gate triggers '
  'on pgfence.locks and pgfence.jobs. Run once, as the owner, on a cluster that can fail over to an asynchronous '
  'standby. Idempotent. Owner only.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.ha_disable() RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DROP TRIGGER IF EXISTS pgfence_ha_gate ON pgfence.locks;
    DROP TRIGGER IF EXISTS pgfence_ha_gate_token ON pgfence.locks;
    DROP TRIGGER IF EXISTS pgfence_ha_gate ON pgfence.jobs;
    DELETE FROM pgfence.ha_epoch;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.ha_disable() IS
  'Remove the HA epoch gate and its row (pgfence.ha_bumps is kept). Owner only.';

-- Functions: operator views ---------------------------------------------------

-- The figures of pgfence.guarded_fences. The function runs as the role that
-- reads the view (often a superuser DBA), so it reads guarded tables without
-- running code their owners can define: a table is read only when its fence
-- column is bigint and its lock-name column (column form) is text, varchar,
-- char or name, never a domain or a type of another schema; a lock-name
-- expression is the owner's code, evaluated only when it calls nothing outside
-- pg_catalog on columns of built-in types (pgfence.lock_source_unsafe); and a
-- table with row-level security (whose policies are the owner's code too) is
-- read only by its owner or a superuser (who bypasses the policies). Any other
-- table is listed with NULL figures and the reason in column unchecked.
-- +goose StatementBegin
CREATE FUNCTION pgfence.guarded_fence_status()
RETURNS TABLE (table_name text, lock_name text, rows bigint, max_fence bigint, lock_token bigint, forged_rows bigint,
               unchecked text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g      record;
    src    text;
    why    text;
    reader oid := (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user);
    super  boolean := (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user);
BEGIN
    FOR g IN SELECT t.relid, t.fence_column, t.lock_name AS ln, t.lock_name_column, t.lock_name_expression,
                    c.relowner, c.relrowsecurity
               FROM pgfence.guarded_tables t JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) t.relid LOOP
        why := NULL;
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                        WHERE a.attrelid OPERATOR(pg_catalog.=) g.relid AND a.attname OPERATOR(pg_catalog.=) g.fence_column
                          AND NOT a.attisdropped AND a.atttypid OPERATOR(pg_catalog.=) 'pg_catalog.int8'::pg_catalog.regtype) THEN
            why := format('its fence column %I is not bigint', g.fence_column);
        ELSIF g.lock_name_column IS NOT NULL THEN
            why := pgfence.lock_column_unsafe(g.relid, g.lock_name_column);
        ELSIF g.lock_name_expression IS NOT NULL THEN
            why := pgfence.lock_source_unsafe(g.relid, g.lock_name_expression);
        END IF;
        IF why IS NULL AND g.relrowsecurity AND reader OPERATOR(pg_catalog.<>) g.relowner AND NOT super THEN
            why := 'it has row-level security (the owner''s policies): only its owner or a superuser reads it';
        END IF;
        IF why IS NOT NULL THEN
            RETURN QUERY SELECT g.relid::pg_catalog.text, g.ln, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, why;
            CONTINUE;
        END IF;
        IF g.ln IS NOT NULL THEN
            RETURN QUERY EXECUTE format(
                'SELECT %L::pg_catalog.text, %L::pg_catalog.text, pg_catalog.count(*), pg_catalog.max(t.%I), pg_catalog.max(l.token),
                        pg_catalog.count(*) FILTER (WHERE t.%I OPERATOR(pg_catalog.>) COALESCE(l.token, 0)), NULL::pg_catalog.text
                 FROM %s t LEFT JOIN pgfence.lock_status l ON l.name OPERATOR(pg_catalog.=) %L',
                g.relid::pg_catalog.text, g.ln, g.fence_column, g.fence_column, g.relid, g.ln);
        ELSE
            IF g.lock_name_column IS NOT NULL THEN
                src := format('pgfence_row.%I', g.lock_name_column);
            ELSE
                src := g.lock_name_expression;
            END IF;
            RETURN QUERY EXECUTE format(
                'SELECT %L::pg_catalog.text, t.pgfence_lock, pg_catalog.count(*), pg_catalog.max(t.%I), pg_catalog.max(l.token),
                        pg_catalog.count(*) FILTER (WHERE t.%I OPERATOR(pg_catalog.>) COALESCE(l.token, 0)), NULL::pg_catalog.text
                 FROM (SELECT (%s)::pg_catalog.text AS pgfence_lock, pgfence_row.%I FROM %s AS pgfence_row) t
                 LEFT JOIN pgfence.lock_status l ON l.name OPERATOR(pg_catalog.=) t.pgfence_lock GROUP BY t.pgfence_lock',
                g.relid::pg_catalog.text, g.fence_column, g.fence_column, src, g.fence_column, g.relid);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.guarded_fence_status() IS
  'For every table registered with pgfence.guard: per governing lock, the number of rows, the highest fence, the '
  'lock''s current token and the rows whose fence is above it (forged). A table that could run its owner''s code '
  'as the reader (a lock-name column or expression of types or functions outside pg_catalog, row-level security for '
  'a reader who is neither owner nor superuser) is not read: its figures are NULL and unchecked says why.';

-- Triggers --------------------------------------------------------------------

CREATE TRIGGER jobs_notify AFTER INSERT ON pgfence.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence.jobs_notify();
COMMENT ON TRIGGER jobs_notify ON pgfence.jobs IS
  'Wakes listening workers when jobs are inserted (NOTIFY pgfence_jobs, payload = queue).';

CREATE TRIGGER jobs_count_dead_update AFTER UPDATE ON pgfence.jobs
    FOR EACH ROW WHEN (NEW.state = 'dead' AND OLD.state <> 'dead')
    EXECUTE FUNCTION pgfence.jobs_count_dead();
COMMENT ON TRIGGER jobs_count_dead_update ON pgfence.jobs IS
  'Counts a job that goes dead (failed its last attempt, gave up, or its claim expired with no attempts left). '
  'The WHEN clause is checked without calling the function, so other updates (claims, completions, heartbeats) '
  'do not run it.';

CREATE TRIGGER jobs_count_dead_insert AFTER INSERT ON pgfence.jobs
    FOR EACH ROW WHEN (NEW.state = 'dead')
    EXECUTE FUNCTION pgfence.jobs_count_dead();
COMMENT ON TRIGGER jobs_count_dead_insert ON pgfence.jobs IS
  'Counts a job inserted directly as dead (by hand; pgfence itself never does).';

CREATE CONSTRAINT TRIGGER outbox_check_token AFTER INSERT OR UPDATE OF lock_name, token ON pgfence.outbox
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgfence.outbox_check_token();
ALTER TABLE pgfence.outbox ENABLE ALWAYS TRIGGER outbox_check_token;
COMMENT ON TRIGGER outbox_check_token ON pgfence.outbox IS
  'At COMMIT: the intent''s token must still be the latest grant of its lock (lock row locked FOR SHARE until the '
  'commit ends). ENABLE ALWAYS: also with session_replication_role = replica.';

-- Views: what a DBA reads in psql at 2 a.m. -----------------------------------

-- sqlc reads these migrations as the schema and generates internal/dbsqlc from
-- them. It cannot see the columns of a function's RETURNS TABLE, so it cannot
-- read guarded_fences: that view is created through EXECUTE, which sqlc does
-- not read (no query of pgfence's reads the view).

CREATE VIEW pgfence.lock_status AS
SELECT l.name,
       (CASE WHEN l.holder IS NULL THEN 'free'
             WHEN l.expires_at > now() THEN 'held'
             ELSE 'expired' END)::text AS state,
       l.holder,
       l.token,
       l.acquired_at,
       l.renewed_at,
       l.expires_at,
       round(extract(epoch FROM (l.expires_at - now()))::numeric, 3) AS seconds_left,
       round(extract(epoch FROM (now() - l.acquired_at))::numeric, 3) AS seconds_since_grant,
       l.metadata
FROM pgfence.locks l;

COMMENT ON VIEW pgfence.lock_status IS
  'pgfence.locks with the state computed on the database clock: held (holder set, not expired), '
  'expired (holder set, lease ran out without a release), free (released or never granted).';
COMMENT ON COLUMN pgfence.lock_status.state IS 'held, expired or free, decided by now() on this server.';
COMMENT ON COLUMN pgfence.lock_status.seconds_left IS
  'Seconds until the lease expires (negative: expired that long ago; NULL: free).';
COMMENT ON COLUMN pgfence.lock_status.seconds_since_grant IS
  'Seconds since the latest grant; compare with the lease TTL to spot leases renewed far beyond it.';
COMMENT ON COLUMN pgfence.lock_status.token IS 'Fencing token of the latest grant (never decreases).';

CREATE VIEW pgfence.job_summary AS
SELECT queue,
       state,
       count(*) AS jobs,
       min(run_at) FILTER (WHERE state = 'available') AS oldest_run_at,
       round(extract(epoch FROM now() - min(run_at) FILTER (WHERE state = 'available' AND run_at <= now()))::numeric, 3)
           AS oldest_ready_seconds,
       count(*) FILTER (WHERE state = 'running' AND claim_expires_at <= now()) AS expired_claims,
       round(extract(epoch FROM now() - min(claim_expires_at) FILTER (WHERE state = 'running' AND claim_expires_at <= now()))::numeric, 3)
           AS oldest_expired_claim_seconds,
       max(attempts) AS max_attempts_seen
FROM pgfence.jobs
GROUP BY queue, state;

COMMENT ON VIEW pgfence.job_summary IS
  'pgfence.jobs per queue and state, on the database clock: how many, the oldest job ready to run, '
  'claims that expired without completion (a dead or stuck worker) and how long ago the oldest expired.';
COMMENT ON COLUMN pgfence.job_summary.oldest_ready_seconds IS
  'Seconds the oldest available job has been ready to run without being claimed (queue latency).';
COMMENT ON COLUMN pgfence.job_summary.expired_claims IS
  'Running jobs whose claim expired: they become claimable again; many of them mean workers die or stall.';
COMMENT ON COLUMN pgfence.job_summary.oldest_expired_claim_seconds IS
  'Seconds since the oldest expired claim ran out (NULL if none).';

-- Fence vs lock token for every guarded table. table_name comes back
-- schema-qualified from the pinned function; printed through regclass here,
-- it is qualified only when the reader's search_path does not already find it
-- (as psql's \d does). Created through EXECUTE: see the top of this section.
-- +goose StatementBegin
DO $view$
BEGIN
    EXECUTE $v$
CREATE VIEW pgfence.guarded_fences AS
SELECT coalesce(pg_catalog.to_regclass(s.table_name)::pg_catalog.text, s.table_name) AS table_name,
       s.lock_name, s.rows, s.max_fence, s.lock_token, s.forged_rows, s.unchecked
FROM pgfence.guarded_fence_status() s$v$;
    COMMENT ON VIEW pgfence.guarded_fences IS
      'Fence vs lock token for every guarded table (see pgfence.guarded_fence_status). forged_rows > 0 needs attention; '
      'so does a row with unchecked set (its table was not read).';
END
$view$;
-- +goose StatementEnd

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

-- Privileges ------------------------------------------------------------------

-- A function is created executable by PUBLIC. pgfence's are executable only by
-- their owner and the roles docs/migrations.md grants EXECUTE to (a role that
-- could run, say, pgfence.ha_bump() or pgfence.unguard() would not need any
-- table privilege to do harm). Triggers fire whatever the EXECUTE privileges.
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA pgfence FROM PUBLIC;

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
-- Everything above goes, except schema pgfence itself: it holds
-- pgfence.goose_db_version, where goose records this rollback. The schema is
-- left as the migration runner creates it, without its comment.
COMMENT ON SCHEMA pgfence IS NULL;

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

-- Detach the guards from the application's tables (their triggers and
-- generated functions), and drop the generated functions of tables dropped
-- while guarded.
-- +goose StatementBegin
DO $unguard$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT relid::oid AS oid, trigger_function FROM pgfence.guarded_tables LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = g.oid) THEN
            PERFORM pgfence.unguard(g.oid::regclass);
        ELSE
            EXECUTE format('DROP FUNCTION IF EXISTS pgfence.%I()', g.trigger_function);
        END IF;
    END LOOP;
END
$unguard$;
-- +goose StatementEnd

DROP VIEW pgfence.outbox_status;
DROP VIEW pgfence.guarded_fences;
DROP VIEW pgfence.job_summary;
DROP VIEW pgfence.lock_status;

-- The job functions return rows of pgfence.jobs: they go before the table.
DROP FUNCTION pgfence.job_purge(timestamptz, integer);
DROP FUNCTION pgfence.job_fail_tx(bigint, text, bigint, boolean);
DROP FUNCTION pgfence.job_complete_tx(bigint);
DROP FUNCTION pgfence.job_claim_tx(text, integer);
DROP FUNCTION pgfence.job_fail(bigint, bigint, bytea, text, bigint, boolean);
DROP FUNCTION pgfence.job_release(bigint[], bigint[], bytea[]);
DROP FUNCTION pgfence.job_complete(bigint[], bigint[], bytea[]);
DROP FUNCTION pgfence.job_renew(bigint[], bigint[], bytea[], bigint);
DROP FUNCTION pgfence.job_claims_refused(text, bigint[], bigint[], bytea[]);
DROP FUNCTION pgfence.job_claim(text, text, bigint, integer, bytea);
DROP FUNCTION pgfence.job_enqueue(text[], jsonb[], smallint[], timestamptz[], integer[]);

-- Their triggers go with the tables.
DROP TABLE pgfence.outbox;
DROP TABLE pgfence.ha_bumps;
DROP TABLE pgfence.ha_epoch;
DROP TABLE pgfence.job_dead_counts;
DROP TABLE pgfence.jobs;
DROP SEQUENCE pgfence.jobs_claim_token_seq;
DROP TABLE pgfence.guarded_tables;
DROP TABLE pgfence.fenced_values;
DROP TABLE pgfence.lock_queue;
DROP TABLE pgfence.locks;

DROP FUNCTION pgfence.guarded_fence_status();
DROP FUNCTION pgfence.ha_disable();
DROP FUNCTION pgfence.ha_enable();
DROP FUNCTION pgfence.ha_bump();
DROP FUNCTION pgfence.ha_gate();
DROP FUNCTION pgfence.ha_timeline();
DROP FUNCTION pgfence.outbox_enqueue(text, bigint, bytea, text, text, jsonb, integer, timestamptz);
DROP FUNCTION pgfence.outbox_check_token();
DROP FUNCTION pgfence.outbox_token_refused(text, text, bigint, bigint);
DROP FUNCTION pgfence.jobs_count_dead();
DROP FUNCTION pgfence.jobs_notify();
DROP FUNCTION pgfence.fenced_value_read(text, bigint);
DROP FUNCTION pgfence.fenced_value_delete(text, bigint);
DROP FUNCTION pgfence.fenced_value_upsert(text, jsonb, bigint, boolean);
DROP FUNCTION pgfence.fenced_value_update(text, jsonb, bigint, boolean);
DROP FUNCTION pgfence.guard(regclass, text, text, text, text, text);
DROP FUNCTION pgfence.lock_column_unsafe(regclass, text);
DROP FUNCTION pgfence.lock_source_unsafe(regclass, text);
DROP FUNCTION pgfence.attach_guard(regclass, text, text, text, text, text);
DROP FUNCTION pgfence.unguard(regclass);
DROP FUNCTION pgfence.fence_refused(text, text, text, bigint, bigint, boolean);
DROP FUNCTION pgfence.use_token(bigint);
DROP FUNCTION pgfence.lock_leave(bigint, bigint, bytea);
DROP FUNCTION pgfence.lock_handed(bigint, bigint, bytea);
DROP FUNCTION pgfence.lock_wait(text, text, bigint, bytea, bigint, bigint);
DROP FUNCTION pgfence.lock_release(text, bigint, bytea);
DROP FUNCTION pgfence.lock_renew(text, bigint, bytea, bigint);
DROP FUNCTION pgfence.lock_grant(text, text, bigint, bytea);
