-- pgfence epoch bump for a Patroni cluster with asynchronous replication.
-- Run once per database, as the owner of pgfence.locks (the role that ran
-- pgfence's migrations) or a superuser.
CREATE SCHEMA pgfence_ha;

-- The timeline whose grants are allowed, and how many bumps were made.
CREATE TABLE pgfence_ha.epoch (
    one       boolean PRIMARY KEY DEFAULT true CHECK (one),
    timeline  integer NOT NULL,
    bumps     integer NOT NULL DEFAULT 0,
    bumped_at timestamptz
);

-- Every lock's token on the new primary just before each bump: compare
-- with the tokens your clients were granted to see what the promotion lost.
CREATE TABLE pgfence_ha.bumps (
    timeline     integer     NOT NULL,
    bumped_at    timestamptz NOT NULL,
    name         text        NOT NULL,
    token_before bigint      NOT NULL,
    PRIMARY KEY (timeline, name)
);

-- The server's current timeline (it changes at every promotion).
CREATE FUNCTION pgfence_ha.timeline() RETURNS integer
LANGUAGE sql VOLATILE
AS $$ SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer $$;

INSERT INTO pgfence_ha.epoch (timeline) VALUES (pgfence_ha.timeline());

-- The gate: no token is issued (lock grant or job claim) on a timeline
-- whose bump has not run yet.
CREATE FUNCTION pgfence_ha.gate() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF (SELECT timeline FROM pgfence_ha.epoch) IS DISTINCT FROM pgfence_ha.timeline() THEN
        RAISE EXCEPTION 'pgfence_ha: this server was promoted and its epoch bump has not run yet'
            USING ERRCODE = 'PFHA1',
                  HINT = 'the on_role_change callback runs SELECT pgfence_ha.bump()';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER pgfence_ha_gate BEFORE INSERT ON pgfence.locks
    FOR EACH ROW EXECUTE FUNCTION pgfence_ha.gate();
CREATE TRIGGER pgfence_ha_gate_token BEFORE UPDATE OF token ON pgfence.locks
    FOR EACH ROW WHEN (NEW.token IS DISTINCT FROM OLD.token)  -- a release names token unchanged
    EXECUTE FUNCTION pgfence_ha.gate();
CREATE TRIGGER pgfence_ha_gate BEFORE UPDATE OF claim_token ON pgfence.jobs
    FOR EACH ROW EXECUTE FUNCTION pgfence_ha.gate();

-- The bump: every lock token and the claim token sequence move up by 2^32,
-- above anything the old primary can have issued, once per timeline.
CREATE FUNCTION pgfence_ha.bump() RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    tl  integer;
    cur integer;
BEGIN
    IF pg_is_in_recovery() THEN
        RAISE EXCEPTION 'pgfence_ha.bump: this server is a standby';
    END IF;
    tl := pgfence_ha.timeline();
    SELECT timeline INTO cur FROM pgfence_ha.epoch FOR UPDATE;
    IF cur = tl THEN
        RETURN false; -- already done on this timeline
    END IF;
    INSERT INTO pgfence_ha.bumps (timeline, bumped_at, name, token_before)
        SELECT tl, now(), name, token FROM pgfence.locks;
    UPDATE pgfence_ha.epoch SET timeline = tl, bumps = bumps + 1, bumped_at = now();
    UPDATE pgfence.locks SET token = token + 4294967296;
    PERFORM setval('pgfence.jobs_claim_token_seq', nextval('pgfence.jobs_claim_token_seq') + 4294967296);
    RETURN true;
END
$$;
