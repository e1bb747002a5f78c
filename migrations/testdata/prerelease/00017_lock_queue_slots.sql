-- Waiter rows of pgfence.lock_queue become reusable slots, so that a hot lock
-- name stops leaving a dead index entry behind every grant.
--
-- Until now every wait inserted a row and the next release deleted it. Tickets
-- only grow, so the deleted rows piled up at the left end of the (name, ticket)
-- index, exactly where every handoff's scan for the first waiter starts, and
-- stayed there until VACUUM (autovacuum visits a database once a minute). On a
-- hot name (700 grants/s) that is tens of thousands of dead entries a minute;
-- measured on a 2-core server, a hot name served 667 grants/s with autovacuum
-- alone and 899 with the queue vacuumed every second.
--
-- Now a Locker keeps the key (wkey) of a row whose wait ended and reuses it for
-- its next wait of the same name: the row is updated in place (a new ticket, a
-- new wait_id, granted_token NULL again) instead of deleted and inserted.
-- wait_id is a random number the waiter draws for each wait: the handoff
-- notification carries it beside the key ("wkey wait_id token expiry_us"), so
-- a waiter never takes a late notification meant for an earlier wait of the
-- same key, and a listener that saw the key used cannot forge a handoff for
-- the next wait (it would need the new wait_id). No column that
-- changes is indexed any more, so these are HOT updates: no new index entry,
-- and the old row versions are pruned from the heap page without VACUUM. The
-- index on ticket goes (a handoff sorts the few rows of one name instead), the
-- primary key moves to wkey. A row whose wait ended keeps a granted_token
-- (0 if nothing was handed to it), is never served again until it is
-- re-queued, and is kept 10 seconds (its alive_until) for that; rows whose
-- alive_until has passed are still deleted by the next release of the name.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE pgfence.lock_queue ADD COLUMN wait_id bigint NOT NULL DEFAULT 0;
ALTER TABLE pgfence.lock_queue DROP CONSTRAINT lock_queue_pkey;
ALTER TABLE pgfence.lock_queue DROP CONSTRAINT lock_queue_wkey;
ALTER TABLE pgfence.lock_queue ADD CONSTRAINT lock_queue_pkey PRIMARY KEY (wkey);
DROP INDEX pgfence.lock_queue_name_ticket;
CREATE INDEX lock_queue_name ON pgfence.lock_queue (name);

COMMENT ON TABLE pgfence.lock_queue IS
  'Waiters of held pglock leases, in arrival order (ticket), one reusable row per waiter key. A release hands the '
  'lease to the first live waiter of its name. Never used to decide who holds a lock: pgfence.locks does.';
COMMENT ON COLUMN pgfence.lock_queue.ticket IS
  'Arrival order: the lowest live ticket of a name is served first. A new ticket for every wait of the row.';
COMMENT ON COLUMN pgfence.lock_queue.wkey IS
  'Key the waiter listens for on channel pgfence_lock_handoff; random, reused by its Locker for the next wait.';
COMMENT ON COLUMN pgfence.lock_queue.wait_id IS
  'Random number of the current wait of the row, drawn by the waiter; sent with wkey in the handoff notification.';
COMMENT ON COLUMN pgfence.lock_queue.granted_token IS
  'Token of the lease a release handed to this wait; NULL while it waits; 0 once the wait ended without one.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

DELETE FROM pgfence.lock_queue;
DROP INDEX pgfence.lock_queue_name;
ALTER TABLE pgfence.lock_queue DROP CONSTRAINT lock_queue_pkey;
ALTER TABLE pgfence.lock_queue ADD CONSTRAINT lock_queue_pkey PRIMARY KEY (ticket);
ALTER TABLE pgfence.lock_queue ADD CONSTRAINT lock_queue_wkey UNIQUE (wkey);
ALTER TABLE pgfence.lock_queue DROP COLUMN wait_id;
CREATE INDEX lock_queue_name_ticket ON pgfence.lock_queue (name, ticket);

COMMENT ON TABLE pgfence.lock_queue IS
  'Waiters of held pglock leases, in arrival order (ticket). A release hands the lease to the first live '
  'waiter of its name. Never used to decide who holds a lock: pgfence.locks does.';
COMMENT ON COLUMN pgfence.lock_queue.ticket IS 'Arrival order: the lowest live ticket of a name is served first.';
COMMENT ON COLUMN pgfence.lock_queue.wkey IS 'Random key the waiter listens for on channel pgfence_lock_handoff.';
COMMENT ON COLUMN pgfence.lock_queue.granted_token IS
  'Token of the lease a release handed to this waiter; NULL while it waits.';
