-- A guard with a lock name column or expression refuses an UPDATE that moves
-- a row to another lock. The check read the lock of the new row only: a
-- holder superseded on a row's lock (lock A, token 1, A has granted 2 since)
-- who held the latest token of another lock C (3) could rewrite the row,
-- written by A's newer holder, by setting its lock name to C and its fence to
-- 3: the newer holder's write was lost (TestGuardLockMove). Such an UPDATE now
-- fails with PF001 ("moves a row from lock A to lock C") and changes nothing;
-- a row moves by being deleted under its lock's token (pgfence.use_token) and
-- inserted under the other lock's. Guards of one lock name are unchanged.
--
-- pgfence.attach_guard generates the check; the Up attaches every guard
-- again with pgfence.guard() and the options recorded in
-- pgfence.guarded_tables, as 00007 and 00015 did (owners, guarded_at and
-- guarded_by kept; a guard the migrating role cannot attach again keeps its
-- functions, with a WARNING). The Down restores 00015's attach_guard and
-- attaches every guard again with it.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.attach_guard(
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
    lookup     text;  -- the trigger's statement that reads the latest token of NEW's lock
    name_late  text;  -- sets pgf_lock from NEW when refusing ('' when lookup sets it)
    slow       text;  -- the reentrant mode's extra conditions of the slow path
    mark       text;  -- the body of the reentrant mode's mark function (trigger a_mark)
    marked     text;  -- b_check: a fence the mark kept equal (opens an IF ... ELSE)
    marked_end text;  -- b_check: closes it
    assigned   text;  -- b_check: decoding any other negative fence, as the first version did
    moved      text;  -- b_check: refuses an UPDATE that changes the row's lock ('' for one lock name)
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
        -- One statement computes the lock name and reads its latest token.
        lookup := format(E'SELECT pgf_s.pgf_name, l.token INTO pgf_lock, pgf_issued\n'
                         '      FROM (SELECT %s AS pgf_name) AS pgf_s LEFT JOIN pgfence.locks l ON l.name = pgf_s.pgf_name;',
                         new_src);
        name_late := '';
    ELSE
        IF lock_name IS NOT NULL THEN
            new_src := quote_literal(lock_name);
            old_src := new_src;
        END IF;
        -- A literal or a column of NEW: the lookup reads it as a parameter.
        lookup := format('SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = %s;', new_src);
        name_late := format(E'\n    pgf_lock := %s;', new_src);
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

    -- A token vouches for a row of its own lock only: an UPDATE that moves a
    -- row to another lock (a lock name column or expression whose value
    -- changes) would otherwise be checked against the new lock alone, and a
    -- holder superseded on the row's lock who holds the other lock's latest
    -- token would overwrite the newer holder's write. Refused; move a row by
    -- deleting it under its lock's token and inserting it under the other's.
    IF old_src IS DISTINCT FROM new_src THEN
        moved := format($b$
    IF TG_OP = 'UPDATE' AND %1$s IS DISTINCT FROM %2$s THEN
        RAISE EXCEPTION 'pgfence guard: UPDATE of %%.%% moves a row from lock %% to lock %%',
                TG_TABLE_SCHEMA, TG_TABLE_NAME, coalesce(quote_literal(%1$s), 'NULL'), coalesce(quote_literal(%2$s), 'NULL')
            USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op UPDATE, key %%s, row fence %%s, new fence %%s, lock %%s, new lock %%s', %4$s,
                                  coalesce(OLD.%5$I::text, 'NULL'), coalesce(NEW.%5$I::text, 'NULL'),
                                  coalesce(%1$s, 'NULL'), coalesce(%2$s, 'NULL')),
                  HINT = 'A token vouches only for rows of its own lock: delete the row under its lock''s token '
                         '(pgfence.use_token) and insert it under the new lock''s.';
    END IF;$b$, old_src, new_src, fence_column, old_key, fence_column);
    ELSE
        moved := '';
    END IF;

    PERFORM pgfence.unguard(tbl);
    fn_name := 'guard_' || tbl::oid;

    -- In reentrant mode an UPDATE may keep the fence equal, but only if it
    -- assigns the fence column. Trigger a_mark (BEFORE UPDATE OF fence, fires
    -- first by name) calls the mark function, <trigger function>_mark, which
    -- encodes a fence kept equal as -1 - fence (and refuses a NULL or
    -- negative one); b_check decodes it. An UPDATE that does not name the
    -- fence column arrives unmarked. A fence that goes up needs no mark: the
    -- mark function returns at once and b_check checks it as in strict mode.
    -- (The first version of the guard marked every fence a_mark saw; only a
    -- fence kept equal is decided by the mark.)
    -- (Inside these templates %% is a literal percent for RAISE; %N$ are
    -- substituted by format() here.)
    IF mode = 'reentrant' THEN
        slow := format(' OR NEW.%I < 0', fence_column);
        mark := format($b$
BEGIN
    IF NEW.%1$I IS NULL OR NEW.%1$I < 0 OR NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
        IF NEW.%1$I IS NULL OR NEW.%1$I < 0 THEN
            RAISE EXCEPTION 'pgfence guard: %% of %%.%% must not be NULL or negative',
                    quote_ident(%2$L), TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %2$L;
        END IF;
        NEW.%1$I := -1 - NEW.%1$I;
    END IF;
    RETURN NEW;
END
$b$, fence_column, fence_column);
        -- A fence the mark kept equal skips the checks of a fence not
        -- raised, not the lookup: it must still be the latest token of the
        -- row's lock (a superseded holder's reentrant write is PF008). A
        -- fence kept at 0 carries no token and is not taken as marked.
        marked := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < -1 AND -1 - NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
            NEW.%1$I := -1 - NEW.%1$I;  -- marked: the UPDATE assigns the fence and keeps it
        ELSE$b$, fence_column);
        marked_end := E'\n        END IF;';
        assigned := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < 0 THEN
            NEW.%1$I := -1 - NEW.%1$I;
        END IF;$b$, fence_column);
    ELSE
        slow := '';
        marked := '';
        marked_end := '';
        assigned := '';
    END IF;

    -- The trigger function. Its fast path, an INSERT or an UPDATE that raises
    -- the fence (OLD is NULL in an INSERT), evaluates two conditions and runs
    -- one statement, the lookup in pgfence.locks. Everything else (a DELETE,
    -- a fence not raised, the reentrant mode's mark) takes the slow path; the
    -- checks and the errors of every path are those of the first version of
    -- the guard, in the same order.
    body := format($b$
#variable_conflict use_column
DECLARE
    pgf_issued    bigint;
    pgf_lock      text;
    pgf_token     bigint;
    pgf_old_fence bigint;
BEGIN%13$s
    IF NEW.%1$I IS NULL OR NEW.%1$I <= coalesce(OLD.%1$I, 0)%10$s THEN%11$s
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
            SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = pgf_lock;
            IF pgf_issued = pgf_token THEN
                RETURN OLD;
            END IF;
            IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                        coalesce(pgf_issued::text, 'none')
                    USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                          HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
            END IF;
            IF pgf_token < pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
                    USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          pgf_lock, pgf_issued),
                          HINT = 'The lease was granted to someone else: stop and re-acquire.';
            END IF;
            RETURN OLD;
        END IF;
        pgf_old_fence := coalesce(OLD.%1$I, 0);%2$s
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
        END IF;%12$s
    END IF;
    %5$s
    IF pgf_issued = NEW.%1$I THEN
        RETURN NEW;
    END IF;
    pgf_old_fence := coalesce(OLD.%1$I, 0);
    pgf_token := NEW.%1$I;%9$s
    IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                coalesce(pgf_issued::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
    END IF;
    IF pgf_token < pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
            USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  pgf_lock, pgf_issued),
                  HINT = 'The lease was granted to someone else: stop and re-acquire.';
    END IF;
    RETURN NEW;
END
$b$, fence_column, assigned, fence_column, mode,
      lookup, old_src, new_key, old_key, name_late, slow, marked, marked_end, moved);

    -- enable_seqscan = off: the lookup reads pgfence.locks through its primary
    -- key even while the table is small enough for the planner to prefer a
    -- sequential scan, which reads every lock (and every dead version of
    -- one) on each check.
    EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql '
                   'SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS %L',
                   fn_name, body);
    -- A trigger function needs no EXECUTE to fire; nobody calls it directly.
    EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name);
    EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name,
                   'pgfence guard for ' || tbl::text || ', generated by pgfence.guard(); dropped by pgfence.unguard().');
    IF mode = 'reentrant' THEN
        EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
                       fn_name || '_mark', mark);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name || '_mark');
        EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name || '_mark',
                       'pgfence guard for ' || tbl::text || ' (reentrant): marks a fence kept equal by an UPDATE that '
                       'assigns it. Generated by pgfence.guard(); dropped by pgfence.unguard().');
        EXECUTE format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %I ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I()',
                       fence_column, tbl, fn_name || '_mark');
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

-- Attach every guard again, so that it gets the functions generated above.
-- +goose StatementBegin
DO $regen$
DECLARE
    g     record;
    owner name;
    fn    text;
    f     text;
BEGIN
    FOR g IN SELECT t.relid::oid AS oid, t.lock_name, t.lock_name_column, t.fence_column, t.mode,
                    t.lock_name_expression, t.trigger_function, t.guarded_at, t.guarded_by
               FROM pgfence.guarded_tables t
              WHERE EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.relid)
              ORDER BY t.relid::oid
    LOOP
        SELECT pg_get_userbyid(p.proowner) INTO owner FROM pg_proc p
         WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname = g.trigger_function AND p.pronargs = 0;
        BEGIN
            PERFORM pgfence.guard(g.oid::regclass, g.lock_name, g.lock_name_column, g.fence_column, g.mode,
                                  g.lock_name_expression);
            UPDATE pgfence.guarded_tables SET guarded_at = g.guarded_at, guarded_by = g.guarded_by
             WHERE relid = g.oid::regclass
            RETURNING trigger_function INTO fn;
            IF owner IS NOT NULL AND owner <> current_user THEN
                FOR f IN SELECT p.proname FROM pg_proc p
                          WHERE p.pronamespace = 'pgfence'::regnamespace AND p.pronargs = 0
                            AND p.proname IN (fn, fn || '_mark')
                LOOP
                    EXECUTE format('ALTER FUNCTION pgfence.%I() OWNER TO %I', f, owner);
                END LOOP;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'pgfence: the guard of % keeps the trigger functions it had: %', g.oid::regclass, SQLERRM
                USING HINT = 'Attach it again with pgfence.guard(), as the table''s owner, with the options in '
                             'pgfence.guarded_tables.';
        END;
    END LOOP;
END
$regen$;
-- +goose StatementEnd

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.attach_guard(
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
    lookup     text;  -- the trigger's statement that reads the latest token of NEW's lock
    name_late  text;  -- sets pgf_lock from NEW when refusing ('' when lookup sets it)
    slow       text;  -- the reentrant mode's extra conditions of the slow path
    mark       text;  -- the body of the reentrant mode's mark function (trigger a_mark)
    marked     text;  -- b_check: a fence the mark kept equal (opens an IF ... ELSE)
    marked_end text;  -- b_check: closes it
    assigned   text;  -- b_check: decoding any other negative fence, as the first version did
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
        -- One statement computes the lock name and reads its latest token.
        lookup := format(E'SELECT pgf_s.pgf_name, l.token INTO pgf_lock, pgf_issued\n'
                         '      FROM (SELECT %s AS pgf_name) AS pgf_s LEFT JOIN pgfence.locks l ON l.name = pgf_s.pgf_name;',
                         new_src);
        name_late := '';
    ELSE
        IF lock_name IS NOT NULL THEN
            new_src := quote_literal(lock_name);
            old_src := new_src;
        END IF;
        -- A literal or a column of NEW: the lookup reads it as a parameter.
        lookup := format('SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = %s;', new_src);
        name_late := format(E'\n    pgf_lock := %s;', new_src);
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
    -- assigns the fence column. Trigger a_mark (BEFORE UPDATE OF fence, fires
    -- first by name) calls the mark function, <trigger function>_mark, which
    -- encodes a fence kept equal as -1 - fence (and refuses a NULL or
    -- negative one); b_check decodes it. An UPDATE that does not name the
    -- fence column arrives unmarked. A fence that goes up needs no mark: the
    -- mark function returns at once and b_check checks it as in strict mode.
    -- (The first version of the guard marked every fence a_mark saw; only a
    -- fence kept equal is decided by the mark.)
    -- (Inside these templates %% is a literal percent for RAISE; %N$ are
    -- substituted by format() here.)
    IF mode = 'reentrant' THEN
        slow := format(' OR NEW.%I < 0', fence_column);
        mark := format($b$
BEGIN
    IF NEW.%1$I IS NULL OR NEW.%1$I < 0 OR NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
        IF NEW.%1$I IS NULL OR NEW.%1$I < 0 THEN
            RAISE EXCEPTION 'pgfence guard: %% of %%.%% must not be NULL or negative',
                    quote_ident(%2$L), TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'PF001', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %2$L;
        END IF;
        NEW.%1$I := -1 - NEW.%1$I;
    END IF;
    RETURN NEW;
END
$b$, fence_column, fence_column);
        -- A fence the mark kept equal skips the checks of a fence not
        -- raised, not the lookup: it must still be the latest token of the
        -- row's lock (a superseded holder's reentrant write is PF008). A
        -- fence kept at 0 carries no token and is not taken as marked.
        marked := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < -1 AND -1 - NEW.%1$I = coalesce(OLD.%1$I, 0) THEN
            NEW.%1$I := -1 - NEW.%1$I;  -- marked: the UPDATE assigns the fence and keeps it
        ELSE$b$, fence_column);
        marked_end := E'\n        END IF;';
        assigned := format($b$
        IF TG_OP = 'UPDATE' AND NEW.%1$I < 0 THEN
            NEW.%1$I := -1 - NEW.%1$I;
        END IF;$b$, fence_column);
    ELSE
        slow := '';
        marked := '';
        marked_end := '';
        assigned := '';
    END IF;

    -- The trigger function. Its fast path, an INSERT or an UPDATE that raises
    -- the fence (OLD is NULL in an INSERT), evaluates two conditions and runs
    -- one statement, the lookup in pgfence.locks. Everything else (a DELETE,
    -- a fence not raised, the reentrant mode's mark) takes the slow path; the
    -- checks and the errors of every path are those of the first version of
    -- the guard, in the same order.
    body := format($b$
#variable_conflict use_column
DECLARE
    pgf_issued    bigint;
    pgf_lock      text;
    pgf_token     bigint;
    pgf_old_fence bigint;
BEGIN
    IF NEW.%1$I IS NULL OR NEW.%1$I <= coalesce(OLD.%1$I, 0)%10$s THEN%11$s
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
            SELECT l.token INTO pgf_issued FROM pgfence.locks l WHERE l.name = pgf_lock;
            IF pgf_issued = pgf_token THEN
                RETURN OLD;
            END IF;
            IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                        coalesce(pgf_issued::text, 'none')
                    USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                          HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
            END IF;
            IF pgf_token < pgf_issued THEN
                RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
                    USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                          DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                          %8$s, pgf_old_fence, pgf_token,
                                          pgf_lock, pgf_issued),
                          HINT = 'The lease was granted to someone else: stop and re-acquire.';
            END IF;
            RETURN OLD;
        END IF;
        pgf_old_fence := coalesce(OLD.%1$I, 0);%2$s
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
        END IF;%12$s
    END IF;
    %5$s
    IF pgf_issued = NEW.%1$I THEN
        RETURN NEW;
    END IF;
    pgf_old_fence := coalesce(OLD.%1$I, 0);
    pgf_token := NEW.%1$I;%9$s
    IF pgf_issued IS NULL OR pgf_token > pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% issued only %%',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, coalesce(quote_literal(pgf_lock), 'NULL'),
                coalesce(pgf_issued::text, 'none')
            USING ERRCODE = 'PF002', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  coalesce(pgf_lock, 'NULL'), coalesce(pgf_issued::text, 'none')),
                  HINT = 'Tokens come from pgfence.locks; a fence may not exceed the latest token of its lock.';
    END IF;
    IF pgf_token < pgf_issued THEN
        RAISE EXCEPTION 'pgfence guard: %% of %%.%% carries token %% but lock %% has granted %% since (superseded holder)',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME, pgf_token, quote_literal(pgf_lock), pgf_issued
            USING ERRCODE = 'PF008', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = %3$L,
                  DETAIL = format('op %%s, key %%s, row fence %%s, token %%s, lock %%s, latest token %%s', TG_OP,
                                  %7$s, pgf_old_fence, pgf_token,
                                  pgf_lock, pgf_issued),
                  HINT = 'The lease was granted to someone else: stop and re-acquire.';
    END IF;
    RETURN NEW;
END
$b$, fence_column, assigned, fence_column, mode,
      lookup, old_src, new_key, old_key, name_late, slow, marked, marked_end);

    -- enable_seqscan = off: the lookup reads pgfence.locks through its primary
    -- key even while the table is small enough for the planner to prefer a
    -- sequential scan, which reads every lock (and every dead version of
    -- one) on each check.
    EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql '
                   'SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS %L',
                   fn_name, body);
    -- A trigger function needs no EXECUTE to fire; nobody calls it directly.
    EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name);
    EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name,
                   'pgfence guard for ' || tbl::text || ', generated by pgfence.guard(); dropped by pgfence.unguard().');
    IF mode = 'reentrant' THEN
        EXECUTE format('CREATE FUNCTION pgfence.%I() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS %L',
                       fn_name || '_mark', mark);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.%I() FROM PUBLIC', fn_name || '_mark');
        EXECUTE format('COMMENT ON FUNCTION pgfence.%I() IS %L', fn_name || '_mark',
                       'pgfence guard for ' || tbl::text || ' (reentrant): marks a fence kept equal by an UPDATE that '
                       'assigns it. Generated by pgfence.guard(); dropped by pgfence.unguard().');
        EXECUTE format('CREATE TRIGGER pgfence_guard_a_mark BEFORE UPDATE OF %I ON %s FOR EACH ROW EXECUTE FUNCTION pgfence.%I()',
                       fence_column, tbl, fn_name || '_mark');
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

-- Attach every guard again, so that it gets the functions generated above.
-- +goose StatementBegin
DO $regen$
DECLARE
    g     record;
    owner name;
    fn    text;
    f     text;
BEGIN
    FOR g IN SELECT t.relid::oid AS oid, t.lock_name, t.lock_name_column, t.fence_column, t.mode,
                    t.lock_name_expression, t.trigger_function, t.guarded_at, t.guarded_by
               FROM pgfence.guarded_tables t
              WHERE EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.relid)
              ORDER BY t.relid::oid
    LOOP
        SELECT pg_get_userbyid(p.proowner) INTO owner FROM pg_proc p
         WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname = g.trigger_function AND p.pronargs = 0;
        BEGIN
            PERFORM pgfence.guard(g.oid::regclass, g.lock_name, g.lock_name_column, g.fence_column, g.mode,
                                  g.lock_name_expression);
            UPDATE pgfence.guarded_tables SET guarded_at = g.guarded_at, guarded_by = g.guarded_by
             WHERE relid = g.oid::regclass
            RETURNING trigger_function INTO fn;
            IF owner IS NOT NULL AND owner <> current_user THEN
                FOR f IN SELECT p.proname FROM pg_proc p
                          WHERE p.pronamespace = 'pgfence'::regnamespace AND p.pronargs = 0
                            AND p.proname IN (fn, fn || '_mark')
                LOOP
                    EXECUTE format('ALTER FUNCTION pgfence.%I() OWNER TO %I', f, owner);
                END LOOP;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'pgfence: the guard of % keeps the trigger functions it had: %', g.oid::regclass, SQLERRM
                USING HINT = 'Attach it again with pgfence.guard(), as the table''s owner, with the options in '
                             'pgfence.guarded_tables.';
        END;
    END LOOP;
END
$regen$;
-- +goose StatementEnd
