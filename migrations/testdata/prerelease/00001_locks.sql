-- pgfence schema and the lease table.
--
-- The migration runner creates schema pgfence before goose runs (its version
-- table, pgfence.goose_db_version, lives there), so "IF NOT EXISTS" is needed
-- here; the same file also works when copied into an application's own goose
-- directory.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
CREATE SCHEMA IF NOT EXISTS pgfence;
COMMENT ON SCHEMA pgfence IS
  'pgfence: lease locks with fencing tokens, fenced writes and row claiming. See the pgfence README.';

CREATE TABLE pgfence.locks (
    name        text        PRIMARY KEY,
    token       bigint      NOT NULL DEFAULT 0,
    holder      text,
    acquired_at timestamptz,
    renewed_at  timestamptz,
    expires_at  timestamptz,
    metadata    jsonb,
    CONSTRAINT locks_name_length CHECK (octet_length(name) BETWEEN 1 AND 512),
    CONSTRAINT locks_token_nonnegative CHECK (token >= 0),
    CONSTRAINT locks_holder_length CHECK (holder IS NULL OR octet_length(holder) BETWEEN 1 AND 512),
    CONSTRAINT locks_holder_has_expiry CHECK ((holder IS NULL) = (expires_at IS NULL))
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

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
-- The schema is kept: it holds pgfence.goose_db_version.
DROP TABLE IF EXISTS pgfence.locks;
