-- How the latest leased claim of a job ended, so that completing, failing or
-- releasing a claim is idempotent.
--
-- A retried Complete whose first attempt committed but whose reply was lost
-- (a killed connection) used to find the row no longer running and report the
-- claim lost, although the completion had landed. With claim_outcome the
-- retry can tell "already completed under my token" (success) from "another
-- claim took the job over" (claim lost): the token of the latest claim stays
-- on the row, and claim_outcome says how that claim ended.
--
-- The column is NULL while a claim runs, for jobs never claimed, and for rows
-- whose latest leased claim is older than this migration. Claiming a job again
-- resets it to NULL together with the new token. In-transaction claims
-- (ClaimJobsTx, CompleteJobTx, FailJobTx) do not write it: they hold no token.

-- +goose Up
SET LOCAL search_path = pg_catalog, pg_temp;

-- No default: adding the column does not rewrite the table. The check is NOT
-- VALID, so adding it does not scan the table under its exclusive lock: every
-- existing row holds NULL, which passes, and every later write is checked.
ALTER TABLE pgfence.jobs ADD COLUMN claim_outcome text;
ALTER TABLE pgfence.jobs ADD CONSTRAINT jobs_claim_outcome_known CHECK (
    claim_outcome IS NULL
    OR (claim_outcome IN ('completed', 'failed', 'released', 'expired') AND state <> 'running')) NOT VALID;

COMMENT ON COLUMN pgfence.jobs.claim_outcome IS
  'How the latest leased claim (claim_token) ended: completed (Complete), failed (Fail: available for a retry, '
  'or dead), released (Release), expired (its claim ran out on the last attempt and the job went dead). NULL while '
  'the claim runs, before the first claim, and for claims that ended before migration 00012. A retried Complete, '
  'Fail or Release under the same token that finds its own outcome here succeeds instead of reporting a lost claim.';

-- +goose Down
SET LOCAL search_path = pg_catalog, pg_temp;
ALTER TABLE pgfence.jobs DROP CONSTRAINT IF EXISTS jobs_claim_outcome_known;
ALTER TABLE pgfence.jobs DROP COLUMN IF EXISTS claim_outcome;
