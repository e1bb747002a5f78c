-- pgfence.lock_leave answers a granted_token above 0 only for a lease handed
-- to the wait that is still live and still that grant. It answered the
-- token a release had recorded in the wait's queue row, whatever became of
-- the lease since: a handed row stays in pgfence.lock_queue until a release
-- of the name deletes it, so a waiter that missed the notification and gave
-- up after the handed lease had expired, and another holder had taken the
-- name (token + 1), was told it held the old token, as a lease of its own to
-- release (TestLeaveLive). It now reads the lock row in a statement of its
-- own, after the DELETE, whose snapshot could predate a release that handed
-- the lease and committed while the DELETE waited for the row
-- (TestLeaveLiveRace): the token counts only while pgfence.locks has it,
-- with the wait's key hash, unexpired; the name under COLLATE "default", as
-- every comparison of a name since migration 00030. The DELETE takes only
-- the row of this wait (wait_id too): a leave of an earlier wait of the same
-- wkey, sent late, took the row of the wait that reused the wkey (its place
-- in the queue, or a lease handed to it, answered as 0), as a NULL wait_id
-- did before 00014; it now leaves that row alone and answers removed false.
-- pglock never has two waits of one wkey at once, so its calls answer as
-- before. Signature, settings and grants do not change; the comment says
-- what granted_token is. The Down restores 00014's body and 00001's
-- comment.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_leave(wkey bigint, wait_id bigint, key bytea,
    OUT removed boolean, OUT granted_token bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    qname  text COLLATE "default";
    qkh    bytea;
    handed bigint;
BEGIN
    IF lock_leave.key IS NULL OR octet_length(lock_leave.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_leave: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_leave.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_leave.wkey IS NULL OR lock_leave.wait_id IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_leave: wkey and wait_id must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    -- Only this wait's row: a row of wkey that holds another wait of this
    -- key (one that reused the wkey) is that wait's. A concurrent release
    -- that picked this row finishes first (the row is locked), and the row
    -- it marked is the one deleted here.
    DELETE FROM pgfence.lock_queue AS q
    WHERE q.wkey = lock_leave.wkey AND q.wait_id = lock_leave.wait_id AND q.key_hash = sha256(lock_leave.key)
    RETURNING q.name, q.key_hash, q.granted_token INTO qname, qkh, handed;
    lock_leave.removed := FOUND;
    lock_leave.granted_token := 0;
    -- A lease handed to this wait is the caller's only while it is live and
    -- still that grant: the token a release recorded in the row outlives
    -- the lease, which may have expired (and gone to another holder, with a
    -- later token) or been released since. A statement of its own, so that
    -- its snapshot sees the lock row of a release that committed while the
    -- DELETE waited for the row. The name under COLLATE "default", as every
    -- comparison of a name (migration 00030).
    IF handed > 0 THEN
        SELECT l.token INTO lock_leave.granted_token
        FROM pgfence.locks AS l
        WHERE l.name = qname COLLATE "default" AND l.token = handed AND l.key_hash = qkh
          AND l.expires_at > now();
        lock_leave.granted_token := COALESCE(lock_leave.granted_token, 0);
    END IF;
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION pgfence.lock_leave(bigint, bigint, bytea) IS
  'Takes the wait (wkey, wait_id) queued with key out of pgfence.lock_queue; granted_token is the token of a lease '
  'a release handed to that wait if it is still live (0 if none, or it has expired or ended: since migration 00032), '
  'which the caller holds and releases at once. removed false: no row of this wait with this key.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.lock_leave(wkey bigint, wait_id bigint, key bytea,
    OUT removed boolean, OUT granted_token bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF lock_leave.key IS NULL OR octet_length(lock_leave.key) NOT BETWEEN 16 AND 64 THEN
        RAISE EXCEPTION 'pgfence.lock_leave: key must be 16 to 64 random bytes, got %',
            coalesce(octet_length(lock_leave.key)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    ELSIF lock_leave.wkey IS NULL OR lock_leave.wait_id IS NULL THEN
        RAISE EXCEPTION 'pgfence.lock_leave: wkey and wait_id must not be NULL' USING ERRCODE = 'PF011';
    END IF;
    DELETE FROM pgfence.lock_queue AS q
    WHERE q.wkey = lock_leave.wkey AND q.key_hash = sha256(lock_leave.key)
    RETURNING CASE WHEN q.wait_id = lock_leave.wait_id THEN COALESCE(q.granted_token, 0) ELSE 0 END
    INTO lock_leave.granted_token;
    lock_leave.removed := FOUND;
    lock_leave.granted_token := COALESCE(lock_leave.granted_token, 0);
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION pgfence.lock_leave(bigint, bigint, bytea) IS
  'Takes the waiter wkey queued with key out of pgfence.lock_queue; granted_token is a lease handed to its wait '
  'wait_id meanwhile (0 if none), which the caller releases. removed false: no such row.';
