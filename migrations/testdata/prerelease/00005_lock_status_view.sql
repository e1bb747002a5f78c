-- Views for operators: what a DBA reads in psql at 2 a.m.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;
CREATE VIEW pgfence.lock_status AS
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

COMMENT ON VIEW pgfence.lock_status IS
  'pgfence.locks with the state computed on the database clock: held (holder set, not expired), '
  'expired (holder set, lease ran out without a release), free (released or never granted).';
COMMENT ON COLUMN pgfence.lock_status.state IS 'held, expired or free, decided by now() on this server.';
COMMENT ON COLUMN pgfence.lock_status.seconds_left IS
  'Seconds until the lease expires (negative: expired that long ago; NULL: free).';
COMMENT ON COLUMN pgfence.lock_status.seconds_since_grant IS
  'Seconds since the latest grant; compare with the lease TTL to spot leases renewed far beyond it.';
COMMENT ON COLUMN pgfence.lock_status.token IS 'Fencing token of the latest grant (never decreases).';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
DROP VIEW IF EXISTS pgfence.lock_status;
