-- Guard v2 and fail-closed fenced statements.
--
-- The guard now checks every change to a guarded table, not only UPDATE:
--   INSERT  the new row's fence must be the latest token of its lock (a row
--           inserted without a token, with a forged token or by a superseded
--           holder is refused);
--   UPDATE  as before (the fence must go up, strict; or stay equal when the
--           UPDATE assigns it, reentrant), and the new fence must be the
--           latest token of the row's lock;
--   DELETE  the deleting transaction must have named its token with
--           pgfence.use_token(token) (the generated FencedDelete statements
--           do it in the same statement); the token must be the latest of
--           the row's lock and not below the row's fence.
-- The governing lock comes from a fixed name, a column (plain or GENERATED
-- ... STORED: the trigger computes a generated column from the row, because a
-- BEFORE trigger sees it as NULL) or an SQL expression over the row's columns.
-- Every function here pins search_path.
--
-- SQLSTATEs (class PF):
--   PF001  guard: the change does not raise the row's fence, or carries no token
--   PF002  guard: the token was never issued for the row's lock (forged), or no lock governs the row
--   PF003  fenced statement refused: stale token (a newer grant wrote the row)
--   PF004  fenced statement refused: already applied (strict: this grant wrote the row)
--   PF005  fenced statement refused: no row with that key
--   PF006  fenced statement refused: the row changed concurrently; not applied
--   PF007  fenced statement refused: invalid token (must be > 0)
--   PF008  guard: the token is not the latest grant of the row's lock (a superseded holder)

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
ALTER TABLE pgfence.guarded_tables ADD COLUMN lock_name_expression text;
ALTER TABLE pgfence.guarded_tables DROP CONSTRAINT guarded_tables_one_lock_source;
ALTER TABLE pgfence.guarded_tables ADD CONSTRAINT guarded_tables_one_lock_source
    CHECK (pg_catalog.num_nonnulls(lock_name, lock_name_column, lock_name_expression) = 1);
COMMENT ON COLUMN pgfence.guarded_tables.lock_name_expression IS
  'SQL expression over the columns of the guarded table giving the name of the governing lock (NULL when lock_name '
  'or lock_name_column is used).';
COMMENT ON COLUMN pgfence.guarded_tables.mode IS
  'strict: every UPDATE must raise the fence; reentrant: an UPDATE that assigns the fence column may keep it equal. '
  'INSERT and DELETE are checked in both modes.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.use_token(token bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF token IS NULL OR token <= 0 THEN
        RAISE EXCEPTION 'pgfence: invalid fencing token %: must be > 0', coalesce(token::text, 'NULL')
            USING ERRCODE = 'PF007', DETAIL = format('token %s', coalesce(token::text, 'NULL'));
    END IF;
    PERFORM pg_catalog.set_config('pgfence.token', token::text, true);
    RETURN token;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.use_token(bigint) IS
  'Name the fencing token the current transaction acts under (transaction-local setting pgfence.token). The guard '
  'reads it to allow a DELETE; generated FencedDelete statements call it themselves. Returns the token.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.fence_refused(
    table_name text,
    key        text,
    mode       text,
    token      bigint,
    fence      bigint,
    row_found  boolean
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    detail text := format('token %s, fence %s, table %s, key %s',
                          coalesce(token::text, 'NULL'), coalesce(fence::text, 'NULL'), table_name, key);
BEGIN
    IF token IS NULL OR token <= 0 THEN
        RAISE EXCEPTION 'pgfence: write to % refused: invalid token %', table_name, coalesce(token::text, 'NULL')
            USING ERRCODE = 'PF007', DETAIL = detail;
    ELSIF NOT row_found THEN
        RAISE EXCEPTION 'pgfence: write to % refused: no row with key %', table_name, key
            USING ERRCODE = 'PF005', DETAIL = detail;
    ELSIF fence > token THEN
        RAISE EXCEPTION 'pgfence: write to % refused: stale token % (the row''s fence is %: a newer grant wrote it)',
                table_name, token, fence
            USING ERRCODE = 'PF003', DETAIL = detail;
    ELSIF fence = token AND mode = 'strict' THEN
        RAISE EXCEPTION 'pgfence: write to % refused: already applied (this grant, token %, wrote the row)',
                table_name, token
            USING ERRCODE = 'PF004', DETAIL = detail;
    END IF;
    RAISE EXCEPTION 'pgfence: write to % refused: the row changed concurrently; the write was not applied', table_name
        USING ERRCODE = 'PF006', DETAIL = detail;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.fence_refused(text, text, text, bigint, bigint, boolean) IS
  'Raises the error of a refused fenced statement (SQLSTATE PF003 stale token, PF004 already applied, PF005 no '
  'such row, PF006 concurrent change, PF007 invalid token) with token, fence, table and key in DETAIL. Called by '
  'the statements pgfence generates when their write changed no row, so a refused write is never a success.';

DROP FUNCTION pgfence.guard(regclass, text, text, text, text);

-- +goose StatementBegin
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
    kind       "char";
    col_type   regtype;
    generated  "char";
    fn_name    text;
    lock_src   text;  -- an expression over the table's columns
    new_src    text;  -- the lock name of NEW / OLD in the trigger: a subquery or a literal
    old_src    text;
    new_key    text;  -- the row's primary key as JSON text, from NEW / OLD
    old_key    text;
    assigned   text;
    body       text;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'pgfence.guard: table must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF num_nonnulls(lock_name, lock_name_column, lock_name_expression) <> 1 THEN
        RAISE EXCEPTION 'pgfence.guard: pass exactly one of lock_name, lock_name_column and lock_name_expression'
            USING ERRCODE = '22023';
    END IF;
    IF lock_name IS NOT NULL AND octet_length(lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.guard: lock_name must be 1..512 bytes' USING ERRCODE = '22023';
    END IF;
    IF mode IS NULL OR mode NOT IN ('strict', 'reentrant') THEN
        RAISE EXCEPTION 'pgfence.guard: mode must be ''strict'' or ''reentrant'', not %', quote_nullable(mode)
            USING ERRCODE = '22023';
    END IF;
    SELECT relkind INTO kind FROM pg_class WHERE oid = tbl;
    IF kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION 'pgfence.guard: % is not a table', tbl USING ERRCODE = '42809';
    END IF;
    SELECT atttypid::regtype INTO col_type FROM pg_attribute
     WHERE attrelid = tbl AND attname = fence_column AND attnum > 0 AND NOT attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(fence_column)
            USING ERRCODE = '42703',
                  HINT = 'Add it first: ALTER TABLE ... ADD COLUMN fence bigint NOT NULL DEFAULT 0';
    END IF;
    IF col_type <> 'bigint'::regtype THEN
        RAISE EXCEPTION 'pgfence.guard: column %.% is %, want bigint', tbl, quote_ident(fence_column), col_type
            USING ERRCODE = '42804';
    END IF;
    IF lock_name_column IS NOT NULL THEN
        SELECT a.attgenerated INTO generated FROM pg_attribute a
         WHERE a.attrelid = tbl AND a.attname = lock_name_column AND a.attnum > 0 AND NOT a.attisdropped;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(lock_name_column)
                USING ERRCODE = '42703';
        END IF;
        IF generated = 's' THEN
            -- A BEFORE trigger sees a stored generated column as NULL: compute it
            -- from the row with the column's own generation expression.
            SELECT pg_get_expr(d.adbin, d.adrelid) INTO lock_src
              FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
             WHERE d.adrelid = tbl AND a.attname = lock_name_column;
        ELSE
            -- A plain column is read from the row directly (no subquery).
            new_src := format('NEW.%I::text', lock_name_column);
            old_src := format('OLD.%I::text', lock_name_column);
        END IF;
    ELSIF lock_name_expression IS NOT NULL THEN
        IF octet_length(lock_name_expression) NOT BETWEEN 1 AND 4096 THEN
            RAISE EXCEPTION 'pgfence.guard: lock_name_expression must be 1..4096 bytes' USING ERRCODE = '22023';
        END IF;
        lock_src := lock_name_expression;
    END IF;
    IF lock_src IS NOT NULL THEN
        -- Check that the expression compiles against the table's columns (and
        -- is one expression): nothing is read.
        BEGIN
            EXECUTE format('SELECT (%s)::text FROM %s AS pgfence_row LIMIT 0', lock_src, tbl);
        EXCEPTION WHEN OTHERS THEN
            RAISE EXCEPTION 'pgfence.guard: lock name expression % does not work on %: %', lock_src, tbl, SQLERRM
                USING ERRCODE = '22023';
        END;
        new_src := format('(SELECT (%s)::text FROM (SELECT (NEW).*) AS pgfence_row)', lock_src);
        old_src := format('(SELECT (%s)::text FROM (SELECT (OLD).*) AS pgfence_row)', lock_src);
    ELSIF lock_name IS NOT NULL THEN
        new_src := quote_literal(lock_name);
        old_src := new_src;
    END IF;

    -- The row's primary key, for the errors (evaluated only when raising).
    SELECT 'pg_catalog.jsonb_build_object(' || string_agg(quote_literal(a.attname) || ', NEW.' || quote_ident(a.attname),
                                                          ', ' ORDER BY k.ord) || ')::text'
      INTO new_key
      FROM pg_index i
      CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = tbl AND i.indisprimary;
    IF new_key IS NULL THEN
        new_key := quote_literal('(no primary key)');
        old_key := new_key;
    ELSE
        old_key := replace(new_key, ', NEW.', ', OLD.');
    END IF;

    PERFORM pgfence.unguard(tbl);
    fn_name := 'guard_' || tbl::oid;

    -- In reentrant mode an UPDATE may keep the fence equal, but only if it
    -- assigns the fence column: trigger a_mark (BEFORE UPDATE OF fence, fires
    -- first by name) encodes the new fence as -1 - fence and b_check decodes it.
    -- An UPDATE that does not name the fence column arrives unmarked.
    -- (Inside these templates %% is a literal percent for RAISE; %N$ are
    -- substituted by format() here.)
    IF mode = 'reentrant' THEN
        assigned := format($b$
        IF TG_ARGV[0] = 'mark' THEN
            IF NEW.%1$I IS NULL OR NEW.%1$I < 0 THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% must not be NULL or negative',
                        quote_ident(%2$L), TG_TABLE_SCHEMA, TG_TABLE_NAME
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %2$L;
            END IF;
            NEW.%1$I := -1 - NEW.%1$I;
            RETURN NEW;
        END IF;
        IF NEW.%1$I < 0 THEN
            NEW.%1$I := -1 - NEW.%1$I;
            IF NEW.%1$I = pgf_old_fence THEN
                RETURN NEW;
            END IF;
        END IF;$b$, fence_column, fence_column);
    ELSE
        assigned := '';
    END IF;

    -- The lock name of a row: a literal, or lock_src evaluated on NEW / OLD.
    body := format($b$
#variable_conflict use_column
DECLARE
    pgf_issued    bigint;
    pgf_lock      text;
    pgf_token     bigint;
    pgf_old_fence bigint;
BEGIN
    IF TG_OP = 'DELETE' THEN
        pgf_lock := %6$s;
        pgf_token := nullif(current_setting('pgfence.token', true), '')::bigint;
        pgf_old_fence := coalesce(OLD.%1$I, 0);
        IF pgf_token IS NULL THEN
            RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% carries no fencing token', TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op DELETE, key %%s, row fence %%s, token none, lock %%s', %8$s, pgf_old_fence,
                                      coalesce(pgf_lock, 'NULL')),
                      HINT = 'Delete through a fenced statement, or call pgfence.use_token(<token>) earlier in the transaction.';
        END IF;
        IF pgf_old_fence > pgf_token THEN
            RAISE EXCEPTION 'pgfence guard: DELETE from %%.%% with stale token %% (row fence %%)',
                    TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, pgf_old_fence
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op DELETE, key %%s, row fence %%s, token %%s, lock %%s', %8$s, pgf_old_fence,
                                      pgf_token, coalesce(pgf_lock, 'NULL'));
        END IF;
    ELSE
        IF TG_OP = 'INSERT' THEN
            pgf_old_fence := 0;
        ELSE
            pgf_old_fence := coalesce(OLD.%1$I, 0);%2$s
        END IF;
        IF NEW.%1$I IS NULL OR NEW.%1$I <= pgf_old_fence THEN
            IF TG_OP = 'INSERT' OR (NEW.%1$I IS NOT NULL AND NEW.%1$I = pgf_old_fence) THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% does not raise %% (still %%): no fencing token?',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence
                    USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, new fence %%s, mode %%s', TG_OP, %7$s,
                                          pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L),
                          HINT = 'Write through a fenced statement: SET ' || quote_ident(%3$L)
                                 || ' = <token> ... WHERE <key> AND ' || quote_ident(%3$L) || ' < <token>';
            END IF;
            RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% would lower %% from %% to %% (stale token)',
                    TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL')
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('op UPDATE, key %%s, row fence %%s, new fence %%s, mode %%s', %7$s,
                                      pgf_old_fence, coalesce(NEW.%1$I::text, 'NULL'), %4$L);
        END IF;
        pgf_lock := %5$s;
        pgf_token := NEW.%1$I;
    END IF;
    SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = pgf_lock;
    IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                coalesce(pgf_issued::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  CASE TG_OP WHEN 'DELETE' THEN %8$s ELSE %7$s END, pgf_old_fence, pgf_token,
                                  coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
    END IF;
    IF pgf_token < pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
            USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  CASE TG_OP WHEN 'DELETE' THEN %8$s ELSE %7$s END, pgf_old_fence, pgf_token,
                                  pgf_lock, pgf_issued),
                  HINT = 'The lease was granted to someone else: stop and re-acquire.';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$b$, fence_column, assigned, fence_column, mode,
      new_src, old_src, new_key, old_key);

    EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
                   fn_name, body);
    EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name,
                   'pgfence guard for ' || tbl::text || ', generated by pgfence.guard(); dropped by pgfence.unguard().');
    IF mode = 'reentrant' THEN
        EXECUTE format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %I ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                       fence_column, tbl, fn_name, 'mark');
        EXECUTE format('COMMENT ON TRIGGER pgfence_guard_a_mark ON %s IS %L', tbl,
                       'pgfence guard (reentrant): marks UPDATEs that assign the fence column. See pgfence.guarded_tables.');
    END IF;
    EXECUTE format('CREATE TRIGGER pgfence_guard_b_check BEFORE INSERT OR UPDATE OR DELETE ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                   tbl, fn_name, 'check');
    EXECUTE format('COMMENT ON TRIGGER pgfence_guard_b_check ON %s IS %L', tbl,
                   'pgfence guard (' || mode || '): refuses INSERT, UPDATE and DELETE without the latest token of the row''s lock. '
                   'See pgfence.guarded_tables; detach with pgfence.unguard().');
    INSERT INTO pgfence.guarded_tables (relid, fence_column, lock_name, lock_name_column, lock_name_expression, mode, trigger_function)
    VALUES (tbl, fence_column, lock_name, lock_name_column, lock_name_expression, mode, fn_name);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.guard(regclass, text, text, text, text, text) IS
  'Attach the pgfence guard to a table with a bigint fence column. Every change needs the latest token of the row''s '
  'lock (lock_name; the lock named by column lock_name_column, plain or generated; or lock_name_expression over the '
  'row): an INSERT carries it in the fence column, an UPDATE raises the fence to it (strict) or keeps it equal while '
  'assigning it (reentrant), a DELETE names it with pgfence.use_token() in its transaction. Refusals: PF001 (no '
  'token, fence not raised), PF002 (token never issued), PF008 (superseded by a newer grant). Re-attaching replaces '
  'the previous guard. Detach with pgfence.unguard().';

-- Guarded tables get the new trigger functions.
-- +goose StatementBegin
DO $regen$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT relid, lock_name, lock_name_column, fence_column, mode FROM pgfence.guarded_tables
              WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = relid) LOOP
        PERFORM pgfence.guard(g.relid, lock_name => g.lock_name, lock_name_column => g.lock_name_column,
                              fence_column => g.fence_column, mode => g.mode);
    END LOOP;
END
$regen$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.guarded_fence_status()
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

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
-- Back to the UPDATE-only guard of migration 00003. Tables guarded by a lock
-- name expression cannot be expressed there: the Down fails for them (unguard
-- them first).
-- +goose StatementBegin
DO $chk$
BEGIN
    IF EXISTS (SELECT 1 FROM pgfence.guarded_tables WHERE lock_name_expression IS NOT NULL) THEN
        RAISE EXCEPTION 'pgfence: tables are guarded by a lock_name_expression; unguard them before migrating down';
    END IF;
END
$chk$;
-- +goose StatementEnd
CREATE TEMP TABLE pgfence_regen ON COMMIT DROP AS
    SELECT relid::oid AS relid, lock_name, lock_name_column, fence_column, mode FROM pgfence.guarded_tables;
-- +goose StatementBegin
DO $unguard$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT relid FROM pgfence_regen LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = g.relid) THEN
            PERFORM pgfence.unguard(g.relid::regclass);
        END IF;
    END LOOP;
END
$unguard$;
-- +goose StatementEnd
DROP FUNCTION pgfence.guard(regclass, text, text, text, text, text);
DROP FUNCTION pgfence.fence_refused(text, text, text, bigint, bigint, boolean);
DROP FUNCTION pgfence.use_token(bigint);
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.guarded_fence_status()
RETURNS TABLE (table_name text, lock_name text, rows bigint, max_fence bigint, lock_token bigint, forged_rows bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT relid, fence_column, guarded_tables.lock_name AS ln, lock_name_column FROM pgfence.guarded_tables LOOP
        IF g.lock_name_column IS NULL THEN
            RETURN QUERY EXECUTE format(
                'SELECT %L::text, %L::text, count(*), max(t.%I), max(l.token), count(*) FILTER (WHERE t.%I > COALESCE(l.token, 0))
                 FROM %s t LEFT JOIN pgfence.locks l ON l.name = %L',
                g.relid::text, g.ln, g.fence_column, g.fence_column, g.relid, g.ln);
        ELSE
            RETURN QUERY EXECUTE format(
                'SELECT %L::text, t.%I::text, count(*), max(t.%I), max(l.token), count(*) FILTER (WHERE t.%I > COALESCE(l.token, 0))
                 FROM %s t LEFT JOIN pgfence.locks l ON l.name = t.%I::text GROUP BY t.%I',
                g.relid::text, g.lock_name_column, g.fence_column, g.fence_column, g.relid, g.lock_name_column, g.lock_name_column);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd
ALTER TABLE pgfence.guarded_tables DROP CONSTRAINT guarded_tables_one_lock_source;
ALTER TABLE pgfence.guarded_tables DROP COLUMN lock_name_expression;
ALTER TABLE pgfence.guarded_tables ADD CONSTRAINT guarded_tables_one_lock_source
    CHECK ((lock_name IS NULL) <> (lock_name_column IS NULL));
-- +goose StatementBegin
CREATE FUNCTION pgfence.guard(
    tbl              regclass,
    lock_name        text DEFAULT NULL,
    lock_name_column text DEFAULT NULL,
    fence_column     text DEFAULT 'fence',
    mode             text DEFAULT 'strict'
) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    kind       "char";
    col_type   regtype;
    fn_name    text;
    lock_expr  text;
    assigned   text;
    body       text;
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'pgfence.guard: table must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF (lock_name IS NULL) = (lock_name_column IS NULL) THEN
        RAISE EXCEPTION 'pgfence.guard: pass exactly one of lock_name and lock_name_column'
            USING ERRCODE = '22023';
    END IF;
    IF lock_name IS NOT NULL AND octet_length(lock_name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.guard: lock_name must be 1..512 bytes' USING ERRCODE = '22023';
    END IF;
    IF mode IS NULL OR mode NOT IN ('strict', 'reentrant') THEN
        RAISE EXCEPTION 'pgfence.guard: mode must be ''strict'' or ''reentrant'', not %', quote_nullable(mode)
            USING ERRCODE = '22023';
    END IF;
    SELECT relkind INTO kind FROM pg_class WHERE oid = tbl;
    IF kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION 'pgfence.guard: % is not a table', tbl USING ERRCODE = '42809';
    END IF;
    SELECT atttypid::regtype INTO col_type FROM pg_attribute
     WHERE attrelid = tbl AND attname = fence_column AND attnum > 0 AND NOT attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(fence_column)
            USING ERRCODE = '42703',
                  HINT = 'Add it first: ALTER TABLE ... ADD COLUMN fence bigint NOT NULL DEFAULT 0';
    END IF;
    IF col_type <> 'bigint'::regtype THEN
        RAISE EXCEPTION 'pgfence.guard: column %.% is %, want bigint', tbl, quote_ident(fence_column), col_type
            USING ERRCODE = '42804';
    END IF;
    IF lock_name_column IS NOT NULL THEN
        PERFORM 1 FROM pg_attribute
         WHERE attrelid = tbl AND attname = lock_name_column AND attnum > 0 AND NOT attisdropped;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pgfence.guard: table % has no column %', tbl, quote_ident(lock_name_column)
                USING ERRCODE = '42703';
        END IF;
        lock_expr := format('NEW.%I::text', lock_name_column);
    ELSE
        lock_expr := quote_literal(lock_name);
    END IF;

    PERFORM pgfence.unguard(tbl);
    fn_name := 'guard_' || tbl::oid;

    -- In reentrant mode an UPDATE may keep the fence equal, but only if it
    -- assigns the fence column: trigger a_mark (BEFORE UPDATE OF fence, fires
    -- first by name) encodes the new fence as -1 - fence and b_check decodes it.
    -- An UPDATE that does not name the fence column arrives unmarked.
    -- (Inside these templates %% is a literal percent for RAISE; %N$ are
    -- substituted by format() here.)
    IF mode = 'reentrant' THEN
        assigned := format($b$
    IF TG_ARGV[0] = 'mark' THEN
        IF NEW.%1$I IS NULL OR NEW.%1$I < 0 THEN
            RAISE EXCEPTION 'pgfence guard: %% of %%.%% must not be NULL or negative',
                    quote_ident(%2$L), TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %2$L;
        END IF;
        NEW.%1$I := -1 - NEW.%1$I;
        RETURN NEW;
    END IF;
    IF NEW.%1$I < 0 THEN
        NEW.%1$I := -1 - NEW.%1$I;
        IF NEW.%1$I = old_fence THEN
            RETURN NEW;
        END IF;
    END IF;$b$, fence_column, fence_column);
    ELSE
        assigned := '';
    END IF;

    body := format($b$
DECLARE
    issued    bigint;
    lock_name text;
    old_fence bigint := coalesce(OLD.%1$I, 0);
BEGIN%2$s
    IF NEW.%1$I IS NULL OR NEW.%1$I <= old_fence THEN
        IF NEW.%1$I IS NOT NULL AND NEW.%1$I = old_fence THEN
            RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% does not raise %% (still %%): no fencing token?',
                    TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), old_fence
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                      DETAIL = format('row fence %%s, new fence %%s, mode %%s', old_fence, NEW.%1$I, %4$L),
                      HINT = 'Write through a fenced statement: SET ' || quote_ident(%3$L)
                             || ' = <token> ... WHERE <key> AND ' || quote_ident(%3$L) || ' < <token>';
        END IF;
        RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% would lower %% from %% to %% (stale token)',
                TG_TABLE_SCHEMA, TG_TABLE_NAME, quote_ident(%3$L), old_fence, coalesce(NEW.%1$I::text, 'NULL')
            USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('row fence %%s, new fence %%s, mode %%s', old_fence,
                                  coalesce(NEW.%1$I::text, 'NULL'), %4$L);
    END IF;
    lock_name := %5$s;
    SELECT l.token INTO issued FROM pgfence.locks l WHERE l.name = lock_name;
    IF issued IS NULL OR NEW.%1$I > issued THEN
        RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% carries token %% but lock %% issued only %%',
                TG_TABLE_SCHEMA, TG_TABLE_NAME, NEW.%1$I, coalesce(quote_literal(lock_name), 'NULL'),
                coalesce(issued::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('new fence %%s, lock %%s, latest token %%s', NEW.%1$I,
                                  coalesce(lock_name, 'NULL'), coalesce(issued::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
    END IF;
    RETURN NEW;
END
$b$, fence_column, assigned, fence_column, mode, lock_expr);

    EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql AS %L', fn_name, body);
    EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name,
                   'pgfence guard for ' || tbl::text || ', generated by pgfence.guard(); dropped by pgfence.unguard().');
    IF mode = 'reentrant' THEN
        EXECUTE format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %I ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                       fence_column, tbl, fn_name, 'mark');
        EXECUTE format('COMMENT ON TRIGGER pgfence_guard_a_mark ON %s IS %L', tbl,
                       'pgfence guard (reentrant): marks UPDATEs that assign the fence column. See pgfence.guarded_tables.');
    END IF;
    EXECUTE format('CREATE TRIGGER pgfence_guard_b_check BEFORE UPDATE ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I(%L)',
                   tbl, fn_name, 'check');
    EXECUTE format('COMMENT ON TRIGGER pgfence_guard_b_check ON %s IS %L', tbl,
                   'pgfence guard (' || mode || '): refuses UPDATEs that do not raise the fence or carry an unissued token. '
                   'See pgfence.guarded_tables; detach with pgfence.unguard().');
    INSERT INTO pgfence.guarded_tables (relid, fence_column, lock_name, lock_name_column, mode, trigger_function)
    VALUES (tbl, fence_column, lock_name, lock_name_column, mode, fn_name);
END
$fn$;
-- +goose StatementEnd
-- +goose StatementBegin
DO $regen$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT * FROM pgfence_regen WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = relid) LOOP
        PERFORM pgfence.guard(g.relid::regclass, lock_name => g.lock_name, lock_name_column => g.lock_name_column,
                              fence_column => g.fence_column, mode => g.mode);
    END LOOP;
END
$regen$;
-- +goose StatementEnd
