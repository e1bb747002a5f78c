-- The many-leases functions keep one plan per statement. pgfence.lock_grant_many,
-- pgfence.lock_release_many and pgfence.lock_renew_many take arrays; for a
-- statement with parameters, PostgreSQL's plan cache plans it for the values
-- of each of the first five calls of a session and then keeps a generic plan
-- only if that plan is estimated no dearer than those custom ones. With the
-- small batches a Locker sends while only a few callers wait (two to five
-- elements), the custom plans looked cheaper, so every call planned each of
-- the function's statements again: measured with perf at 8 acquire+release
-- clients of one Locker on 2 cores, the planner was 12 to 15 % of the
-- server's time, and a pgbench loop of 3-element lock_grant_many calls spent
-- about 40 % of the function in it. Run with plan_cache_mode
-- force_generic_plan, each statement is planned once per session; the plans
-- are those the cache already chose for larger batches (with enable_seqscan
-- off, as since 00008, every read of pgfence.locks is an index scan).
-- Bodies, answers, grants and signatures do not change; the Down resets the
-- setting.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
ALTER FUNCTION pgfence.lock_grant_many(text[], text, bigint[], bytea) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION pgfence.lock_release_many(text[], bigint[], bytea) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]) SET plan_cache_mode = force_generic_plan;

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
ALTER FUNCTION pgfence.lock_grant_many(text[], text, bigint[], bytea) RESET plan_cache_mode;
ALTER FUNCTION pgfence.lock_release_many(text[], bigint[], bytea) RESET plan_cache_mode;
ALTER FUNCTION pgfence.lock_renew_many(text[], bigint[], bytea, bigint[]) RESET plan_cache_mode;
