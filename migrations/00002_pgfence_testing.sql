-- Test functions of pgfence: end a lease or a claim now, on the database clock,
-- as if its holder had paused past its end. Package pgfencetest calls them so
-- that an application's tests can prove that a paused holder's writes are
-- refused; expiry runs on the database's clock, which no test can move.
--
-- Owner-only: EXECUTE is revoked from PUBLIC and granted to no role, so the
-- application role cannot end another holder's lease with them. They change
-- nothing but the expiry: the holder, its key and the token stay, so the
-- holder's renewal and release are refused as for any lease that ran out, and
-- the next grant takes token + 1 (a claim: the next claim of its queue takes
-- the job with a new claim token).

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- +goose StatementBegin
CREATE FUNCTION pgfence.test_expire_lease(name text) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    ended bigint;
BEGIN
    IF test_expire_lease.name IS NULL OR octet_length(test_expire_lease.name) NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'pgfence.test_expire_lease: name must be 1 to 512 bytes, got %',
            coalesce(octet_length(test_expire_lease.name)::text || ' bytes', 'NULL') USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.locks AS l SET expires_at = now()
    WHERE l.name = test_expire_lease.name AND l.expires_at > now()
    RETURNING l.token INTO ended;
    RETURN coalesce(ended, 0);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.test_expire_lease(text) IS
  'For tests (owner only): ends the live lease on name now, on the database clock; returns its token, 0 if no lease '
  'of the name was live. Holder, key and token stay: renewing or releasing it is refused as for any ended lease. '
  'Bad arguments: PF011.';

-- +goose StatementBegin
CREATE FUNCTION pgfence.test_expire_claim(job_id bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    ended bigint;
BEGIN
    IF test_expire_claim.job_id IS NULL OR test_expire_claim.job_id <= 0 THEN
        RAISE EXCEPTION 'pgfence.test_expire_claim: job_id must be > 0, got %',
            coalesce(test_expire_claim.job_id::text, 'NULL') USING ERRCODE = 'PF011';
    END IF;
    UPDATE pgfence.jobs AS j SET claim_expires_at = now()
    WHERE j.id = test_expire_claim.job_id AND j.state = 'running' AND j.claim_expires_at > now()
    RETURNING j.claim_token INTO ended;
    RETURN coalesce(ended, 0);
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION pgfence.test_expire_claim(bigint) IS
  'For tests (owner only): ends the live claim of job job_id now, on the database clock; returns its claim token, 0 '
  'if the job had no live claim. As for any claim that ran out, the job stays running, and its holder''s calls '
  'succeed, until the next job_claim of its queue takes it with a new claim token. Bad arguments: PF011.';

REVOKE EXECUTE ON FUNCTION pgfence.test_expire_lease(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION pgfence.test_expire_claim(bigint) FROM PUBLIC;

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
DROP FUNCTION pgfence.test_expire_claim(bigint);
DROP FUNCTION pgfence.test_expire_lease(text);
