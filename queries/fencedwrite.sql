-- Fenced writes on pgfence.fenced_values are calls of the fenced value
-- functions of the schema (migrations/00001_pgfence.sql, "Functions: fenced
-- values"), which hold every rule: a client in another language calls the
-- same ones. sqlc types each column from the function's OUT parameters. Each
-- call returns what happened, in the same round trip:
--   applied = true              the write changed the row; fence = the token
--   applied = false, a row      refused; fence = the row's fence, read right
--                               after the refusal, which says why
--   no row at all               there is no such key (the function's
--                               row_found is false: WHERE f.row_found)

-- name: FencedValueUpdate :one
-- FencedValueUpdate is the strict form: one write per row per grant (fence < token).
SELECT f.applied, f.fence, f.updated_at
FROM pgfence.fenced_value_update(sqlc.arg(key)::pg_catalog.text, sqlc.arg(value)::pg_catalog.jsonb, sqlc.arg(token)::bigint, false) AS f
WHERE f.row_found;

-- name: FencedValueUpdateReentrant :one
-- FencedValueUpdateReentrant is the re-entrant form: a grant may write the same row again (fence <= token).
SELECT f.applied, f.fence, f.updated_at
FROM pgfence.fenced_value_update(sqlc.arg(key)::pg_catalog.text, sqlc.arg(value)::pg_catalog.jsonb, sqlc.arg(token)::bigint, true) AS f
WHERE f.row_found;

-- name: FencedValueUpsert :one
-- FencedValueUpsert inserts the key, or updates it when fence < token (strict).
SELECT f.applied, f.fence, f.updated_at, f.inserted
FROM pgfence.fenced_value_upsert(sqlc.arg(key)::pg_catalog.text, sqlc.arg(value)::pg_catalog.jsonb, sqlc.arg(token)::bigint, false) AS f
WHERE f.row_found;

-- name: FencedValueUpsertReentrant :one
-- FencedValueUpsertReentrant inserts the key, or updates it when fence <= token.
SELECT f.applied, f.fence, f.updated_at, f.inserted
FROM pgfence.fenced_value_upsert(sqlc.arg(key)::pg_catalog.text, sqlc.arg(value)::pg_catalog.jsonb, sqlc.arg(token)::bigint, true) AS f
WHERE f.row_found;

-- name: FencedValueDelete :one
-- FencedValueDelete deletes the key unless a newer grant wrote it (fence <= token).
SELECT f.applied, f.fence
FROM pgfence.fenced_value_delete(sqlc.arg(key)::pg_catalog.text, sqlc.arg(token)::bigint) AS f
WHERE f.row_found;

-- name: FencedValueRead :one
-- FencedValueRead is the fenced read of a read-modify-write: it raises the row's
-- fence to the token (fence <= token) so an older grant's later write is refused.
SELECT f.applied, f.value, f.fence, f.updated_at
FROM pgfence.fenced_value_read(sqlc.arg(key)::pg_catalog.text, sqlc.arg(token)::bigint) AS f
WHERE f.row_found;

-- name: GetFencedValue :one
-- GetFencedValue is a plain, unfenced read (for display; not for read-modify-write).
SELECT key, value, fence, updated_at FROM pgfence.fenced_values WHERE (key OPERATOR(pg_catalog.=) @key);

-- name: FenceOf :one
-- FenceOf reads a row's current fence with a fresh snapshot (used only when a
-- concurrent change made the first answer ambiguous).
SELECT fence FROM pgfence.fenced_values WHERE (key OPERATOR(pg_catalog.=) @key);

-- name: ListGuardedTables :many
-- ListGuardedTables lists the tables carrying a pgfence guard.
SELECT relid::pg_catalog.text AS table_name, fence_column, lock_name, lock_name_column, lock_name_expression, mode,
       trigger_function, guarded_at, guarded_by,
       EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE (c.oid OPERATOR(pg_catalog.=) g.relid)) AS table_exists
FROM pgfence.guarded_tables g
ORDER BY relid::pg_catalog.text;
