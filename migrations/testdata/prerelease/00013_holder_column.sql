-- One name for one idea: the identity of whoever holds a lease or a claim is
-- its holder, in pgfence.locks.holder and now in pgfence.jobs.holder (before
-- this migration: claimed_by). Renaming a column is a catalog change only;
-- views and constraints follow it, and no pgfence function body names it.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE pgfence.jobs RENAME COLUMN claimed_by TO holder;
ALTER TABLE pgfence.jobs RENAME CONSTRAINT jobs_claimed_by_length TO jobs_holder_length;
COMMENT ON COLUMN pgfence.jobs.holder IS
  'Holder identity of the latest leased claim (kept after the claim ends, for operators).';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE pgfence.jobs RENAME CONSTRAINT jobs_holder_length TO jobs_claimed_by_length;
ALTER TABLE pgfence.jobs RENAME COLUMN holder TO claimed_by;
COMMENT ON COLUMN pgfence.jobs.claimed_by IS
  'Worker identity of the latest leased claim (kept after the claim ends, for operators).';
