-- Every function in schema pgfence runs with search_path pinned to
-- pg_catalog, pg_temp.
--
-- A function without a pinned search_path resolves unqualified names with the
-- caller's search_path. Anyone who can create objects in a schema on that path
-- (schema public on PostgreSQL 14 and older, by default) can define a better
-- matching overload (public.format(text, text, regclass) beats
-- pg_catalog.format(text, VARIADIC "any")) and have it run with the caller's
-- rights: a superuser reading pgfence.guarded_fences, an application writing
-- through a guard trigger, any role inserting a job. Pinned to pg_catalog,
-- pg_temp, unqualified names resolve in pg_catalog only (pg_temp, last, is
-- never searched for functions or operators).
--
-- This migration:
--   * replaces pgfence.jobs_notify() with a pinned, schema-qualified version;
--   * pins every other function of schema pgfence that has no such setting,
--     including the trigger functions pgfence.guard() generated for tables
--     guarded before (guard() pins the functions it generates from 00008 on);
--   * recreates the views (same columns, grants and comments) while this
--     migration's own search_path is pinned, so every function and operator
--     they call is bound to pg_catalog; pgfence.guarded_fences prints table
--     names relative to the reader's search_path, as before (the pinned
--     pgfence.guarded_fence_status() sees every table schema-qualified);
--   * refuses to finish if a view, constraint or column default of schema
--     pgfence calls a function or operator outside pg_catalog and pgfence
--     that another role (not the table's owner, not a superuser) owns: it
--     was bound to a planted function when an earlier migration ran with a
--     search_path that put a writable schema first.
--
-- Nothing on the lease path calls a pgfence function: pglock's statements and
-- the fenced writes are plain SQL on the tables. Pinning adds one
-- configuration save and restore per call of a plpgsql function (once per
-- INSERT statement on pgfence.jobs, once per row for guard triggers). There
-- are no SQL-language functions in the schema, so no inlining is lost.

-- +goose Up
-- Every name in this migration resolves in pg_catalog, whatever the search_path
-- of the migrating role (SET LOCAL: until this migration's transaction ends).
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.jobs_notify() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_catalog.pg_notify('pgfence_jobs', q.queue) FROM (SELECT DISTINCT queue FROM new_jobs) AS q;
    RETURN NULL;
END;
$$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $pin$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure
               FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'pgfence'::regnamespace
                AND p.prokind IN ('f', 'p')
                AND NOT ('search_path=pg_catalog, pg_temp' = ANY (coalesce(p.proconfig, '{}')))
              ORDER BY p.oid
    LOOP
        EXECUTE pg_catalog.format('ALTER ROUTINE %s SET search_path = pg_catalog, pg_temp', f);
    END LOOP;
END
$pin$;
-- +goose StatementEnd

CREATE OR REPLACE VIEW pgfence.lock_status AS
SELECT l.name,
       (CASE WHEN l.holder IS NULL THEN 'free'
             WHEN l.expires_at > now() THEN 'held'
             ELSE 'expired' END)::text AS state,
       l.holder,
       l.token,
       l.acquired_at,
       l.renewed_at,
       l.expires_at,
       round(extract(epoch FROM (l.expires_at - now()))::numeric, 3) AS seconds_left,
       round(extract(epoch FROM (now() - l.acquired_at))::numeric, 3) AS seconds_since_grant,
       l.metadata
FROM pgfence.locks l;

CREATE OR REPLACE VIEW pgfence.job_summary AS
SELECT queue,
       state,
       count(*) AS jobs,
       min(run_at) FILTER (WHERE state = 'available') AS oldest_run_at,
       round(extract(epoch FROM now() - min(run_at) FILTER (WHERE state = 'available' AND run_at <= now()))::numeric, 3)
           AS oldest_ready_seconds,
       count(*) FILTER (WHERE state = 'running' AND claim_expires_at <= now()) AS expired_claims,
       round(extract(epoch FROM now() - min(claim_expires_at) FILTER (WHERE state = 'running' AND claim_expires_at <= now()))::numeric, 3)
           AS oldest_expired_claim_seconds,
       max(attempts) AS max_attempts_seen
FROM pgfence.jobs
GROUP BY queue, state;

-- table_name comes back schema-qualified from the pinned function; printed
-- through regclass here, it is qualified only when the reader's search_path
-- does not already find it (as psql's \d does).
-- (Created through EXECUTE: sqlc, which reads these migrations as the schema,
-- cannot see the columns of a function's RETURNS TABLE; the view keeps the
-- columns of migration 00006, which is what sqlc knows.)
-- +goose StatementBegin
DO $view$
BEGIN
    EXECUTE $v$
CREATE OR REPLACE VIEW pgfence.guarded_fences AS
SELECT coalesce(to_regclass(s.table_name)::text, s.table_name) AS table_name,
       s.lock_name,
       s.rows,
       s.max_fence,
       s.lock_token,
       s.forged_rows
FROM pgfence.guarded_fence_status() s$v$;
END
$view$;
-- +goose StatementEnd

-- +goose StatementBegin
DO $check$
DECLARE
    bad text;
BEGIN
    -- A function another role owns (and can replace) that a view, constraint
    -- or default of the schema calls. Functions of the tables' owner or of a
    -- superuser are the owner's own business.
    SELECT string_agg(u.use, '; ' ORDER BY u.use) INTO bad
      FROM (SELECT format('%s uses %s (owner %s)', pg_describe_object(d.classid, d.objid, d.objsubid),
                          pg_describe_object(d.refclassid, d.refobjid, 0), fo.rolname) AS use
              FROM pg_depend d
              LEFT JOIN pg_proc p ON d.refclassid = 'pg_proc'::regclass AND p.oid = d.refobjid
              LEFT JOIN pg_operator o ON d.refclassid = 'pg_operator'::regclass AND o.oid = d.refobjid
              JOIN pg_roles fo ON fo.oid = coalesce(p.proowner, o.oprowner)
              JOIN pg_class c ON c.relnamespace = 'pgfence'::regnamespace AND c.oid = CASE d.classid
                       WHEN 'pg_rewrite'::regclass THEN (SELECT r.ev_class FROM pg_rewrite r WHERE r.oid = d.objid)
                       WHEN 'pg_constraint'::regclass THEN (SELECT k.conrelid FROM pg_constraint k WHERE k.oid = d.objid)
                       WHEN 'pg_attrdef'::regclass THEN (SELECT a.adrelid FROM pg_attrdef a WHERE a.oid = d.objid)
                   END
             WHERE coalesce(p.pronamespace, o.oprnamespace) NOT IN ('pg_catalog'::regnamespace, 'pgfence'::regnamespace)
               AND fo.oid <> c.relowner
               AND NOT fo.rolsuper) u;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'pgfence: objects of schema pgfence call functions or operators that another role owns: %', bad
            USING ERRCODE = '42501',
                  DETAIL = 'Their owner can change what they do, and they run with the rights of every role that '
                           'writes to the table or reads the view. Usually an earlier pgfence migration ran with a '
                           'search_path that put a schema writable by other roles ahead of pg_catalog.',
                  HINT = 'Give the migrating role a search_path without schemas other roles can write (pg_catalog '
                         'first), then recreate each object listed from its definition in the pgfence migrations '
                         '(ALTER TABLE ... DROP CONSTRAINT, ADD CONSTRAINT; ALTER COLUMN ... SET DEFAULT) and drop the '
                         'functions it used.';
    END IF;
END
$check$;
-- +goose StatementEnd

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
-- The functions stay pinned: resetting would reopen the hole, and nothing
-- depends on the unpinned form (jobs_notify behaves as in 00004). The
-- guarded_fences view goes back to its definition of 00006; the other views
-- were recreated unchanged.
CREATE OR REPLACE VIEW pgfence.guarded_fences AS SELECT * FROM pgfence.guarded_fence_status();
