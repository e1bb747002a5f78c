-- The reentrant guard's mark trigger fires only when it has something to
-- mark. In reentrant mode pgfence.guard() attaches two triggers: a_mark
-- (BEFORE UPDATE OF the fence column) calls the mark function, which marks a
-- fence the UPDATE assigns and keeps equal (and refuses a NULL or negative
-- one), then b_check checks the row. Since 00007 the mark function does
-- nothing else: for a fence that goes up, which is every row a new holder
-- writes, a_mark was a call that returned at once. Here a_mark gets the mark
-- function's own condition as its WHEN clause, which the executor evaluates
-- without calling anything: an UPDATE that raises the fence calls one trigger
-- function per row instead of two. What a guard refuses and accepts does not
-- change: the mark function ran its body only when that condition held.
-- (Its operators are resolved when the trigger is created, with search_path
-- pinned, and written schema-qualified besides.)
--
-- pgfence.set_mark_trigger(tbl, kept_only) creates a_mark again, with the
-- WHEN clause (kept_only) or without it, for a reentrant guard whose mark
-- function is 00007's (<trigger function>_mark); any other guard (strict,
-- or a reentrant one that kept the first version's functions, whose mark
-- marks every fence) is left as it is, and it returns false. pgfence.guard()
-- calls it after attaching. The Up gives every such guard the WHEN clause;
-- a guard whose table the migrating role may not change keeps its trigger
-- (it refuses and accepts the same changes, at the old cost), with a
-- WARNING. The Down removes the WHEN clauses (again with a WARNING for a
-- table the migrating role may not change, which keeps its clause) and
-- restores pgfence.guard as 00001 defined it.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE FUNCTION pgfence.set_mark_trigger(tbl regclass, kept_only boolean) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    g record;
BEGIN
    IF tbl IS NULL OR kept_only IS NULL THEN
        RAISE EXCEPTION 'pgfence.set_mark_trigger: arguments must not be NULL' USING ERRCODE = '22004';
    END IF;
    SELECT t.fence_column, t.trigger_function INTO g
      FROM pgfence.guarded_tables t
     WHERE t.relid OPERATOR(pg_catalog.=) tbl AND t.mode OPERATOR(pg_catalog.=) 'reentrant';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger tg JOIN pg_catalog.pg_proc p ON p.oid OPERATOR(pg_catalog.=) tg.tgfoid
                    WHERE tg.tgrelid OPERATOR(pg_catalog.=) tbl AND tg.tgname OPERATOR(pg_catalog.=) 'pgfence_guard_a_mark'
                      AND p.pronamespace OPERATOR(pg_catalog.=) 'pgfence'::pg_catalog.regnamespace
                      AND p.proname OPERATOR(pg_catalog.=) (g.trigger_function OPERATOR(pg_catalog.||) '_mark')) THEN
        RETURN false;
    END IF;
    EXECUTE pg_catalog.format('DROP TRIGGER pgfence_guard_a_mark ON %s', tbl);
    EXECUTE pg_catalog.format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %1$I ON %2$s FOR EACH ROW %3$s'
                              'EXECUTE FUNCTION pgfence.%4$I()',
                              g.fence_column, tbl,
                              CASE WHEN kept_only THEN pg_catalog.format(
                                  'WHEN (NEW.%1$I IS NULL OR NEW.%1$I OPERATOR(pg_catalog.<) 0 '
                                  'OR NEW.%1$I OPERATOR(pg_catalog.=) COALESCE(OLD.%1$I, 0)) ', g.fence_column)
                                   ELSE '' END,
                              g.trigger_function OPERATOR(pg_catalog.||) '_mark');
    EXECUTE pg_catalog.format('COMMENT ON TRIGGER pgfence_guard_a_mark ON %s IS %L', tbl,
                              'pgfence guard (reentrant): marks UPDATEs that assign the fence column. See pgfence.guarded_tables.');
    RETURN true;
END
$fn$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION pgfence.set_mark_trigger(regclass, boolean) FROM PUBLIC;
COMMENT ON FUNCTION pgfence.set_mark_trigger(regclass, boolean) IS
  'Creates the reentrant guard''s mark trigger (pgfence_guard_a_mark) of tbl again, with its condition as a WHEN clause '
  '(kept_only) or without; false (and nothing changed) unless tbl has a reentrant guard with a mark function of its own. '
  'Called by pgfence.guard().';

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
    FOR g IN SELECT t.relid::pg_catalog.regclass AS tbl FROM pgfence.guarded_tables t
              WHERE t.mode OPERATOR(pg_catalog.=) 'reentrant' ORDER BY t.relid
    LOOP
        BEGIN
            PERFORM pgfence.set_mark_trigger(g.tbl, true);
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE WARNING 'pgfence: the guard of % keeps its mark trigger without a WHEN clause: %', g.tbl, SQLERRM
                USING HINT = 'It refuses and accepts the same changes; to make it cheaper, attach it again as the table''s owner: SELECT pgfence.guard(...).';
        END;
    END LOOP;
END
$when$;
-- +goose StatementEnd

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
DO $when$
DECLARE
    g record;
BEGIN
    -- Only mark triggers with a WHEN clause: one the Up could not change
    -- is left alone here too.
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
            RAISE WARNING 'pgfence: the guard of % keeps its mark trigger with its WHEN clause: %', g.tbl, SQLERRM;
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

DROP FUNCTION pgfence.set_mark_trigger(regclass, boolean);
