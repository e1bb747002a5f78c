-- With the HA epoch enabled, a lock's first grant after a failover no longer
-- reissues a token the lost primary had granted. ha_bump raises the tokens of
-- the lock rows the promoted server has; a lock whose first grant the old
-- primary acknowledged but never replicated has no row there, so its next
-- grant inserted token 1 again: two holders of token 1, and a guarded table
-- accepted the lost holder's writes (reproduced on a Patroni cluster with an
-- asynchronous standby). The gate, which runs before every insert into
-- pgfence.locks once pgfence.ha_enable() ran, now starts a new lock row at
-- bumps x 2^32 above the token the grant asked for, above anything the old
-- primary can have issued for it (TestHANewLockStartsAboveBumps). Nothing
-- changes without the epoch (no gate trigger) or before the first bump
-- (bumps 0). The Down restores 00001's gate.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.ha_gate() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF (SELECT e.timeline FROM pgfence.ha_epoch e) IS DISTINCT FROM pgfence.ha_timeline() THEN
        RAISE EXCEPTION 'pgfence: this server was promoted and its epoch bump has not run yet'
            USING ERRCODE = 'PFHA1',
                  HINT = 'the on_role_change callback runs SELECT pgfence.ha_bump()';
    END IF;
    -- A lock's first row starts above every bump so far: the lock may have
    -- been granted on a primary that was lost with its row, whose token the
    -- bump could not raise.
    IF TG_OP = 'INSERT' AND TG_TABLE_NAME = 'locks' THEN
        NEW.token := NEW.token + (SELECT e.bumps FROM pgfence.ha_epoch e)::bigint * 4294967296;
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.ha_gate() IS
  'Trigger function of the HA epoch gate (pgfence.ha_enable): refuses a grant or claim with PFHA1 until '
  'pgfence.ha_bump() has run on this server''s timeline, and starts a new lock row''s token at the number of '
  'bumps x 2^32 above the one asked for.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.ha_gate() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF (SELECT e.timeline FROM pgfence.ha_epoch e) IS DISTINCT FROM pgfence.ha_timeline() THEN
        RAISE EXCEPTION 'pgfence: this server was promoted and its epoch bump has not run yet'
            USING ERRCODE = 'PFHA1',
                  HINT = 'the on_role_change callback runs SELECT pgfence.ha_bump()';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.ha_gate() IS
  'Trigger function of the HA epoch gate (pgfence.ha_enable): refuses a grant or claim with PFHA1 until '
  'pgfence.ha_bump() has run on this server''s timeline.';
