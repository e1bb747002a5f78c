-- The reentrant guard's mark trigger fires again for every UPDATE that
-- assigns the fence column: this takes away the WHEN clause 00011 gave it.
-- The clause saved a trigger function call per row for a raised fence, but
-- the executor reads the clause from the catalog's text form and prepares it
-- in every statement, which costs more than the call it saves when the
-- statement changes one row, as every fencedwrite helper does; for a fence
-- kept equal, where the mark runs anyway, it was pure cost. Measured on one
-- server (a procedure committing after each single-row UPDATE, 20,000 of
-- them, server time only): a kept fence cost the guard about 12 us per
-- UPDATE with the clause and 8.5 without, a raised fence 15.5 and 12.3. An
-- UPDATE of 1,000 rows raising their fence pays the call for every row
-- again (about 1.4 us a row, 10.7 -> 12.1 ms per statement); a table
-- written mostly that way can have the clause back:
-- SELECT pgfence.set_mark_trigger('<table>', true), as its owner, after
-- every pgfence.guard() of it. What a guard refuses and accepts does not
-- change: the mark function checks its condition itself.
--
-- The Up re-creates the mark trigger of every reentrant guard that has the
-- clause, without it, and pgfence.guard() no longer adds it; a table the
-- migrating role may not change keeps its clause, with a WARNING (it refuses
-- and accepts the same changes). The Down gives the clause back to every
-- reentrant guard whose mark function is 00007's, as 00011's Up did.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
DO $when$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT t.relid::pg_catalog.regclass AS tbl FROM pgfence.guarded_tables t
              WHERE t.mode OPERATOR(pg_catalog.=) 'reentrant'
                AND EXISTS (SELECT 1 FROM pg_catalog.pg_trigger tg
                             WHERE tg.tgrelid OPERATOR(pg_catalog.=) t.relid
                               AND tg.tgname OPERATOR(pg_catalog.=) 'pgfence_guard_a_mark'
                               AND tg.tgqual IS NOT NULL)
              ORDER BY t.relid
    LOOP
        BEGIN
            PERFORM pgfence.set_mark_trigger(g.tbl, false);
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE WARNING 'pgfence: the guard of % keeps its mark trigger with its WHEN clause: %', g.tbl, SQLERRM
                USING HINT = 'It refuses and accepts the same changes; to make single-row UPDATEs cheaper, attach it again as the table''s owner: SELECT pgfence.guard(...).';
        END;
    END LOOP;
END
$when$;
-- +goose StatementEnd

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

COMMENT ON FUNCTION pgfence.set_mark_trigger(regclass, boolean) IS
  'Creates the reentrant guard''s mark trigger (pgfence_guard_a_mark) of tbl again, with its condition as a WHEN clause '
  '(kept_only) or without; false (and nothing changed) unless tbl has a reentrant guard with a mark function of its own. '
  'pgfence.guard() attaches the trigger without the clause; the clause pays for tables whose UPDATEs raise the fence of '
  'many rows at once. Owner only.';

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
    PERFORM pgfence.set_mark_trigger(tbl, true);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.guard(regclass, text, text, text, text, text) IS
  'Attach the fencing guard to tbl: every UPDATE, INSERT and DELETE must carry the latest token of the row''s lock '
  '(lock_name, lock_name_column or lock_name_expression; fence_column; mode strict or reentrant). Refuses a lock '
  'source that could run code of another role than pg_catalog''s.';

-- +goose StatementBegin
DO $when$
DECLARE
    g record;
BEGIN
    -- Only mark triggers without a WHEN clause: one the Up could not change
    -- is left alone here too.
    FOR g IN SELECT t.relid::pg_catalog.regclass AS tbl FROM pgfence.guarded_tables t
              WHERE t.mode OPERATOR(pg_catalog.=) 'reentrant'
                AND EXISTS (SELECT 1 FROM pg_catalog.pg_trigger tg
                             WHERE tg.tgrelid OPERATOR(pg_catalog.=) t.relid
                               AND tg.tgname OPERATOR(pg_catalog.=) 'pgfence_guard_a_mark'
                               AND tg.tgqual IS NULL)
              ORDER BY t.relid
    LOOP
        BEGIN
            PERFORM pgfence.set_mark_trigger(g.tbl, true);
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE WARNING 'pgfence: the guard of % keeps its mark trigger without a WHEN clause: %', g.tbl, SQLERRM;
        END;
    END LOOP;
END
$when$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.set_mark_trigger(regclass, boolean) IS
  'Creates the reentrant guard''s mark trigger (pgfence_guard_a_mark) of tbl again, with its condition as a WHEN clause '
  '(kept_only) or without; false (and nothing changed) unless tbl has a reentrant guard with a mark function of its own. '
  'Called by pgfence.guard().';
