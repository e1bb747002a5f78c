-- The integrity trigger of pgfence.locks without a subquery in its tests of
-- pglock's own changes. Its test of a grant held an EXISTS on
-- pgfence.lock_queue (for a handoff) inside one IF; plpgsql plans such an
-- expression through the plan cache, which keeps choosing a custom plan for
-- it (with NEW and OLD folded in, the custom plan always looks cheaper), so
-- every grant (GrantLock, InsertLock, QueueGrant, a handoff) planned it anew:
-- about 0.1 ms of planning per grant, measured with pg_stat_statements
-- (track_planning: as many plans as calls). The grant test is now simple
-- expressions, evaluated without the planner, and the queue lookup a separate
-- statement that only a handoff reaches and whose generic plan is kept. The
-- rules are unchanged: the same changes pass and the same are refused.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.locks_integrity() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    t       timestamptz := now();  -- the clock of pglock's statements
    max_ttl CONSTANT interval := interval '24 hours';  -- pglock.MaxTTL
    code    text := 'PF010';
    reason  text;
    owner   oid;
BEGIN
    -- pglock's changes, tested first: they never reach the ownership lookup.
    IF TG_OP = 'UPDATE' THEN
        IF NEW.name = OLD.name THEN
            IF NEW.token IS DISTINCT FROM OLD.token THEN
                -- A grant (GrantLock, WaitGrant, a handoff). NEW.token >
                -- OLD.token >= 0, so the difference cannot overflow. Only
                -- simple expressions here: plpgsql evaluates them without
                -- the planner (an IF holding a subquery is planned anew in
                -- every call, because its custom plan folds NEW and OLD).
                IF NEW.token > OLD.token AND NEW.token - OLD.token = 1
                   AND NEW.holder IS NOT NULL
                   AND NEW.acquired_at = t
                   AND NEW.renewed_at IS NULL
                   AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
                   AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                    IF OLD.holder IS NULL OR OLD.expires_at <= t THEN
                        RETURN NEW;  -- a free or expired lease
                    END IF;
                    -- A handoff (ReleaseLock): the holder's release grants the
                    -- lease to a live waiter queued for this name.
                    PERFORM FROM pgfence.lock_queue q
                    WHERE q.name = NEW.name AND q.holder = NEW.holder
                      AND q.granted_token IS NULL AND q.alive_until > t;
                    IF FOUND THEN
                        RETURN NEW;
                    END IF;
                END IF;
            ELSIF OLD.holder IS NOT NULL AND OLD.expires_at > t
                  AND NEW.acquired_at IS NOT DISTINCT FROM OLD.acquired_at THEN
                -- A held lease, same token.
                IF NEW.holder IS NULL THEN
                    -- A release (ReleaseLock).
                    IF NEW.expires_at IS NULL AND NEW.renewed_at IS NULL
                       AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                        RETURN NEW;
                    END IF;
                ELSIF NEW.holder = OLD.holder THEN
                    IF NEW.expires_at = OLD.expires_at
                       AND NEW.renewed_at IS NOT DISTINCT FROM OLD.renewed_at THEN
                        -- A wait mark (WaitGrant), or metadata alone.
                        IF NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since
                           OR NEW.waiting_since = t THEN
                            RETURN NEW;
                        END IF;
                    ELSIF NEW.renewed_at = t
                          AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
                          AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                        -- A renewal (RenewLock).
                        RETURN NEW;
                    END IF;
                END IF;
            ELSIF NEW IS NOT DISTINCT FROM OLD THEN
                RETURN NEW;  -- writes the row as it was
            END IF;
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        -- A first grant (InsertLock, WaitGrant).
        IF NEW.token = 1
           AND NEW.holder IS NOT NULL
           AND NEW.acquired_at = t
           AND NEW.renewed_at IS NULL
           AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
           AND NEW.waiting_since IS NULL THEN
            RETURN NEW;
        END IF;
    END IF;

    -- Not one of pglock's changes: allowed for the table's owner, roles with
    -- its privileges and superusers (maintenance), refused for everyone else.
    SELECT c.relowner INTO owner FROM pg_class c WHERE c.oid = TG_RELID;
    IF pg_has_role(current_user, owner, 'USAGE') THEN
        IF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        RETURN NEW;  -- NULL for TRUNCATE: the statement goes on
    END IF;

    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: refused TRUNCATE of %.%: lock rows are never deleted', TG_TABLE_SCHEMA, TG_TABLE_NAME
            USING ERRCODE = 'PF009', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = 'A lock name whose row is gone would be granted again from token 1, below tokens already '
                           'issued and recorded in fence columns.',
                  HINT = format('Maintenance of pgfence.locks runs as its owner (role %s) or a superuser.', owner::regrole);
    ELSIF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'pgfence: refused DELETE of lock %: lock rows are never deleted', quote_literal(OLD.name)
            USING ERRCODE = 'PF009', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = format('lock %s token %s holder %s. A lock name whose row is gone would be granted again '
                                  'from token 1, below tokens already issued.',
                                  quote_literal(OLD.name), OLD.token, quote_nullable(OLD.holder)),
                  HINT = format('Release a lease with pglock; maintenance of pgfence.locks runs as its owner '
                                '(role %s) or a superuser.', owner::regrole);
    ELSIF TG_OP = 'INSERT' THEN
        IF NEW.token IS DISTINCT FROM 1 THEN
            code := 'PF009';
            reason := 'a new lock row is the first grant of its name and starts at token 1';
        ELSE
            reason := 'a new lock row is a first grant: holder set, acquired_at = now(), renewed_at and waiting_since '
                      'NULL, expires_at after now() and at most 24 hours later';
        END IF;
        RAISE EXCEPTION 'pgfence: refused INSERT of lock %: token %, holder %: %', quote_literal(NEW.name),
                coalesce(NEW.token::text, 'NULL'), quote_nullable(NEW.holder), reason
            USING ERRCODE = code, SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = format('new row: token %s, holder %s, acquired_at %s, expires_at %s; database time %s',
                                  coalesce(NEW.token::text, 'NULL'), quote_nullable(NEW.holder),
                                  coalesce(NEW.acquired_at::text, 'NULL'), coalesce(NEW.expires_at::text, 'NULL'), t),
                  HINT = format('Locks are granted by pglock (Acquire, TryAcquire); maintenance of pgfence.locks runs '
                                'as its owner (role %s) or a superuser.', owner::regrole);
    END IF;

    -- UPDATE: say which rule the change breaks.
    IF NEW.name IS DISTINCT FROM OLD.name THEN
        code := 'PF009';
        reason := format('a lock row keeps its name (renamed to %s, it would take its token history with it)',
                         quote_nullable(NEW.name));
    ELSIF NEW.token IS NULL OR NEW.token < OLD.token THEN
        code := 'PF009';
        reason := 'tokens never go down';
    ELSIF NEW.token - OLD.token > 1 THEN
        code := 'PF009';
        reason := 'a grant raises the token by exactly 1';
    ELSIF NEW.token > OLD.token THEN
        IF OLD.holder IS NOT NULL AND OLD.expires_at > t THEN
            reason := format('the lease is held by %s until %s (database clock): only a free or expired lease can '
                             'be granted', quote_literal(OLD.holder), OLD.expires_at);
        ELSE
            reason := 'a grant sets holder, acquired_at = now(), renewed_at NULL and expires_at after now() and at '
                      'most 24 hours later, and keeps waiting_since';
        END IF;
    ELSIF OLD.holder IS NULL OR OLD.expires_at <= t THEN
        reason := format('the lease is %s: only a grant (token + 1) changes it',
                         CASE WHEN OLD.holder IS NULL THEN 'free' ELSE 'expired since ' || OLD.expires_at END);
    ELSIF NEW.holder IS DISTINCT FROM OLD.holder AND NEW.holder IS NOT NULL THEN
        reason := format('the lease is held by %s: the holder changes only with a grant (token + 1) of a free or '
                         'expired lease', quote_literal(OLD.holder));
    ELSIF NEW.acquired_at IS DISTINCT FROM OLD.acquired_at THEN
        reason := 'acquired_at changes only with a grant';
    ELSIF NEW.holder IS NULL THEN
        reason := 'a release sets holder, expires_at and renewed_at to NULL and keeps token, acquired_at and '
                  'waiting_since';
    ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at OR NEW.renewed_at IS DISTINCT FROM OLD.renewed_at THEN
        reason := 'a renewal sets renewed_at = now() and expires_at after now() and at most 24 hours later, and '
                  'keeps waiting_since';
    ELSE
        reason := 'a wait mark sets waiting_since to now()';
    END IF;
    RAISE EXCEPTION 'pgfence: refused UPDATE of lock %: token % -> %, holder % -> %: %', quote_literal(OLD.name),
            OLD.token, coalesce(NEW.token::text, 'NULL'), quote_nullable(OLD.holder), quote_nullable(NEW.holder), reason
        USING ERRCODE = code, SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
              DETAIL = format('expires_at %s -> %s, acquired_at %s -> %s, renewed_at %s -> %s, waiting_since %s -> %s; '
                              'database time %s',
                              coalesce(OLD.expires_at::text, 'NULL'), coalesce(NEW.expires_at::text, 'NULL'),
                              coalesce(OLD.acquired_at::text, 'NULL'), coalesce(NEW.acquired_at::text, 'NULL'),
                              coalesce(OLD.renewed_at::text, 'NULL'), coalesce(NEW.renewed_at::text, 'NULL'),
                              coalesce(OLD.waiting_since::text, 'NULL'), coalesce(NEW.waiting_since::text, 'NULL'), t),
              HINT = format('Leases change only through pglock (grant, renewal, release, wait mark); maintenance of '
                            'pgfence.locks, such as an epoch bump after a failover, runs as its owner (role %s) or a '
                            'superuser.', owner::regrole);
END
$fn$;
-- +goose StatementEnd

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence.locks_integrity() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    t       timestamptz := now();  -- the clock of pglock's statements
    max_ttl CONSTANT interval := interval '24 hours';  -- pglock.MaxTTL
    code    text := 'PF010';
    reason  text;
    owner   oid;
BEGIN
    -- pglock's changes, tested first: they never reach the ownership lookup.
    IF TG_OP = 'UPDATE' THEN
        IF NEW.name = OLD.name THEN
            IF NEW.token IS DISTINCT FROM OLD.token THEN
                -- A grant (GrantLock, WaitGrant). NEW.token > OLD.token >= 0,
                -- so the difference cannot overflow.
                IF NEW.token > OLD.token AND NEW.token - OLD.token = 1
                   AND (OLD.holder IS NULL OR OLD.expires_at <= t
                        -- A handoff (ReleaseLock): the holder's release grants
                        -- the lease to a live waiter queued for this name.
                        OR EXISTS (SELECT 1 FROM pgfence.lock_queue q
                                   WHERE q.name = NEW.name AND q.holder = NEW.holder
                                     AND q.granted_token IS NULL AND q.alive_until > t))
                   AND NEW.holder IS NOT NULL
                   AND NEW.acquired_at = t
                   AND NEW.renewed_at IS NULL
                   AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
                   AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                    RETURN NEW;
                END IF;
            ELSIF OLD.holder IS NOT NULL AND OLD.expires_at > t
                  AND NEW.acquired_at IS NOT DISTINCT FROM OLD.acquired_at THEN
                -- A held lease, same token.
                IF NEW.holder IS NULL THEN
                    -- A release (ReleaseLock).
                    IF NEW.expires_at IS NULL AND NEW.renewed_at IS NULL
                       AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                        RETURN NEW;
                    END IF;
                ELSIF NEW.holder = OLD.holder THEN
                    IF NEW.expires_at = OLD.expires_at
                       AND NEW.renewed_at IS NOT DISTINCT FROM OLD.renewed_at THEN
                        -- A wait mark (WaitGrant), or metadata alone.
                        IF NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since
                           OR NEW.waiting_since = t THEN
                            RETURN NEW;
                        END IF;
                    ELSIF NEW.renewed_at = t
                          AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
                          AND NEW.waiting_since IS NOT DISTINCT FROM OLD.waiting_since THEN
                        -- A renewal (RenewLock).
                        RETURN NEW;
                    END IF;
                END IF;
            ELSIF NEW IS NOT DISTINCT FROM OLD THEN
                RETURN NEW;  -- writes the row as it was
            END IF;
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        -- A first grant (InsertLock, WaitGrant).
        IF NEW.token = 1
           AND NEW.holder IS NOT NULL
           AND NEW.acquired_at = t
           AND NEW.renewed_at IS NULL
           AND NEW.expires_at > t AND NEW.expires_at <= t + max_ttl
           AND NEW.waiting_since IS NULL THEN
            RETURN NEW;
        END IF;
    END IF;

    -- Not one of pglock's changes: allowed for the table's owner, roles with
    -- its privileges and superusers (maintenance), refused for everyone else.
    SELECT c.relowner INTO owner FROM pg_class c WHERE c.oid = TG_RELID;
    IF pg_has_role(current_user, owner, 'USAGE') THEN
        IF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        RETURN NEW;  -- NULL for TRUNCATE: the statement goes on
    END IF;

    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: refused TRUNCATE of %.%: lock rows are never deleted', TG_TABLE_SCHEMA, TG_TABLE_NAME
            USING ERRCODE = 'PF009', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = 'A lock name whose row is gone would be granted again from token 1, below tokens already '
                           'issued and recorded in fence columns.',
                  HINT = format('Maintenance of pgfence.locks runs as its owner (role %s) or a superuser.', owner::regrole);
    ELSIF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'pgfence: refused DELETE of lock %: lock rows are never deleted', quote_literal(OLD.name)
            USING ERRCODE = 'PF009', SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = format('lock %s token %s holder %s. A lock name whose row is gone would be granted again '
                                  'from token 1, below tokens already issued.',
                                  quote_literal(OLD.name), OLD.token, quote_nullable(OLD.holder)),
                  HINT = format('Release a lease with pglock; maintenance of pgfence.locks runs as its owner '
                                '(role %s) or a superuser.', owner::regrole);
    ELSIF TG_OP = 'INSERT' THEN
        IF NEW.token IS DISTINCT FROM 1 THEN
            code := 'PF009';
            reason := 'a new lock row is the first grant of its name and starts at token 1';
        ELSE
            reason := 'a new lock row is a first grant: holder set, acquired_at = now(), renewed_at and waiting_since '
                      'NULL, expires_at after now() and at most 24 hours later';
        END IF;
        RAISE EXCEPTION 'pgfence: refused INSERT of lock %: token %, holder %: %', quote_literal(NEW.name),
                coalesce(NEW.token::text, 'NULL'), quote_nullable(NEW.holder), reason
            USING ERRCODE = code, SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  DETAIL = format('new row: token %s, holder %s, acquired_at %s, expires_at %s; database time %s',
                                  coalesce(NEW.token::text, 'NULL'), quote_nullable(NEW.holder),
                                  coalesce(NEW.acquired_at::text, 'NULL'), coalesce(NEW.expires_at::text, 'NULL'), t),
                  HINT = format('Locks are granted by pglock (Acquire, TryAcquire); maintenance of pgfence.locks runs '
                                'as its owner (role %s) or a superuser.', owner::regrole);
    END IF;

    -- UPDATE: say which rule the change breaks.
    IF NEW.name IS DISTINCT FROM OLD.name THEN
        code := 'PF009';
        reason := format('a lock row keeps its name (renamed to %s, it would take its token history with it)',
                         quote_nullable(NEW.name));
    ELSIF NEW.token IS NULL OR NEW.token < OLD.token THEN
        code := 'PF009';
        reason := 'tokens never go down';
    ELSIF NEW.token - OLD.token > 1 THEN
        code := 'PF009';
        reason := 'a grant raises the token by exactly 1';
    ELSIF NEW.token > OLD.token THEN
        IF OLD.holder IS NOT NULL AND OLD.expires_at > t THEN
            reason := format('the lease is held by %s until %s (database clock): only a free or expired lease can '
                             'be granted', quote_literal(OLD.holder), OLD.expires_at);
        ELSE
            reason := 'a grant sets holder, acquired_at = now(), renewed_at NULL and expires_at after now() and at '
                      'most 24 hours later, and keeps waiting_since';
        END IF;
    ELSIF OLD.holder IS NULL OR OLD.expires_at <= t THEN
        reason := format('the lease is %s: only a grant (token + 1) changes it',
                         CASE WHEN OLD.holder IS NULL THEN 'free' ELSE 'expired since ' || OLD.expires_at END);
    ELSIF NEW.holder IS DISTINCT FROM OLD.holder AND NEW.holder IS NOT NULL THEN
        reason := format('the lease is held by %s: the holder changes only with a grant (token + 1) of a free or '
                         'expired lease', quote_literal(OLD.holder));
    ELSIF NEW.acquired_at IS DISTINCT FROM OLD.acquired_at THEN
        reason := 'acquired_at changes only with a grant';
    ELSIF NEW.holder IS NULL THEN
        reason := 'a release sets holder, expires_at and renewed_at to NULL and keeps token, acquired_at and '
                  'waiting_since';
    ELSIF NEW.expires_at IS DISTINCT FROM OLD.expires_at OR NEW.renewed_at IS DISTINCT FROM OLD.renewed_at THEN
        reason := 'a renewal sets renewed_at = now() and expires_at after now() and at most 24 hours later, and '
                  'keeps waiting_since';
    ELSE
        reason := 'a wait mark sets waiting_since to now()';
    END IF;
    RAISE EXCEPTION 'pgfence: refused UPDATE of lock %: token % -> %, holder % -> %: %', quote_literal(OLD.name),
            OLD.token, coalesce(NEW.token::text, 'NULL'), quote_nullable(OLD.holder), quote_nullable(NEW.holder), reason
        USING ERRCODE = code, SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
              DETAIL = format('expires_at %s -> %s, acquired_at %s -> %s, renewed_at %s -> %s, waiting_since %s -> %s; '
                              'database time %s',
                              coalesce(OLD.expires_at::text, 'NULL'), coalesce(NEW.expires_at::text, 'NULL'),
                              coalesce(OLD.acquired_at::text, 'NULL'), coalesce(NEW.acquired_at::text, 'NULL'),
                              coalesce(OLD.renewed_at::text, 'NULL'), coalesce(NEW.renewed_at::text, 'NULL'),
                              coalesce(OLD.waiting_since::text, 'NULL'), coalesce(NEW.waiting_since::text, 'NULL'), t),
              HINT = format('Leases change only through pglock (grant, renewal, release, wait mark); maintenance of '
                            'pgfence.locks, such as an epoch bump after a failover, runs as its owner (role %s) or a '
                            'superuser.', owner::regrole);
END
$fn$;
-- +goose StatementEnd
