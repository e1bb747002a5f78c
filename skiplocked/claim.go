package skiplocked

import (
	"context"
	"crypto/rand"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/workerclaim"
)

// ClaimParams describe one leased claim.
type ClaimParams struct {
	// Queue to claim from.
	Queue string
	// Holder identifies the claimer (stored in holder), 1..512 bytes.
	Holder string
	// Limit is the most rows to claim, 1..10,000.
	Limit int
	// TTL is how long the claims last on the database clock,
	// 100ms..24h. Extend them with [Renew].
	TTL time.Duration
}

// Claim is the leased claim. In one statement it takes up to p.Limit
// claimable jobs of p.Queue without waiting for other workers (FOR UPDATE
// SKIP LOCKED), marks them running with a new, larger claim token each and an
// expiry of now() + p.TTL on the database clock, and returns them in claim
// order (priority, run_at, id). Claimable means available with run_at <=
// now(), or running with an expired claim (the previous holder's calls then
// get an error matching [pgfence.ErrLost]); an expired claim with no attempts left sends the job
// to dead instead.
//
// Run it on a pool or connection, not inside a long transaction. Each claim
// counts as an attempt. If ctx is cancelled the statement took effect fully
// or not at all; unreported claims simply expire.
//
// The jobs of one call share a new random claim key ([Job.ClaimKey]); the
// database stores only its SHA-256, and every later change of the claims
// needs it ([Job.Ref] carries it).
func Claim(ctx context.Context, db pgfence.DBTX, p ClaimParams) ([]Job, error) {
	return claim(ctx, db, p, nil)
}

// claim is [Claim] with the claim statement run by run (dbsqlc's ClaimJobs
// when nil): a Worker given its own by package workerclaim.
func claim(ctx context.Context, db pgfence.DBTX, p ClaimParams, run workerclaim.Func) ([]Job, error) {
	if nilcheck.IsNil(db) {
		return nil, nilDB(opClaim)
	}
	if err := checkQueue(opClaim, p.Queue); err != nil {
		return nil, err
	}
	if err := checkHolder(opClaim, "holder", p.Holder); err != nil {
		return nil, err
	}
	if err := checkLimit(opClaim, "limit", p.Limit); err != nil {
		return nil, err
	}
	if err := checkTTL(opClaim, "ttl", p.TTL); err != nil {
		return nil, err
	}
	key := newClaimKey()
	arg := dbsqlc.ClaimJobsParams{
		Queue: p.Queue, MaxJobs: int32(p.Limit), Holder: p.Holder, TtlMs: p.TTL.Milliseconds(), Key: key[:],
	}
	var rows []dbsqlc.PgfenceJob
	var err error
	if run != nil {
		rows, err = run(ctx, db, arg)
	} else {
		rows, err = queries.ClaimJobs(ctx, db, arg)
	}
	if err != nil {
		return nil, dbError(opClaim, p.Queue, "", err)
	}
	jobs := make([]Job, len(rows))
	for i, r := range rows {
		jobs[i] = jobFromRow(r)
		jobs[i].ClaimKey = key
	}
	return jobs, nil
}

// ClaimTx is the in-transaction claim on pgfence.jobs: it locks up to
// limit available, due jobs of queue with FOR UPDATE SKIP LOCKED for tx and
// returns them. Nothing is written: the row locks are the claim and last
// until tx commits or rolls back; if the worker dies its connection closes
// and PostgreSQL releases them at once. Finish each job in the same tx with
// [CompleteTx] or [FailTx]; a rollback makes the jobs available again
// without counting an attempt.
func ClaimTx(ctx context.Context, tx pgx.Tx, queue string, limit int) ([]Job, error) {
	if nilcheck.IsNil(tx) {
		return nil, nilDB(opClaimTx)
	}
	if err := checkQueue(opClaimTx, queue); err != nil {
		return nil, err
	}
	if err := checkLimit(opClaimTx, "limit", limit); err != nil {
		return nil, err
	}
	rows, err := queries.ClaimJobsTx(ctx, tx, queue, int32(limit))
	if err != nil {
		return nil, dbError(opClaimTx, queue, "", err)
	}
	jobs := make([]Job, len(rows))
	for i, r := range rows {
		jobs[i] = jobFromRow(r)
	}
	return jobs, nil
}

// CompleteTx marks a job claimed by [ClaimTx] completed, in the same
// transaction. It returns an error matching [pgfence.ErrNotFound] if tx's
// ClaimTx calls did not claim an available job with that id: an id of
// another queue, or of a job nobody claimed, changes nothing (since
// migration 00026; before, any due job no other transaction held was
// completed). A claim made in a savepoint that was rolled back is gone with
// it.
func CompleteTx(ctx context.Context, tx pgx.Tx, id int64) error {
	if nilcheck.IsNil(tx) {
		return nilDB(opCompleteTx)
	}
	if id <= 0 {
		return invalid(opCompleteTx, "id", "%d, must be > 0", id)
	}
	done, err := queries.CompleteJobTx(ctx, tx, id)
	if err != nil {
		return dbError(opCompleteTx, "", "", err)
	}
	if !done {
		return notFound(opCompleteTx, id, "available job")
	}
	return nil
}

// FailTx records a failed attempt of a job claimed by [ClaimTx], in
// the same transaction: attempts + 1, then available at now() + p.RetryIn, or
// dead when no attempts are left or p.GiveUp. The change commits with tx.
// As [CompleteTx], it changes only a job tx's ClaimTx calls claimed
// ([pgfence.ErrNotFound] otherwise).
func FailTx(ctx context.Context, tx pgx.Tx, id int64, p FailParams) (Job, error) {
	if nilcheck.IsNil(tx) {
		return Job{}, nilDB(opFailTx)
	}
	if id <= 0 {
		return Job{}, invalid(opFailTx, "id", "%d, must be > 0", id)
	}
	if p.RetryIn < 0 || p.RetryIn > maxRetryDelay {
		return Job{}, invalid(opFailTx, "FailParams.RetryIn", "%s not in 0..%s", p.RetryIn, maxRetryDelay)
	}
	row, err := queries.FailJobTx(ctx, tx, dbsqlc.FailJobTxParams{
		GiveUp: p.GiveUp, RetryInMs: p.RetryIn.Milliseconds(), LastError: cutError(p.Error), ID: id,
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return Job{}, notFound(opFailTx, id, "available job")
	}
	if err != nil {
		return Job{}, dbError(opFailTx, "", "", err)
	}
	return jobFromRow(row), nil
}

// newClaimKey draws the secret key of one Claim call: 16 bytes from
// crypto/rand (which does not fail on the platforms Go supports).
func newClaimKey() (k [16]byte) {
	_, _ = rand.Read(k[:])
	return k
}
