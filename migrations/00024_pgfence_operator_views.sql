-- Two operator views read what they promise.
--
-- pgfence.guarded_fences (pgfence.guarded_fence_status) read every guarded
-- relation as the role reading the view, often a superuser. A guarded table's
-- owner can turn it into a view (drop the guard's trigger, empty the table,
-- CREATE RULE "_RETURN" AS ON SELECT ...): the relation keeps its oid, so the
-- guard's registration still names it, and reading it ran the owner's code as
-- the reader. A relation that is not a table, or that has a partition or child
-- that is not (a foreign table), is now listed with NULL figures and the
-- reason in unchecked, like the other relations the function does not read;
-- the others are locked (ACCESS SHARE, when the reader has SELECT on the
-- table) and checked again before they are read
-- (TestGuardedFencesRefusesNonTables).
--
-- pgfence.outbox_status joined each intent to its delivery job, so once
-- finished jobs were deleted (skiplocked.DeleteFinished, pgfence.job_purge,
-- as docs/outbox.md recommends) the delivered intents stopped being counted,
-- and a topic whose jobs were all pruned disappeared from the view,
-- outbox.Status and `pgfence outbox`. An intent whose job is gone was
-- delivered (a dead intent's job is kept while the intent is there, since
-- 00018): it now counts as delivered (TestOutboxStatusCountsPrunedDelivered).
--
-- guarded_fences also lists, in a row of its own, a guard whose check
-- trigger is disabled or missing (the table's owner may disable it): it was
-- listed as guarded while it checked nothing (TestGuardedFencesDisabledTrigger).
--
-- The Down restores 00001's function and view.

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
                 FROM (SELECT (%s)::pg_catalog.text AS pgfence_lock, pgfence_row.%I FROM %s AS pgfence_row) t
                 LEFT JOIN pgfence.lock_status l ON l.name OPERATOR(pg_catalog.=) t.pgfence_lock GROUP BY t.pgfence_lock',
                g.relid::pg_catalog.text, g.fence_column, g.fence_column, src, g.fence_column, g.relid);
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd

CREATE OR REPLACE VIEW pgfence.outbox_status AS
SELECT o.topic,
       count(*) FILTER (WHERE j.state = 'available' AND j.run_at <= now()) AS pending,
       count(*) FILTER (WHERE j.state = 'available' AND j.run_at > now()) AS retry_waiting,
       count(*) FILTER (WHERE j.state = 'running' AND j.claim_expires_at > now()) AS in_flight,
       count(*) FILTER (WHERE j.state = 'running' AND j.claim_expires_at <= now()) AS expired_claims,
       count(*) FILTER (WHERE j.state = 'completed' OR j.id IS NULL) AS delivered,
       count(*) FILTER (WHERE j.state = 'dead') AS dead,
       round(extract(epoch FROM now() - min(o.created_at) FILTER (WHERE j.state IN ('available', 'running')))::numeric, 3)
           AS oldest_undelivered_seconds,
       max(j.attempts) FILTER (WHERE j.state IN ('available', 'running')) AS max_attempts_undelivered
FROM pgfence.outbox o
LEFT JOIN pgfence.jobs j ON j.id = o.id
GROUP BY o.topic;
-- sqlc reads a replaced view as a new one: its comments again.
COMMENT ON VIEW pgfence.outbox_status IS
  'pgfence.outbox per topic, on the database clock: intents pending (due, not claimed), waiting for a retry, in '
  'flight (claimed by a dispatcher), with an expired claim (a dispatcher died or stalled), delivered, dead (gave up '
  'after max_attempts, or refused permanently), and the age of the oldest undelivered intent. Reads every intent.';
COMMENT ON COLUMN pgfence.outbox_status.pending IS
  'Intents due for delivery and not claimed.';
COMMENT ON COLUMN pgfence.outbox_status.retry_waiting IS
  'Intents whose last attempt failed, waiting for their retry (or scheduled for later).';
COMMENT ON COLUMN pgfence.outbox_status.in_flight IS
  'Intents claimed by a dispatcher whose claim has not expired.';
COMMENT ON COLUMN pgfence.outbox_status.expired_claims IS
  'Intents claimed by a dispatcher that died or stalled: the next claim takes them over.';
COMMENT ON COLUMN pgfence.outbox_status.dead IS
  'Intents that will not be delivered: every attempt failed, or the receiver refused them permanently. Needs a human.';
COMMENT ON COLUMN pgfence.outbox_status.oldest_undelivered_seconds IS
  'Seconds since the oldest intent not yet delivered (nor dead) was recorded; NULL if none.';
COMMENT ON COLUMN pgfence.outbox_status.delivered IS
  'Intents delivered: their job completed, or was deleted once finished (a dead intent''s job is kept).';

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

CREATE OR REPLACE VIEW pgfence.outbox_status AS
SELECT o.topic,
       count(*) FILTER (WHERE j.state = 'available' AND j.run_at <= now()) AS pending,
       count(*) FILTER (WHERE j.state = 'available' AND j.run_at > now()) AS retry_waiting,
       count(*) FILTER (WHERE j.state = 'running' AND j.claim_expires_at > now()) AS in_flight,
       count(*) FILTER (WHERE j.state = 'running' AND j.claim_expires_at <= now()) AS expired_claims,
       count(*) FILTER (WHERE j.state = 'completed') AS delivered,
       count(*) FILTER (WHERE j.state = 'dead') AS dead,
       round(extract(epoch FROM now() - min(o.created_at) FILTER (WHERE j.state IN ('available', 'running')))::numeric, 3)
           AS oldest_undelivered_seconds,
       max(j.attempts) FILTER (WHERE j.state IN ('available', 'running')) AS max_attempts_undelivered
FROM pgfence.outbox o
JOIN pgfence.jobs j ON j.id = o.id
GROUP BY o.topic;
COMMENT ON COLUMN pgfence.outbox_status.delivered IS NULL;
