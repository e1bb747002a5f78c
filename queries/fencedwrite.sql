-- Fenced writes on pgfence.fenced_values. Every write returns one row that
-- says what happened, in the same round trip:
--   applied = true              the write changed the row; fence = the token
--   applied = false, a row      refused; fence = the row's fence (snapshot of
--                               the statement), which says why
--   no row at all               there is no such key
-- The second branch of each UNION ALL runs only when the first changed nothing
-- (NOT EXISTS on the CTE is evaluated once, as a gate).

-- name: FencedValueUpdate :one
-- FencedValueUpdate is the strict form: one write per row per grant (fence < token).
WITH w AS (
    UPDATE pgfence.fenced_values v
    SET value = @value, fence = @token::bigint, updated_at = pg_catalog.now()
    WHERE (v.key OPERATOR(pg_catalog.=) @key) AND (v.fence OPERATOR(pg_catalog.<) @token::bigint)
    RETURNING v.fence, v.updated_at
)
SELECT true AS applied, w.fence, w.updated_at FROM w
UNION ALL
SELECT false, c.fence, c.updated_at FROM pgfence.fenced_values c
WHERE (c.key OPERATOR(pg_catalog.=) @key) AND NOT EXISTS (SELECT 1 FROM w);

-- name: FencedValueUpdateReentrant :one
-- FencedValueUpdateReentrant is the re-entrant form: a grant may write the same row again (fence <= token).
WITH w AS (
    UPDATE pgfence.fenced_values v
    SET value = @value, fence = @token::bigint, updated_at = pg_catalog.now()
    WHERE (v.key OPERATOR(pg_catalog.=) @key) AND (v.fence OPERATOR(pg_catalog.<=) @token::bigint)
    RETURNING v.fence, v.updated_at
)
SELECT true AS applied, w.fence, w.updated_at FROM w
UNION ALL
SELECT false, c.fence, c.updated_at FROM pgfence.fenced_values c
WHERE (c.key OPERATOR(pg_catalog.=) @key) AND NOT EXISTS (SELECT 1 FROM w);

-- name: FencedValueUpsert :one
-- FencedValueUpsert inserts the key, or updates it when fence < token (strict).
WITH w AS (
    INSERT INTO pgfence.fenced_values AS t (key, value, fence, updated_at)
    VALUES (@key, @value, @token::bigint, pg_catalog.now())
    ON CONFLICT (key) DO UPDATE
    SET value = excluded.value, fence = excluded.fence, updated_at = excluded.updated_at
    WHERE (t.fence OPERATOR(pg_catalog.<) excluded.fence)
    RETURNING t.fence, t.updated_at, (t.xmax OPERATOR(pg_catalog.=) 0)::boolean AS inserted
)
SELECT true AS applied, w.fence, w.updated_at, w.inserted FROM w
UNION ALL
SELECT false, c.fence, c.updated_at, false FROM pgfence.fenced_values c
WHERE (c.key OPERATOR(pg_catalog.=) @key) AND NOT EXISTS (SELECT 1 FROM w);

-- name: FencedValueUpsertReentrant :one
-- FencedValueUpsertReentrant inserts the key, or updates it when fence <= token.
WITH w AS (
    INSERT INTO pgfence.fenced_values AS t (key, value, fence, updated_at)
    VALUES (@key, @value, @token::bigint, pg_catalog.now())
    ON CONFLICT (key) DO UPDATE
    SET value = excluded.value, fence = excluded.fence, updated_at = excluded.updated_at
    WHERE (t.fence OPERATOR(pg_catalog.<=) excluded.fence)
    RETURNING t.fence, t.updated_at, (t.xmax OPERATOR(pg_catalog.=) 0)::boolean AS inserted
)
SELECT true AS applied, w.fence, w.updated_at, w.inserted FROM w
UNION ALL
SELECT false, c.fence, c.updated_at, false FROM pgfence.fenced_values c
WHERE (c.key OPERATOR(pg_catalog.=) @key) AND NOT EXISTS (SELECT 1 FROM w);

-- name: FencedValueDelete :one
-- FencedValueDelete deletes the key unless a newer grant wrote it (fence <= token).
WITH w AS (
    DELETE FROM pgfence.fenced_values v
    WHERE (v.key OPERATOR(pg_catalog.=) @key) AND (v.fence OPERATOR(pg_catalog.<=) @token::bigint)
    RETURNING v.fence
)
SELECT true AS applied, w.fence FROM w
UNION ALL
SELECT false, c.fence FROM pgfence.fenced_values c
WHERE (c.key OPERATOR(pg_catalog.=) @key) AND NOT EXISTS (SELECT 1 FROM w);

-- name: FencedValueRead :one
-- FencedValueRead is the fenced read of a read-modify-write: it raises the row's
-- fence to the token (fence <= token) so an older grant's later write is refused.
WITH w AS (
    UPDATE pgfence.fenced_values v
    SET fence = @token::bigint
    WHERE (v.key OPERATOR(pg_catalog.=) @key) AND (v.fence OPERATOR(pg_catalog.<=) @token::bigint)
    RETURNING v.value, v.fence, v.updated_at
)
SELECT true AS applied, w.value, w.fence, w.updated_at FROM w
UNION ALL
SELECT false, c.value, c.fence, c.updated_at FROM pgfence.fenced_values c
WHERE (c.key OPERATOR(pg_catalog.=) @key) AND NOT EXISTS (SELECT 1 FROM w);

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
