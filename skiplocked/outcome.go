package skiplocked

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/nilcheck"
)

// Complete marks claimed jobs completed, in one statement. Each job changes
// only if it is still running under its ref's token (an expired claim not
// yet re-claimed still counts: the token, not the clock, decides). It is
// idempotent: a job already completed under its ref's token counts as
// completed.
//
// When some refs changed nothing (their claims were lost, or their jobs do
// not exist) it returns a [*ClaimsLostError] that lists them and matches
// [ErrClaimLost]; the other claims were completed. Code that checks only err
// never takes a refused completion for a success. With no refs it does
// nothing and returns nil.
func Complete(ctx context.Context, db DBTX, refs ...ClaimRef) error {
	_, err := conditional(ctx, db, "complete", refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.CompleteJobs(ctx, db, dbsqlc.CompleteJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
	return err
}

// Release gives claims back unfinished, in one statement: each job is
// available again at once and the attempt is not counted. Conditional on
// each ref like [Complete], idempotent like it (a claim already released
// under its ref's token counts as released), and refused claims are
// reported like it, with a [*ClaimsLostError].
func Release(ctx context.Context, db DBTX, refs ...ClaimRef) error {
	_, err := conditional(ctx, db, "release", refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.ReleaseJobs(ctx, db, dbsqlc.ReleaseJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
	return err
}

// Renew extends claims to now() + ttl on the database clock, in one
// statement, each only if it is still held under its ref's token. ttl is
// 100ms..24h, like [ClaimParams].TTL. expires[i] is the new (advisory) expiry
// of refs[i], zero when it was not extended.
//
// Claims that were lost are listed by a [*ClaimsLostError] ([ErrClaimLost]);
// a claim that already ended, even by your own Complete, counts as lost.
// Renew never waits for a row lock: a claim whose row another transaction
// holds at that moment (a completion in progress, say) is not extended and
// not lost; when that is the only reason some claims were not extended the
// error says so and does not match [ErrClaimLost] (call again).
func Renew(ctx context.Context, db DBTX, ttl time.Duration, refs ...ClaimRef) ([]time.Time, error) {
	expires, skipped, err := renew(ctx, db, ttl, refs)
	if err == nil && skipped > 0 {
		err = fmt.Errorf("skiplocked: renew: %d of %d claims locked by another transaction at the moment; "+
			"not extended (still held: call again)", skipped, len(refs))
	}
	return expires, err
}

// renew is [Renew] for the Worker: a claim skipped because its row was
// locked is not an error (the next renewal extends it).
func renew(ctx context.Context, db DBTX, ttl time.Duration, refs []ClaimRef) (expires []time.Time, skipped int, err error) {
	if err := checkTTL(ttl); err != nil {
		return nil, 0, err
	}
	exp := make(map[int64]time.Time, len(refs))
	lost, err := conditional(ctx, db, "renew", refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		rows, err := queries.HeartbeatJobs(ctx, db, dbsqlc.HeartbeatJobsParams{TtlMs: ttl.Milliseconds(), Ids: ids, ClaimTokens: tokens, Keys: keys})
		done := make([]int64, len(rows))
		for i, r := range rows {
			done[i] = r.ID
			exp[r.ID] = r.ClaimExpiresAt
		}
		return done, err
	})
	if err != nil && len(lost) == 0 {
		return nil, 0, err
	}
	expires = make([]time.Time, len(refs))
	for i, r := range refs {
		expires[i] = exp[r.JobID]
	}
	for _, e := range expires {
		if e.IsZero() {
			skipped++
		}
	}
	return expires, skipped - len(lost), err
}

// FailParams describe a failed attempt.
type FailParams struct {
	// Error is the message kept in last_error (cut to 8,192 bytes).
	Error string
	// RetryIn delays the next attempt: run_at = now() + RetryIn on the
	// database clock. 0 retries at once; see [DefaultBackoff]. At most
	// one year.
	RetryIn time.Duration
	// GiveUp sends the job to dead now, whatever attempts are left.
	GiveUp bool
}

// Fail records a failed attempt of a claimed job, only if it is still running
// under ref.Token: the job becomes available again at now() + p.RetryIn, or
// dead (last_error kept) when attempts >= max_attempts or p.GiveUp. It returns
// the job as it is now. A lost claim gives a [*ClaimLostError] and changes
// nothing. Fail is idempotent: when the claim of ref.Token already ended with
// a Fail (a retry after a lost reply) it returns the job as it is now and
// nil; the first call's p is the one that was recorded.
func Fail(ctx context.Context, db DBTX, ref ClaimRef, p FailParams) (Job, error) {
	if nilcheck.IsNil(db) {
		return Job{}, ErrNilDB
	}
	if err := checkRef(ref); err != nil {
		return Job{}, err
	}
	if p.RetryIn < 0 || p.RetryIn > maxRetryDelay {
		return Job{}, fmt.Errorf("%w: retry delay %s not in 0..%s", ErrInvalidJob, p.RetryIn, maxRetryDelay)
	}
	row, err := queries.FailJob(ctx, db, dbsqlc.FailJobParams{
		GiveUp: p.GiveUp, RetryInMs: p.RetryIn.Milliseconds(), LastError: cutError(p.Error), ID: ref.JobID, ClaimToken: ref.Token,
		Key: ref.Key[:],
	})
	if errors.Is(err, pgx.ErrNoRows) {
		lost, err := claimState(ctx, db, "fail", ref)
		if err != nil {
			return Job{}, err
		}
		if lost.CurrentToken != ref.Token || lost.wrongKey || lost.Outcome != outcomeFailed {
			return Job{}, lost
		}
		// Already failed under this token: report the job as it is now.
		return GetJob(ctx, db, ref.JobID)
	}
	if err != nil {
		return Job{}, translate("fail", err)
	}
	return jobFromRow(row), nil
}

// DefaultBackoff is the retry delay the [Worker] uses by default after the
// given attempt (1-based) failed: 1s, 2s, 4s, ... doubling per attempt,
// capped at one hour. attempt <= 1 gives 1s.
func DefaultBackoff(attempt int) time.Duration {
	if attempt <= 1 {
		return time.Second
	}
	if attempt > 13 { // 2^12 s > 1 h
		return time.Hour
	}
	return min(time.Second<<(attempt-1), time.Hour)
}

// alreadyDone reports whether a conditional op that changed nothing had in
// fact already been applied under the same token: the claim ended with the
// outcome op writes. A renewal is never "already done".
func alreadyDone(op string, ref ClaimRef, e *ClaimLostError) bool {
	if e == nil || e.CurrentToken != ref.Token || e.wrongKey {
		return false
	}
	switch op {
	case "complete":
		return e.Outcome == outcomeCompleted
	case "release":
		return e.Outcome == outcomeReleased
	}
	return false
}

// conditional runs a batch update conditional on (id, token) and returns the
// refs that did not change, with a *ClaimsLostError when there are any. Refs
// that did not change because they had already been applied under their
// token (see alreadyDone) are not lost. When the rows of unchanged refs
// cannot be read to tell which is which, it returns that error (the whole
// call may be retried: every op is conditional and idempotent).
func conditional(ctx context.Context, db DBTX, op string, refs []ClaimRef, run func(ids, tokens []int64, keys [][]byte) ([]int64, error)) ([]ClaimRef, error) {
	if nilcheck.IsNil(db) {
		return nil, ErrNilDB
	}
	if len(refs) == 0 {
		return nil, nil
	}
	if len(refs) > maxBatch {
		return nil, fmt.Errorf("%w: %d claims in one call, at most %d", ErrInvalidLimit, len(refs), maxBatch)
	}
	ids := make([]int64, len(refs))
	tokens := make([]int64, len(refs))
	keys := make([][]byte, len(refs))
	for i := range refs {
		r := &refs[i] // keys[i] points into refs: no copy of the key per ref
		if err := checkRef(*r); err != nil {
			return nil, err
		}
		ids[i], tokens[i], keys[i] = r.JobID, r.Token, r.Key[:]
	}
	done, err := run(ids, tokens, keys)
	if err != nil {
		return nil, translate(op, err)
	}
	if len(done) == len(refs) {
		return nil, nil
	}
	ok := make(map[int64]bool, len(done))
	for _, id := range done {
		ok[id] = true
	}
	var unchanged []ClaimRef
	for _, r := range refs {
		if !ok[r.JobID] {
			unchanged = append(unchanged, r)
		}
	}
	if len(unchanged) == 0 { // the same job twice in refs
		return nil, nil
	}
	states, err := claimStates(ctx, db, unchanged)
	if err != nil {
		return nil, translate(op+": read the claims that changed nothing", err)
	}
	var lost []ClaimRef
	var details []*ClaimLostError
	for _, r := range unchanged {
		e := states[r.JobID]
		if e != nil {
			e = &ClaimLostError{JobID: r.JobID, Token: r.Token, CurrentToken: e.CurrentToken, State: e.State, Holder: e.Holder, Outcome: e.Outcome,
				keyHash: e.keyHash}
			e.checkKey(r.Key)
		}
		if alreadyDone(op, r, e) {
			continue
		}
		if op == "renew" && e != nil && !e.wrongKey && e.CurrentToken == r.Token && e.State == StateRunning {
			continue // still held, its row locked for a moment: not extended this time
		}
		lost = append(lost, r)
		details = append(details, e)
	}
	if len(lost) == 0 {
		return nil, nil
	}
	return lost, &ClaimsLostError{Op: op, Total: len(refs), Lost: lost, Details: details}
}

// claimStates reads the claim columns of the jobs of refs, by job id (the
// Token field of each entry is 0; missing jobs have no entry).
func claimStates(ctx context.Context, db DBTX, refs []ClaimRef) (map[int64]*ClaimLostError, error) {
	ids := make([]int64, len(refs))
	for i, r := range refs {
		ids[i] = r.JobID
	}
	rows, err := queries.GetJobClaims(ctx, db, ids)
	if err != nil {
		return nil, err
	}
	m := make(map[int64]*ClaimLostError, len(rows))
	for _, row := range rows {
		e := &ClaimLostError{JobID: row.ID, State: State(row.State)}
		if row.ClaimToken.Valid {
			e.CurrentToken = row.ClaimToken.Int64
		}
		if row.Holder != nil {
			e.Holder = *row.Holder
		}
		if row.ClaimOutcome != nil {
			e.Outcome = *row.ClaimOutcome
		}
		e.keyHash = row.ClaimKeyHash
		m[row.ID] = e
	}
	return m, nil
}

// claimState reads one job's claim columns as a *ClaimLostError for ref, or
// returns ErrJobNotFound, or the read's error (translated for op).
func claimState(ctx context.Context, db DBTX, op string, ref ClaimRef) (*ClaimLostError, error) {
	m, err := claimStates(ctx, db, []ClaimRef{ref})
	if err != nil {
		return nil, translate(op+": read the claim", err)
	}
	e := m[ref.JobID]
	if e == nil {
		return nil, fmt.Errorf("%w: id %d", ErrJobNotFound, ref.JobID)
	}
	e.Token = ref.Token
	e.checkKey(ref.Key)
	return e, nil
}
