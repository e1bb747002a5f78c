-- pgfence.guard() and pgfence.unguard() lock the table first (SHARE ROW
-- EXCLUSIVE, the lock CREATE TRIGGER takes later anyway; a partitioned
-- table's partitions with it), so that attaches and detaches of one table
-- run one after the other. Two concurrent first attaches of a table both
-- created its trigger function, and one failed with a raw unique violation
-- of pg_proc (23505); run in turn, the second is a re-attach. A guard of
-- another table does not wait. In a REPEATABLE READ or SERIALIZABLE
-- transaction the second still reads the catalog as its snapshot left it,
-- and can fail: attach in READ COMMITTED (as migrations do). What a guard
-- refuses and accepts does not change; the Down restores 00013's guard()
-- and 00007's unguard().

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.guard(
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
    -- One attach or detach of a table at a time: two concurrent first
    -- attaches both created the table's trigger function, and one failed
    -- with a unique violation of pg_proc (23505). The lock is the one
    -- CREATE TRIGGER takes anyway, taken first.
    IF tbl IS NOT NULL THEN
        EXECUTE pg_catalog.format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', tbl);
    END IF;
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.unguard(tbl regclass) RETURNS boolean
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
    -- One attach or detach of a table at a time (see guard()).
    EXECUTE pg_catalog.format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', tbl);
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
        IF to_regprocedure(format('pgfence.%I()', fn || '_mark')) IS NOT NULL THEN
            EXECUTE format('DROP FUNCTION pgfence.%I()', fn || '_mark');
        END IF;
        had_trigger := true;
    END IF;
    -- Housekeeping: forget tables that were dropped while guarded.
    FOR fn IN DELETE FROM pgfence.guarded_tables g
              WHERE NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = g.relid)
              RETURNING trigger_function
    LOOP
        EXECUTE format('DROP FUNCTION IF EXISTS pgfence.%I()', fn);
        IF to_regprocedure(format('pgfence.%I()', fn || '_mark')) IS NOT NULL THEN
            EXECUTE format('DROP FUNCTION pgfence.%I()', fn || '_mark');
        END IF;
    END LOOP;
    RETURN had_trigger;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.unguard(regclass) IS
  'Detach the pgfence guard from a table: drops its triggers and generated functions and its pgfence.guarded_tables '
  'row. Returns true if a guard was attached. Safe to call on an unguarded table.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.guard(
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.unguard(tbl regclass) RETURNS boolean
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
        IF to_regprocedure(format('pgfence.%I()', fn || '_mark')) IS NOT NULL THEN
            EXECUTE format('DROP FUNCTION pgfence.%I()', fn || '_mark');
        END IF;
        had_trigger := true;
    END IF;
    -- Housekeeping: forget tables that were dropped while guarded.
    FOR fn IN DELETE FROM pgfence.guarded_tables g
              WHERE NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = g.relid)
              RETURNING trigger_function
    LOOP
        EXECUTE format('DROP FUNCTION IF EXISTS pgfence.%I()', fn);
        IF to_regprocedure(format('pgfence.%I()', fn || '_mark')) IS NOT NULL THEN
            EXECUTE format('DROP FUNCTION pgfence.%I()', fn || '_mark');
        END IF;
    END LOOP;
    RETURN had_trigger;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.unguard(regclass) IS
  'Detach the pgfence guard from a table: drops its triggers and generated functions and its pgfence.guarded_tables '
  'row. Returns true if a guard was attached. Safe to call on an unguarded table.';
