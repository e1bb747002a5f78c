-- Fenced writes: a small fenced key/value table used by the generated helpers,
-- and the database-side guard a DBA can attach to any table with a fence column.
--
-- The guard is a BEFORE UPDATE row trigger. pgfence.guard() writes one trigger
-- function per guarded table (pgfence.guard_<table oid>) with the column names
-- and the lock name compiled in, so a guarded UPDATE pays for one plpgsql call
-- and, when the fence goes up, one primary-key lookup in pgfence.locks.
--
-- SQLSTATEs raised by the guard (class PF, "pgfence"):
--   PF001  the UPDATE does not raise the row's fence (stale token, replay, or a
--          writer that sends no token at all)
--   PF002  the new fence is higher than any token pgfence.locks issued for the
--          governing lock (a forged or mistyped token), or no lock governs the row

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
CREATE SCHEMA IF NOT EXISTS pgfence;

CREATE TABLE pgfence.fenced_values (
    key        text        PRIMARY KEY,
    value      jsonb       NOT NULL,
    fence      bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT fenced_values_key_length CHECK (octet_length(key) BETWEEN 1 AND 512),
    CONSTRAINT fenced_values_fence_nonnegative CHECK (fence >= 0)
);
COMMENT ON TABLE pgfence.fenced_values IS
  'Small fenced key/value store (checkpoints, cursors, a leader''s decisions). Every write carries a fencing '
  'token from pgfence.locks; a write whose token is lower than the row''s fence is refused.';
COMMENT ON COLUMN pgfence.fenced_values.key IS
  'Key chosen by the application, 1..512 bytes.';
COMMENT ON COLUMN pgfence.fenced_values.value IS
  'The stored JSON value.';
COMMENT ON COLUMN pgfence.fenced_values.fence IS
  'Highest fencing token this row accepted (0 = never written under a token). Writes with a lower token are refused.';
COMMENT ON COLUMN pgfence.fenced_values.updated_at IS
  'Database time of the latest accepted write.';

CREATE TABLE pgfence.guarded_tables (
    relid            regclass    PRIMARY KEY,
    fence_column     text        NOT NULL,
    lock_name        text,
    lock_name_column text,
    mode             text        NOT NULL,
    trigger_function text        NOT NULL,
    guarded_at       timestamptz NOT NULL DEFAULT now(),
    guarded_by       text        NOT NULL DEFAULT current_user,
    CONSTRAINT guarded_tables_one_lock_source CHECK ((lock_name IS NULL) <> (lock_name_column IS NULL)),
    CONSTRAINT guarded_tables_mode CHECK (mode IN ('strict', 'reentrant'))
);
COMMENT ON TABLE pgfence.guarded_tables IS
  'Tables with a pgfence guard trigger (see pgfence.guard / pgfence.unguard). One row per table.';
COMMENT ON COLUMN pgfence.guarded_tables.relid IS
  'The guarded table.';
COMMENT ON COLUMN pgfence.guarded_tables.fence_column IS
  'The bigint column holding the highest token each row accepted.';
COMMENT ON COLUMN pgfence.guarded_tables.lock_name IS
  'Name of the pgfence.locks row that governs every row of the table (NULL when lock_name_column is used).';
COMMENT ON COLUMN pgfence.guarded_tables.lock_name_column IS
  'Column of the guarded table whose value is the name of the governing lock (NULL when lock_name is used).';
COMMENT ON COLUMN pgfence.guarded_tables.mode IS
  'strict: every UPDATE must raise the fence; reentrant: an UPDATE that assigns the fence may keep it equal.';
COMMENT ON COLUMN pgfence.guarded_tables.trigger_function IS
  'Name of the trigger function in schema pgfence that pgfence.guard generated for this table.';
COMMENT ON COLUMN pgfence.guarded_tables.guarded_at IS
  'Database time at which the guard was attached (or last re-attached).';
COMMENT ON COLUMN pgfence.guarded_tables.guarded_by IS
  'Role that attached the guard.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.unguard(tbl regclass) RETURNS boolean
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
        had_trigger := true;
    END IF;
    -- Housekeeping: forget tables that were dropped while guarded.
    FOR fn IN DELETE FROM pgfence.guarded_tables g
              WHERE NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = g.relid)
              RETURNING trigger_function
    LOOP
        EXECUTE format('DROP FUNCTION IF EXISTS pgfence.%I()', fn);
    END LOOP;
    RETURN had_trigger;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.unguard(regclass) IS
  'Detach the pgfence guard from a table: drops its triggers and generated function and its pgfence.guarded_tables '
  'row. Returns true if a guard was attached. Safe to call on an unguarded table.';

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
COMMENT ON FUNCTION pgfence.guard(regclass, text, text, text, text) IS
  'Attach the pgfence guard to a table with a bigint fence column: an UPDATE that does not raise the fence '
  '(strict) or lowers it / leaves it unassigned (reentrant) fails with SQLSTATE PF001; a fence above the latest '
  'token of the governing lock (lock_name, or the lock named by column lock_name_column) fails with PF002. '
  'Re-attaching replaces the previous guard. Detach with pgfence.unguard().';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
-- +goose StatementBegin
DO $down$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT relid::oid AS oid, trigger_function FROM pgfence.guarded_tables LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = g.oid) THEN
            PERFORM pgfence.unguard(g.oid::regclass);
        ELSE
            EXECUTE format('DROP FUNCTION IF EXISTS pgfence.%I()', g.trigger_function);
        END IF;
    END LOOP;
END
$down$;
-- +goose StatementEnd
DROP FUNCTION IF EXISTS pgfence.guard(regclass, text, text, text, text);
DROP FUNCTION IF EXISTS pgfence.unguard(regclass);
DROP TABLE IF EXISTS pgfence.guarded_tables;
DROP TABLE IF EXISTS pgfence.fenced_values;
