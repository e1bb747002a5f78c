-- pglock keeps a waiter's wake-up mark across grants: a release notifies
-- while the mark is under 100 seconds old, and waiters refresh it every 30
-- seconds. Only the column's description changes.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
COMMENT ON COLUMN pgfence.locks.waiting_since IS
  'Database time at which a waiter last asked to be woken when this lock is released (written only while the lock '
  'is held, at most every 30 seconds; grants and releases keep it). A release sends NOTIFY pgfence_lock_released '
  'only while it is less than 100 seconds old. Never used to decide who holds the lock.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
COMMENT ON COLUMN pgfence.locks.waiting_since IS
  'Database time at which a waiter last asked to be woken when this lock is released (set only while the lock '
  'is held); cleared by the next grant. A release sends NOTIFY pgfence_lock_released only when it is set. '
  'Never used to decide who holds the lock.';
