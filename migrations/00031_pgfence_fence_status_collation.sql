-- pgfence.guarded_fence_status() (the view pgfence.guarded_fences) reads a
-- guarded table's lock names under the database's default collation, as
-- the guards do since migration 00030. It joined pgfence.lock_status and
-- grouped the rows under the collation of the lock-name column or
-- expression: under a nondeterministic (case-insensitive) one, the rows of
-- 'orders-ACME' and 'orders-acme' made one group, counted once per matching
-- lock, and a forged row of a lock never issued hid among the rows of its
-- case variant (TestFenceStatusCollation). The comment on
-- pgfence.lock_handoff_key gives the tag as migration 00029 makes it (it
-- covers the lock's name). The Down restores 00024's body and 00010's
-- comment.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.guarded_fence_status()
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
    pass   integer;
    locked boolean;
BEGIN
    FOR g IN SELECT t.relid, t.fence_column, t.lock_name AS ln, t.lock_name_column, t.lock_name_expression
               FROM pgfence.guarded_tables t JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) t.relid LOOP
        -- Checked, then locked (ACCESS SHARE, to the end of the transaction,
        -- when the reader may: LOCK TABLE needs SELECT on the whole table,
        -- and a reader with column privileges reads without it) and checked
        -- again. Locked, the tables of the tree can neither become views nor
        -- change a column's type or enable row-level security. (Attaching a
        -- partition or child takes no lock that conflicts: one attached
        -- between the check and the read is read unchecked. The other
        -- relations a tree may hold, foreign tables, run their wrapper, not
        -- their owner's code.)
        -- A guard whose check trigger was dropped or disabled (ALTER TABLE
        -- ... DISABLE TRIGGER, by the owner of the table or of one of its
        -- partitions) checks nothing there, and an inheritance child has no
        -- trigger of its parent's: said in a row of its own, beside the
        -- figures, naming the first such table of the tree.
        WITH RECURSIVE tree (relid) AS (
            SELECT g.relid::pg_catalog.oid
            UNION
            SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree ON i.inhparent OPERATOR(pg_catalog.=) tree.relid
        )
        SELECT c.oid::pg_catalog.regclass::pg_catalog.text INTO why
          FROM tree JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) tree.relid
         WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger tg
                            WHERE tg.tgrelid OPERATOR(pg_catalog.=) c.oid
                              AND tg.tgname OPERATOR(pg_catalog.=) 'pgfence_guard_b_check'
                              AND tg.tgenabled OPERATOR(pg_catalog.=) ANY (ARRAY['O', 'A']::"char"[]))
         ORDER BY c.oid OPERATOR(pg_catalog.<>) g.relid::pg_catalog.oid, c.oid
         LIMIT 1;
        IF why IS NOT NULL THEN
            RETURN QUERY SELECT g.relid::pg_catalog.text, g.ln, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint,
                format('the guard''s trigger pgfence_guard_b_check is disabled or missing on %s: its writes are not checked '
                       '(ALTER TABLE ... ENABLE TRIGGER pgfence_guard_b_check, or attach the guard again)', why);
            why := NULL;
        END IF;
        locked := pg_catalog.has_table_privilege(g.relid, 'SELECT');
        FOR pass IN 1..2 LOOP
            WITH RECURSIVE tree (relid) AS (
                SELECT g.relid::pg_catalog.oid
                UNION
                SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree ON i.inhparent OPERATOR(pg_catalog.=) tree.relid
            )
            SELECT CASE WHEN c.oid OPERATOR(pg_catalog.=) g.relid::pg_catalog.oid
                        THEN format('it is not a table (relkind %s): reading it could run its owner''s code', c.relkind)
                        ELSE format('its partition or child %s is not a table (relkind %s): reading it could run code of its owner',
                                    c.oid::pg_catalog.regclass, c.relkind)
                   END
              INTO why
              FROM tree JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) tree.relid
             WHERE c.relkind OPERATOR(pg_catalog.<>) 'r' AND c.relkind OPERATOR(pg_catalog.<>) 'p'
             ORDER BY c.oid OPERATOR(pg_catalog.<>) g.relid::pg_catalog.oid, c.oid
             LIMIT 1;
            IF why IS NOT NULL THEN
                NULL;
            ELSIF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                            WHERE a.attrelid OPERATOR(pg_catalog.=) g.relid AND a.attname OPERATOR(pg_catalog.=) g.fence_column
                              AND NOT a.attisdropped AND a.atttypid OPERATOR(pg_catalog.=) 'pg_catalog.int8'::pg_catalog.regtype) THEN
                why := format('its fence column %I is not bigint', g.fence_column);
            ELSIF g.lock_name_column IS NOT NULL THEN
                why := pgfence.lock_column_unsafe(g.relid, g.lock_name_column);
            ELSIF g.lock_name_expression IS NOT NULL THEN
                why := pgfence.lock_source_unsafe(g.relid, g.lock_name_expression);
            END IF;
            IF why IS NULL AND NOT super
               AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                            WHERE c.oid OPERATOR(pg_catalog.=) g.relid AND c.relrowsecurity
                              AND c.relowner OPERATOR(pg_catalog.<>) reader) THEN
                why := 'it has row-level security (the owner''s policies): only its owner or a superuser reads it';
            END IF;
            EXIT WHEN why IS NOT NULL OR pass OPERATOR(pg_catalog.=) 2 OR NOT locked;
            EXECUTE format('LOCK TABLE %s IN ACCESS SHARE MODE', g.relid);
        END LOOP;
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
                 FROM (SELECT ((%s)::pg_catalog.text COLLATE pg_catalog."default") AS pgfence_lock, pgfence_row.%I FROM %s AS pgfence_row) t
                 LEFT JOIN pgfence.lock_status l ON l.name OPERATOR(pg_catalog.=) t.pgfence_lock GROUP BY t.pgfence_lock',
                g.relid::pg_catalog.text, g.fence_column, g.fence_column, src, g.fence_column, g.relid);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd

COMMENT ON FUNCTION pgfence.lock_handoff_key(bytea) IS
  'The handoff key of the lease key key: checks the tag that ends a pgfence_lock_handoff payload (hex of '
  'sha256(k || sha256(k || the payload before the tag || '' '' || the lock''s name)), since migration 00029). Bad arguments: PF011.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.guarded_fence_status()
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
    pass   integer;
    locked boolean;
BEGIN
    FOR g IN SELECT t.relid, t.fence_column, t.lock_name AS ln, t.lock_name_column, t.lock_name_expression
               FROM pgfence.guarded_tables t JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) t.relid LOOP
        -- Checked, then locked (ACCESS SHARE, to the end of the transaction,
        -- when the reader may: LOCK TABLE needs SELECT on the whole table,
        -- and a reader with column privileges reads without it) and checked
        -- again. Locked, the tables of the tree can neither become views nor
        -- change a column's type or enable row-level security. (Attaching a
        -- partition or child takes no lock that conflicts: one attached
        -- between the check and the read is read unchecked. The other
        -- relations a tree may hold, foreign tables, run their wrapper, not
        -- their owner's code.)
        -- A guard whose check trigger was dropped or disabled (ALTER TABLE
        -- ... DISABLE TRIGGER, by the owner of the table or of one of its
        -- partitions) checks nothing there, and an inheritance child has no
        -- trigger of its parent's: said in a row of its own, beside the
        -- figures, naming the first such table of the tree.
        WITH RECURSIVE tree (relid) AS (
            SELECT g.relid::pg_catalog.oid
            UNION
            SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree ON i.inhparent OPERATOR(pg_catalog.=) tree.relid
        )
        SELECT c.oid::pg_catalog.regclass::pg_catalog.text INTO why
          FROM tree JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) tree.relid
         WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger tg
                            WHERE tg.tgrelid OPERATOR(pg_catalog.=) c.oid
                              AND tg.tgname OPERATOR(pg_catalog.=) 'pgfence_guard_b_check'
                              AND tg.tgenabled OPERATOR(pg_catalog.=) ANY (ARRAY['O', 'A']::"char"[]))
         ORDER BY c.oid OPERATOR(pg_catalog.<>) g.relid::pg_catalog.oid, c.oid
         LIMIT 1;
        IF why IS NOT NULL THEN
            RETURN QUERY SELECT g.relid::pg_catalog.text, g.ln, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint,
                format('the guard''s trigger pgfence_guard_b_check is disabled or missing on %s: its writes are not checked '
                       '(ALTER TABLE ... ENABLE TRIGGER pgfence_guard_b_check, or attach the guard again)', why);
            why := NULL;
        END IF;
        locked := pg_catalog.has_table_privilege(g.relid, 'SELECT');
        FOR pass IN 1..2 LOOP
            WITH RECURSIVE tree (relid) AS (
                SELECT g.relid::pg_catalog.oid
                UNION
                SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree ON i.inhparent OPERATOR(pg_catalog.=) tree.relid
            )
            SELECT CASE WHEN c.oid OPERATOR(pg_catalog.=) g.relid::pg_catalog.oid
                        THEN format('it is not a table (relkind %s): reading it could run its owner''s code', c.relkind)
                        ELSE format('its partition or child %s is not a table (relkind %s): reading it could run code of its owner',
                                    c.oid::pg_catalog.regclass, c.relkind)
                   END
              INTO why
              FROM tree JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) tree.relid
             WHERE c.relkind OPERATOR(pg_catalog.<>) 'r' AND c.relkind OPERATOR(pg_catalog.<>) 'p'
             ORDER BY c.oid OPERATOR(pg_catalog.<>) g.relid::pg_catalog.oid, c.oid
             LIMIT 1;
            IF why IS NOT NULL THEN
                NULL;
            ELSIF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
                            WHERE a.attrelid OPERATOR(pg_catalog.=) g.relid AND a.attname OPERATOR(pg_catalog.=) g.fence_column
                              AND NOT a.attisdropped AND a.atttypid OPERATOR(pg_catalog.=) 'pg_catalog.int8'::pg_catalog.regtype) THEN
                why := format('its fence column %I is not bigint', g.fence_column);
            ELSIF g.lock_name_column IS NOT NULL THEN
                why := pgfence.lock_column_unsafe(g.relid, g.lock_name_column);
            ELSIF g.lock_name_expression IS NOT NULL THEN
                why := pgfence.lock_source_unsafe(g.relid, g.lock_name_expression);
            END IF;
            IF why IS NULL AND NOT super
               AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                            WHERE c.oid OPERATOR(pg_catalog.=) g.relid AND c.relrowsecurity
                              AND c.relowner OPERATOR(pg_catalog.<>) reader) THEN
                why := 'it has row-level security (the owner''s policies): only its owner or a superuser reads it';
            END IF;
            EXIT WHEN why IS NOT NULL OR pass OPERATOR(pg_catalog.=) 2 OR NOT locked;
            EXECUTE format('LOCK TABLE %s IN ACCESS SHARE MODE', g.relid);
        END LOOP;
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

COMMENT ON FUNCTION pgfence.lock_handoff_key(bytea) IS
  'The handoff key of the lease key key: checks the tag that ends a pgfence_lock_handoff payload (hex of '
  'sha256(k || sha256(k || the payload before the tag))). Bad arguments: PF011.';
