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
--   PF009  lock table: the change would forge, lower, skip or reset a fencing
--          token: a token changed other than by +1, a new row not at token 1, a
--          renamed, deleted or truncated lock row
--   PF010  lock table: the change is not a grant, renewal, release or wait mark
--          that the lease's state allows: a grant of a held lease, a holder or
--          expiry changed without a grant, a renewal or release of a free or
--          expired lease, an expiry more than 24 hours ahead
--
-- Contents, in order: the schema; the tables with their constraints and
-- indexes (leases, the waiter queue, fenced writes, jobs, the outbox); the
-- functions (leases, fenced writes and the guard, jobs, the outbox, operator
-- views); the triggers; the views. Nothing is granted here: the grants of the
-- role an application runs as are in docs/migrations.md.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
CREATE SCHEMA IF NOT EXISTS pgfence;
COMMENT ON SCHEMA pgfence IS
  'pgfence: lease locks with fencing tokens, fenced writes and row claiming. See the pgfence README.';

-- Tables ---------------------------------------------------------------------

-- pgfence.locks: one row per lease lock. A grant raises the token by one; rows
-- are never deleted, so a token is never issued twice for a name. The
-- integrity trigger (function pgfence.locks_integrity, below) admits only the
-- changes pglock makes.
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
-- The integrity trigger of pgfence.locks admits the handoff: a grant of a held
-- lease to a holder that has a live, ungranted row in the queue. (A role that
-- may UPDATE pgfence.locks could already release a lease and grant it to
-- itself; the handoff is those two steps in one.)
CREATE TABLE pgfence.lock_queue (
    ticket        bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    wkey          bigint      NOT NULL,
    name          text        NOT NULL,
    holder        text        NOT NULL,
    ttl_us        bigint      NOT NULL,
    alive_until   timestamptz NOT NULL,
    granted_token bigint,
    wait_id       bigint      NOT NULL DEFAULT 0,
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
COMMENT ON COLUMN pgfence.lock_queue.wait_id IS
  'Random number of the current wait of the row, drawn by the waiter; sent with wkey in the handoff notification.';

-- Fenced writes: a small fenced key/value table used by the generated helpers,
-- and the registry of the database-side guard a DBA can attach to any table
-- with a fence column (pgfence.guard, below).
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
-- comes from pgfence.outbox_enqueue() or from plain SQL.
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

-- Token integrity of pgfence.locks, enforced by the database.
--
-- The run-time role needs INSERT and UPDATE on pgfence.locks for pglock's
-- statements, and table privileges cannot say which values an UPDATE may
-- write: without this trigger such a role could forge a token (SET token =
-- 1000000, after which a fenced write with that token passes the guard's
-- "token was issued" check), lower one (the next grant re-issues a used
-- token), take a held lease (SET holder = ..., expires_at = now() + 100
-- years) or insert a row at the bigint maximum (every later grant of the name
-- fails with an overflow). The trigger admits only the changes pglock's own
-- statements make (queries/pglock.sql); everything else fails and changes
-- nothing. Times are compared with now(), the clock pglock's statements use in
-- their WHERE and SET (each runs alone in its own transaction, so the trigger
-- sees the same now() as its statement).
--
-- Permitted, OLD -> NEW (held = holder set and expires_at > now()):
--   first grant   INSERT: token 1, holder set, acquired_at = now(),
--                 renewed_at NULL, now() < expires_at <= now() + 24 hours,
--                 waiting_since NULL (InsertLock, WaitGrant).
--   grant         token = OLD.token + 1 of a free or expired lease: holder
--                 set, acquired_at = now(), renewed_at NULL, now() <
--                 expires_at <= now() + 24 hours, waiting_since kept
--                 (GrantLock, WaitGrant).
--   handoff       a grant, as above, of a held lease to a holder that has a
--                 live, ungranted row for the name in pgfence.lock_queue
--                 (ReleaseLock hands the lease to the first waiter).
--   renewal       held, token, holder and acquired_at kept: renewed_at =
--                 now(), now() < expires_at <= now() + 24 hours,
--                 waiting_since kept (RenewLock; Adopt and keep-alive use it).
--   release       held, token and acquired_at kept: holder, expires_at and
--                 renewed_at NULL, waiting_since kept (ReleaseLock; the slow
--                 grant's give-back uses it).
--   wait mark     held, nothing but waiting_since changes, to now()
--                 (WaitGrant).
--   metadata      may change with any of the above, or alone while held.
--   no change     an UPDATE that writes the row as it was.
-- The name never changes, the token never changes otherwise, rows are never
-- deleted and the table is never truncated. 24 hours is pglock.MaxTTL.
--
-- The tests of pglock's changes are simple expressions, which plpgsql
-- evaluates without the planner. A subquery inside one IF would be planned
-- anew in every call: plpgsql plans such an expression through the plan cache,
-- which keeps choosing a custom plan for it (with NEW and OLD folded in, the
-- custom plan always looks cheaper), about 0.1 ms of planning per grant. So the
-- queue lookup of a handoff is a statement of its own, reached only by a
-- handoff, whose generic plan is kept.
--
-- The table's owner (the role that ran the migrations), roles that have its
-- privileges (members of it) and superusers may make any change: maintenance
-- such as the epoch bump after a failover (UPDATE pgfence.locks SET token =
-- token + 4294967296). Their changes go through the same checks first, so
-- the ownership lookup costs nothing on pglock's path.
--
-- The triggers are ENABLE ALWAYS: they also fire with session_replication_role
-- = replica (which a role may be allowed to set on PostgreSQL 15 and later).
-- Refusals are SQLSTATE PF009 (token) and PF010 (lease rule); see the top of
-- this file.
-- +goose StatementBegin
CREATE FUNCTION pgfence.locks_integrity() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    t       timestamptz := now();  -- the clock of pglock's statements
    max_ttl CONSTANT interval := interval '24 hours';  -- pglock.MaxTTL
    code    text := 'PF010';
    reason  text;
    owner   oid;
BEGIN
    -- pglock's changes, tested first: they never reach the ownership lookup.
    IF TG_OP = 'UPDATE' THEN
        IF NEW.name = OLD.name THEN
            IF NEW.token IS DISTINCT FROM OLD.token THEN
                -- A grant (GrantLock, WaitGrant, a handoff). NEW.token >
                -- OLD.token >= 0, so the difference cannot overflow. Only
                -- simple expressions here: plpgsql evaluates them without
                -- the planner (an IF holding a subquery is planned anew in
                -- every call, because its custom plan folds NEW and OLD).
                IF NEW.token > OLD.token AND NEW.token - OLD.token = 1
                   AND NEW.holder IS NOT NULL
                   AND NEW.acquired_at = t
                   AND NEW.renewed_at IS NULL
                   AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
                   AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                    IF OLD.holder IS NULL OR OLD.expires_at <= t THEN
                        RETURN NEW;  -- a free or expired lease
                    END IF;
                    -- A handoff (ReleaseLock): the holder's release grants the
                    -- lease to a live waiter queued for this name.
                    PERFORM FROM pgfence.lock_queue q
                    WHERE q.name = NEW.name AND q.holder = NEW.holder
                      AND q.granted_token IS NULL AND q.alive_until > t;
                    IF FOUND THEN
                        RETURN NEW;
                    END IF;
                END IF;
            ELSIF OLD.holder IS NOT NULL AND OLD.expires_at > t
                  AND NEW.acquired_at IS NOT DISTINCT FROM OLD.acquired_at THEN
                -- A held lease, same token.
                IF NEW.holder IS NULL THEN
                    -- A release (ReleaseLock).
                    IF NEW.expires_at IS NULL AND NEW.renewed_at IS NULL
                       AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                        RETURN NEW;
                    END IF;
                ELSIF NEW.holder = OLD.holder THEN
                    IF NEW.expires_at = OLD.expires_at
                       AND NEW.renewed_at IS NOT DISTINCT FROM OLD.renewed_at THEN
                        -- A wait mark (WaitGrant), or metadata alone.
                        IF NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since
                           OR NEW.waiting_since = t THEN
                            RETURN NEW;
                        END IF;
                    ELSIF NEW.renewed_at = t
                          AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
                          AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                        -- A renewal (RenewLock).
                        RETURN NEW;
                    END IF;
                END IF;
            ELSIF NEW IS NOT DISTINCT FROM OLD THEN
                RETURN NEW;  -- writes the row as it was
            END IF;
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        -- A first grant (InsertLock, WaitGrant).
        IF NEW.token = 1
           AND NEW.holder IS NOT NULL
           AND NEW.acquired_at = t
           AND NEW.renewed_at IS NULL
           AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
           AND NEW.waiting_since IS NULL THEN
            RETURN NEW;
        END IF;
    END IF;

    -- Not one of pglock's changes: allowed for the table's owner, roles with
    -- its privileges and superusers (maintenance), refused for everyone else.
    SELECT c.relowner INTO owner FROM pg_class c WHERE c.oid = TG_RELID;
    IF pg_has_role(current_user, owner, 'USAGE') THEN
        IF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        RETURN NEW;  -- NULL for TRUNCATE: the statement goes on
    END IF;

    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: refused TRUNCATE of %.%: lock rows are never deleted', TG_TABLE_SCHEMA, TG_TABLE_NAME
            USING ERRCODE = 'PF009', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = 'A lock name whose row is gone would be granted again from token 1, below tokens already '
                           'issued and recorded in fence columns.',
                  HINT = format('Maintenance of pgfence.locks runs as its owner (role %s) or a superuser.', owner::regrole);
    ELSIF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'pgfence: refused DELETE of lock %: lock rows are never deleted', quote_literal(OLD.name)
            USING ERRCODE = 'PF009', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = format('lock %s token %s holder %s. A lock name whose row is gone would be granted again '
                                  'from token 1, below tokens already issued.',
                                  quote_literal(OLD.name), OLD.token, quote_nullable(OLD.holder)),
                  HINT = format('Release a lease with pglock; maintenance of pgfence.locks runs as its owner '
                                '(role %s) or a superuser.', owner::regrole);
    ELSIF TG_OP = 'INSERT' THEN
        IF NEW.token IS DISTINCT FROM 1 THEN
            code := 'PF009';
            reason := 'a new lock row is the first grant of its name and starts at token 1';
        ELSE
            reason := 'a new lock row is a first grant: holder set, acquired_at = now(), renewed_at and waiting_since '
                      'NULL, expires_at after now() and at most 24 hours later';
        END IF;
        RAISE EXCEPTION 'pgfence: refused INSERT of lock %: token %, holder %: %', quote_literal(NEW.name),
                coalesce(NEW.token::text, 'NULL'), quote_nullable(NEW.holder), reason
            USING ERRCODE = code, SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = format('new row: token %s, holder %s, acquired_at %s, expires_at %s; database time %s',
                                  coalesce(NEW.token::text, 'NULL'), quote_nullable(NEW.holder),
                                  coalesce(NEW.acquired_at::text, 'NULL'), coalesce(NEW.expires_at::text, 'NULL'), t),
                  HINT = format('Locks are granted by pglock (Acquire, TryAcquire); maintenance of pgfence.locks runs '
                                'as its owner (role %s) or a superuser.', owner::regrole);
    END IF;

    -- UPDATE: say which rule the change breaks.
    IF NEW.name IS DISTINCT FROM OLD.name THEN
        code := 'PF009';
        reason := format('a lock row keeps its name (renamed to %s, it would take its token history with it)',
                         quote_nullable(NEW.name));
    ELSIF NEW.token IS NULL OR NEW.token < OLD.token THEN
        code := 'PF009';
        reason := 'tokens never go down';
    ELSIF NEW.token - OLD.token > 1 THEN
        code := 'PF009';
        reason := 'a grant raises the token by exactly 1';
    ELSIF NEW.token > OLD.token THEN
        IF OLD.holder IS NOT NULL AND OLD.expires_at > t THEN
            reason := format('the lease is held by %s until %s (database clock): only a free or expired lease can '
                             'be granted', quote_literal(OLD.holder), OLD.expires_at);
        ELSE
            reason := 'a grant sets holder, acquired_at = now(), renewed_at NULL and expires_at after now() and at '
                      'most 24 hours later, and keeps waiting_since';
        END IF;
    ELSIF OLD.holder IS NULL OR OLD.expires_at <= t THEN
        reason := format('the lease is %s: only a grant (token + 1) changes it',
                         CASE WHEN OLD.holder IS NULL THEN 'free' ELSE 'expired since ' || OLD.expires_at END);
    ELSIF NEW.holder IS DISTINCT FROM OLD.holder AND NEW.holder IS NOT NULL THEN
        reason := format('the lease is held by %s: the holder changes only with a grant (token + 1) of a free or '
                         'expired lease', quote_literal(OLD.holder));
    ELSIF NEW.acquired_at IS DISTINCT FROM OLD.acquired_at THEN
        reason := 'acquired_at changes only with a grant';
    ELSIF NEW.holder IS NULL THEN
        reason := 'a release sets holder, expires_at and renewed_at to NULL and keeps token, acquired_at and '
                  'waiting_since';
    ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at OR NEW.renewed_at IS DISTINCT FROM OLD.renewed_at THEN
        reason := 'a renewal sets renewed_at = now() and expires_at after now() and at most 24 hours later, and '
                  'keeps waiting_since';
    ELSE
        reason := 'a wait mark sets waiting_since to now()';
    END IF;
    RAISE EXCEPTION 'pgfence: refused UPDATE of lock %: token % -> %, holder % -> %: %', quote_literal(OLD.name),
            OLD.token, coalesce(NEW.token::text, 'NULL'), quote_nullable(OLD.holder), quote_nullable(NEW.holder), reason
        USING ERRCODE = code, SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
              DETAIL = format('expires_at %s -> %s, acquired_at %s -> %s, renewed_at %s -> %s, waiting_since %s -> %s; '
                              'database time %s',
                              coalesce(OLD.expires_at::text, 'NULL'), coalesce(NEW.expires_at::text, 'NULL'),
                              coalesce(OLD.acquired_at::text, 'NULL'), coalesce(NEW.acquired_at::text, 'NULL'),
                              coalesce(OLD.renewed_at::text, 'NULL'), coalesce(NEW.renewed_at::text, 'NULL'),
                              coalesce(OLD.waiting_since::text, 'NULL'), coalesce(NEW.waiting_since::text, 'NULL'), t),
              HINT = format('Leases change only through pglock (grant, renewal, release, wait mark); maintenance of '
                            'pgfence.locks, such as an epoch bump after a failover, runs as its owner (role %s) or a '
                            'superuser.', owner::regrole);
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION pgfence.locks_integrity() IS
  'Trigger of pgfence.locks: admits only the changes pglock makes (first grant at token 1, grant = token + 1 of a '
  'free or expired lease, renewal and release of a held lease by (holder, token), wait mark; expiry at most 24 hours '
  'ahead on the database clock) and refuses everything else with SQLSTATE PF009 (token forged, lowered, skipped or '
  'reset; row renamed, deleted or truncated) or PF010 (lease rule). The table owner, its members and superusers may '
  'make any change (maintenance, epoch bump).';

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
COMMENT ON FUNCTION pgfence.outbox_enqueue(text, bigint, text, text, jsonb, integer, timestamptz) IS
  'Record a side-effect intent in the current transaction, only if token is the latest grant of lock_name: returns '
  'the new intent (duplicate = false), or the intent already recorded under idempotency_key (duplicate = true, '
  'nothing recorded). Refused with PF003 (stale token), PF002 (token never issued, or no such lock) or PF007 '
  '(token <= 0); the check is repeated at COMMIT under a lock of the lock row. Delivered through a pgfence.jobs row '
  'on queue outbox:<topic> (max_attempts attempts, not before run_at).';

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
-- as its caller, the owner of pgfence's tables or a superuser (the integrity
-- trigger admits the owner's changes).
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

CREATE TRIGGER locks_integrity BEFORE INSERT OR UPDATE OR DELETE ON pgfence.locks
    FOR EACH ROW EXECUTE FUNCTION pgfence.locks_integrity();
CREATE TRIGGER locks_integrity_truncate BEFORE TRUNCATE ON pgfence.locks
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence.locks_integrity();
-- CREATE TRIGGER cannot say ENABLE ALWAYS.
ALTER TABLE pgfence.locks ENABLE ALWAYS TRIGGER locks_integrity;
ALTER TABLE pgfence.locks ENABLE ALWAYS TRIGGER locks_integrity_truncate;
COMMENT ON TRIGGER locks_integrity ON pgfence.locks IS
  'Token integrity: only pglock''s grant, renewal, release and wait mark change a lock row (see function '
  'pgfence.locks_integrity); the owner and superusers are exempt.';
COMMENT ON TRIGGER locks_integrity_truncate ON pgfence.locks IS
  'Lock rows are never deleted: TRUNCATE is refused except for the owner and superusers.';

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
DROP FUNCTION pgfence.outbox_enqueue(text, bigint, text, text, jsonb, integer, timestamptz);
DROP FUNCTION pgfence.outbox_check_token();
DROP FUNCTION pgfence.outbox_token_refused(text, text, bigint, bigint);
DROP FUNCTION pgfence.jobs_count_dead();
DROP FUNCTION pgfence.jobs_notify();
DROP FUNCTION pgfence.guard(regclass, text, text, text, text, text);
DROP FUNCTION pgfence.lock_column_unsafe(regclass, text);
DROP FUNCTION pgfence.lock_source_unsafe(regclass, text);
DROP FUNCTION pgfence.attach_guard(regclass, text, text, text, text, text);
DROP FUNCTION pgfence.unguard(regclass);
DROP FUNCTION pgfence.fence_refused(text, text, text, bigint, bigint, boolean);
DROP FUNCTION pgfence.use_token(bigint);
DROP FUNCTION pgfence.locks_integrity();
