-- pgfence.guarded_fences reads guarded tables without running code their
-- owners can define, and works for every form of lock name.
--
-- 1. With a table guarded by lock_name_expression, every read of the view
--    failed ("null values cannot be formatted as an SQL identifier"): the
--    column form's format('%I', lock_name_column) ran for the expression form
--    too, with NULL.
-- 2. The function runs as the role that reads the view (often a superuser
--    DBA). It cast the lock-name column to text and compared the fence
--    column: after the guard was attached, the table's owner could change
--    either column to a type of its own whose cast or operator is a function
--    it wrote, and the next read ran that function as the reader. Now a table
--    is read only when its fence column is bigint and its lock-name column
--    (column form) is text, varchar, char or name, never a domain or a type
--    of another schema; a lock-name expression is the owner's code, evaluated
--    only when it calls nothing outside pg_catalog on columns of built-in
--    types (checked on a temporary view of it, which runs nothing); and a
--    table with row-level security (whose policies are the owner's code too)
--    is read only by its owner or a superuser (who bypasses the policies).
--    Any other table is listed with NULL figures and the reason in the new
--    column unchecked.
-- 3. pgfence.guard() refuses, before it evaluates anything, a lock-name
--    column of another type than those, and a lock-name expression or
--    generation expression that calls a function, operator or type outside
--    pg_catalog: checking the expression used to plan it as the guarder,
--    which can run an owner's IMMUTABLE function on constants. The checks
--    are a wrapper, pgfence.guard(); the body it calls is pgfence.attach_guard().

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_source_unsafe(tbl regclass, src text) RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    why text;
BEGIN
    -- A temporary view of the expression: creating it parses the expression
    -- and records what it uses in pg_depend, and runs none of it.
    BEGIN
        EXECUTE format('CREATE TEMPORARY VIEW pgfence_lock_source_check AS SELECT (%s)::pg_catalog.text AS l FROM %s AS pgfence_row',
                       src, tbl);
    EXCEPTION WHEN OTHERS THEN
        RETURN format('it cannot be checked (%s)', SQLERRM);
    END;
    SELECT string_agg(DISTINCT pg_catalog.pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid), ', ') INTO why
      FROM pg_catalog.pg_depend d
      JOIN pg_catalog.pg_rewrite r ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
                                  AND d.objid OPERATOR(pg_catalog.=) r.oid
     WHERE r.ev_class OPERATOR(pg_catalog.=) 'pg_temp.pgfence_lock_source_check'::pg_catalog.regclass
       AND ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
             AND (SELECT p.pronamespace FROM pg_catalog.pg_proc p WHERE p.oid OPERATOR(pg_catalog.=) d.refobjid)
                 OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace)
         OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_operator'::pg_catalog.regclass
             AND (SELECT o.oprnamespace FROM pg_catalog.pg_operator o WHERE o.oid OPERATOR(pg_catalog.=) d.refobjid)
                 OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace)
         OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass
             AND (SELECT ty.typnamespace FROM pg_catalog.pg_type ty WHERE ty.oid OPERATOR(pg_catalog.=) d.refobjid)
                 OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace)
         OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
             AND d.refobjsubid OPERATOR(pg_catalog.>) 0
             AND EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type ty ON ty.oid OPERATOR(pg_catalog.=) a.atttypid
                          WHERE a.attrelid OPERATOR(pg_catalog.=) d.refobjid AND a.attnum OPERATOR(pg_catalog.=) d.refobjsubid
                            AND (ty.typnamespace OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace
                                 OR ty.typtype OPERATOR(pg_catalog.=) 'd'))));
    DROP VIEW pg_temp.pgfence_lock_source_check;
    IF why IS NOT NULL THEN
        RETURN format('it uses %s, which the table''s owner or another role may define', why);
    END IF;
    RETURN NULL;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_source_unsafe(regclass, text) IS
  'Why evaluating the lock-name expression src on tbl could run code of another role than pg_catalog''s (a function, '
  'operator or type outside pg_catalog, a column of a domain or of a type outside pg_catalog), or NULL when it '
  'cannot. Runs nothing of src: it inspects a temporary view of it.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.lock_column_unsafe(tbl regclass, col text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE
        WHEN a.attnum IS NULL THEN NULL  -- no such column: the caller says so
        WHEN a.atttypid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.text'::pg_catalog.regtype,
                 'pg_catalog.varchar'::pg_catalog.regtype, 'pg_catalog.bpchar'::pg_catalog.regtype,
                 'pg_catalog.name'::pg_catalog.regtype]::pg_catalog.oid[]) THEN NULL
        ELSE pg_catalog.format('its lock-name column %I is of type %s, not text, varchar, char or name (its cast to text could run the owner''s code)',
                               col, a.atttypid::pg_catalog.regtype)
    END
    FROM (SELECT 1) AS one
    LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) tbl AND a.attname OPERATOR(pg_catalog.=) col
                                        AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.lock_column_unsafe(regclass, text) IS
  'Why reading column col of tbl as a lock name could run code of the table''s owner (a type other than text, '
  'varchar, char or name: a domain or a type with its own cast), or NULL.';

-- (These statements run through EXECUTE: sqlc, which reads the migrations as
-- the schema, cannot follow a renamed function or a view created by EXECUTE.)
-- +goose StatementBegin
DO $rename$
BEGIN
    EXECUTE 'ALTER FUNCTION pgfence.guard(regclass, text, text, text, text, text) RENAME TO attach_guard';
END
$rename$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.attach_guard(regclass, text, text, text, text, text) IS
  'The body of pgfence.guard, without its checks of the lock source: call pgfence.guard.';

-- +goose StatementBegin
DO $create$
BEGIN
    EXECUTE $guard$
CREATE FUNCTION pgfence.guard(
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
$fn$
$guard$;
END
$create$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.guard(regclass, text, text, text, text, text) IS
  'Attach the fencing guard to tbl: every UPDATE, INSERT and DELETE must carry the latest token of the row''s lock '
  '(lock_name, lock_name_column or lock_name_expression; fence_column; mode strict or reentrant). Refuses a lock '
  'source that could run code of another role than pg_catalog''s.';

-- +goose StatementBegin
DO $drop$
BEGIN
    EXECUTE 'DROP VIEW pgfence.guarded_fences';
    EXECUTE 'DROP FUNCTION pgfence.guarded_fence_status()';
END
$drop$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION pgfence.guarded_fence_status()
RETURNS TABLE (table_name text, lock_name text, rows bigint, max_fence bigint, lock_token bigint, forged_rows bigint,
               unchecked text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g      record;
    src    text;
    why    text;
    reader oid := (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user);
    super  boolean := (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user);
BEGIN
    FOR g IN SELECT t.relid, t.fence_column, t.lock_name AS ln, t.lock_name_column, t.lock_name_expression,
                    c.relowner, c.relrowsecurity
               FROM pgfence.guarded_tables t JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) t.relid LOOP
        why := NULL;
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                        WHERE a.attrelid OPERATOR(pg_catalog.=) g.relid AND a.attname OPERATOR(pg_catalog.=) g.fence_column
                          AND NOT a.attisdropped AND a.atttypid OPERATOR(pg_catalog.=) 'pg_catalog.int8'::pg_catalog.regtype) THEN
            why := format('its fence column %I is not bigint', g.fence_column);
        ELSIF g.lock_name_column IS NOT NULL THEN
            why := pgfence.lock_column_unsafe(g.relid, g.lock_name_column);
        ELSIF g.lock_name_expression IS NOT NULL THEN
            why := pgfence.lock_source_unsafe(g.relid, g.lock_name_expression);
        END IF;
        IF why IS NULL AND g.relrowsecurity AND reader OPERATOR(pg_catalog.<>) g.relowner AND NOT super THEN
            why := 'it has row-level security (the owner''s policies): only its owner or a superuser reads it';
        END IF;
        IF why IS NOT NULL THEN
            RETURN QUERY SELECT g.relid::pg_catalog.text, g.ln, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, why;
            CONTINUE;
        END IF;
        IF g.ln IS NOT NULL THEN
            RETURN QUERY EXECUTE format(
                'SELECT %L::pg_catalog.text, %L::pg_catalog.text, pg_catalog.count(*), pg_catalog.max(t.%I), pg_catalog.max(l.token),
                        pg_catalog.count(*) FILTER (WHERE t.%I OPERATOR(pg_catalog.>) COALESCE(l.token, 0)), NULL::pg_catalog.text
                 FROM %s t LEFT JOIN pgfence.lock_status l ON l.name OPERATOR(pg_catalog.=) %L',
                g.relid::pg_catalog.text, g.ln, g.fence_column, g.fence_column, g.relid, g.ln);
        ELSE
            IF g.lock_name_column IS NOT NULL THEN
                src := format('pgfence_row.%I', g.lock_name_column);
            ELSE
                src := g.lock_name_expression;
            END IF;
            RETURN QUERY EXECUTE format(
                'SELECT %L::pg_catalog.text, t.pgfence_lock, pg_catalog.count(*), pg_catalog.max(t.%I), pg_catalog.max(l.token),
                        pg_catalog.count(*) FILTER (WHERE t.%I OPERATOR(pg_catalog.>) COALESCE(l.token, 0)), NULL::pg_catalog.text
                 FROM (SELECT (%s)::pg_catalog.text AS pgfence_lock, pgfence_row.%I FROM %s AS pgfence_row) t
                 LEFT JOIN pgfence.lock_status l ON l.name OPERATOR(pg_catalog.=) t.pgfence_lock GROUP BY t.pgfence_lock',
                g.relid::pg_catalog.text, g.fence_column, g.fence_column, src, g.fence_column, g.relid);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.guarded_fence_status() IS
  'For every table registered with pgfence.guard: per governing lock, the number of rows, the highest fence, the '
  'lock''s current token and the rows whose fence is above it (forged). A table that could run its owner''s code '
  'as the reader (a lock-name column or expression of types or functions outside pg_catalog, row-level security for '
  'a reader who is neither owner nor superuser) is not read: its figures are NULL and unchecked says why.';

-- (Created through EXECUTE, as in migration 00009: sqlc cannot see the
-- columns of a function's RETURNS TABLE.)
-- +goose StatementBegin
DO $view$
BEGIN
    EXECUTE $v$
CREATE VIEW pgfence.guarded_fences AS
SELECT coalesce(pg_catalog.to_regclass(s.table_name)::pg_catalog.text, s.table_name) AS table_name,
       s.lock_name, s.rows, s.max_fence, s.lock_token, s.forged_rows, s.unchecked
FROM pgfence.guarded_fence_status() s$v$;
END
$view$;
-- +goose StatementEnd
COMMENT ON VIEW pgfence.guarded_fences IS
  'Fence vs lock token for every guarded table (see pgfence.guarded_fence_status). forged_rows > 0 needs attention; '
  'so does a row with unchecked set (its table was not read).';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
DO $down$
BEGIN
    EXECUTE 'DROP VIEW pgfence.guarded_fences';
    EXECUTE 'DROP FUNCTION pgfence.guarded_fence_status()';
    EXECUTE 'DROP FUNCTION pgfence.guard(regclass, text, text, text, text, text)';
    EXECUTE 'ALTER FUNCTION pgfence.attach_guard(regclass, text, text, text, text, text) RENAME TO guard';
    EXECUTE 'DROP FUNCTION pgfence.lock_source_unsafe(regclass, text)';
    EXECUTE 'DROP FUNCTION pgfence.lock_column_unsafe(regclass, text)';
END
$down$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION pgfence.guarded_fence_status()
RETURNS TABLE (table_name text, lock_name text, rows bigint, max_fence bigint, lock_token bigint, forged_rows bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g   record;
    src text;
BEGIN
    FOR g IN SELECT relid, fence_column, guarded_tables.lock_name AS ln, lock_name_column, lock_name_expression
               FROM pgfence.guarded_tables LOOP
        IF g.ln IS NOT NULL THEN
            RETURN QUERY EXECUTE format(
                'SELECT %L::text, %L::text, count(*), max(t.%I), max(l.token), count(*) FILTER (WHERE t.%I > COALESCE(l.token, 0))
                 FROM %s t LEFT JOIN pgfence.locks l ON l.name = %L',
                g.relid::text, g.ln, g.fence_column, g.fence_column, g.relid, g.ln);
        ELSE
            src := coalesce(format('%I', g.lock_name_column), g.lock_name_expression);
            RETURN QUERY EXECUTE format(
                'SELECT %L::text, t.pgfence_lock, count(*), max(t.%I), max(l.token), count(*) FILTER (WHERE t.%I > COALESCE(l.token, 0))
                 FROM (SELECT (%s)::text AS pgfence_lock, pgfence_row.%I FROM %s AS pgfence_row) t
                 LEFT JOIN pgfence.locks l ON l.name = t.pgfence_lock GROUP BY t.pgfence_lock',
                g.relid::text, g.fence_column, g.fence_column, src, g.fence_column, g.relid);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $view$
BEGIN
    EXECUTE $v$
CREATE VIEW pgfence.guarded_fences AS
SELECT coalesce(to_regclass(s.table_name)::text, s.table_name) AS table_name,
       s.lock_name, s.rows, s.max_fence, s.lock_token, s.forged_rows
FROM pgfence.guarded_fence_status() s$v$;
END
$view$;
-- +goose StatementEnd
