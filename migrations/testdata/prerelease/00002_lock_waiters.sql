-- Waiter flag for pglock: a release sends NOTIFY only when a waiter asked
-- for it, so uncontended acquire/release cycles never take PostgreSQL's
-- cluster-wide NOTIFY commit lock.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
ALTER TABLE pgfence.locks ADD COLUMN IF NOT EXISTS waiting_since timestamptz;

COMMENT ON COLUMN pgfence.locks.waiting_since IS
  'Database time at which a waiter last asked to be woken when this lock is released (set only while the lock '
  'is held); cleared by the next grant. A release sends NOTIFY pgfence_lock_released only when it is set. '
  'Never used to decide who holds the lock.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
ALTER TABLE pgfence.locks DROP COLUMN IF EXISTS waiting_since;
