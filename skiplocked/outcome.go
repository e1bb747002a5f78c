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

// Complete marks a claimed job completed, only if it is still running under
// ref.Token (an expired claim not yet re-claimed still counts: the token, not
// the clock, decides). Otherwise it returns a [*ClaimLostError]
// ([ErrClaimLost]) or [ErrJobNotFound] and changes nothing. It is idempotent:
// a job already completed under ref.Token returns nil.
func Complete(ctx context.Context, db DBTX, ref ClaimRef) error {
	return single(ctx, db, "complete", ref, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.CompleteJobs(ctx, db, dbsqlc.CompleteJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
}

// CompleteMany completes many claims in one statement. Each job changes only
// if it is still running under its token; a job already completed under its
// token counts as completed (see [Complete]). The refs that did not change
// (their claims were lost, or the jobs do not exist) are returned in lost,
// together with a *[ClaimsLostError] ([ErrClaimLost]): code that checks only
// err never takes a refused completion for a success. The other claims of
// the batch were completed.
func CompleteMany(ctx context.Context, db DBTX, refs []ClaimRef) (lost []ClaimRef, err error) {
	return conditional(ctx, db, "complete", refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.CompleteJobs(ctx, db, dbsqlc.CompleteJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
}

// Release gives a claim back unfinished: the job is available again at once
// and the attempt is not counted. Conditional on ref like [Complete], and
// idempotent like it: a claim already released under ref.Token returns nil.
func Release(ctx context.Context, db DBTX, ref ClaimRef) error {
	return single(ctx, db, "release", ref, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.ReleaseJobs(ctx, db, dbsqlc.ReleaseJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
}

// ReleaseMany releases many claims in one statement; see [Release] and
// [CompleteMany] for lost.
func ReleaseMany(ctx context.Context, db DBTX, refs []ClaimRef) (lost []ClaimRef, err error) {
	return conditional(ctx, db, "release", refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.ReleaseJobs(ctx, db, dbsqlc.ReleaseJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
}

// Renew extends a claim to now() + ttl on the database clock, only if it
// is still held under ref.Token, and returns the new (advisory) expiry.
// Otherwise it returns a [*ClaimLostError] or [ErrJobNotFound]; a claim that
// already ended, even by your own Complete, counts as lost. It never waits for
// a row lock: if another transaction holds the job's row, the claim is not
// extended and the error is not [ErrClaimLost] (call again).
func Renew(ctx context.Context, db DBTX, ref ClaimRef, ttl time.Duration) (time.Time, error) {
	if err := checkTTL(ttl); err != nil {
		return time.Time{}, err
	}
	var exp time.Time
	err := single(ctx, db, "renew", ref, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		rows, err := queries.HeartbeatJobs(ctx, db, dbsqlc.HeartbeatJobsParams{TtlMs: ttl.Milliseconds(), Ids: ids, ClaimTokens: tokens, Keys: keys})
		done := make([]int64, len(rows))
		for i, r := range rows {
			done[i] = r.ID
			exp = r.ClaimExpiresAt
		}
		return done, err
	})
	if err != nil {
		return time.Time{}, err
	}
	if exp.IsZero() {
		return time.Time{}, fmt.Errorf("skiplocked: renew: job %d is locked by another transaction at the moment; "+
			"claim %d not extended (it is still held: call again)", ref.JobID, ref.Token)
	}
	return exp, nil
}

// RenewMany extends many claims in one statement. It returns the new
// expiry of each extended job by id, and the refs that were lost with a
// *[ClaimsLostError] (see [Renew]). A claim whose row another transaction
// has locked at that moment is skipped: neither in the map nor lost.
func RenewMany(ctx context.Context, db DBTX, refs []ClaimRef, ttl time.Duration) (map[int64]time.Time, []ClaimRef, error) {
	if err := checkTTL(ttl); err != nil {
		return nil, nil, err
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
		return nil, nil, err
	}
	return exp, lost, err
}

// FailParams describe a failed attempt.
type FailParams struct {
	// Error is the message kept in last_error (cut to [MaxErrorLen] bytes).
	Error string
	// RetryIn delays the next attempt: run_at = now() + RetryIn on the
	// database clock. 0 retries at once; see [DefaultBackoff]. At most
	// [MaxRetryDelay].
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
	if p.RetryIn < 0 || p.RetryIn > MaxRetryDelay {
		return Job{}, fmt.Errorf("%w: retry delay %s not in 0..%s", ErrInvalidJob, p.RetryIn, MaxRetryDelay)
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
		if lost.CurrentToken != ref.Token || lost.wrongKey || lost.Outcome != OutcomeFailed {
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

// single runs a conditional update for one ref and explains a refusal with a
// *ClaimLostError (or ErrJobNotFound).
func single(ctx context.Context, db DBTX, op string, ref ClaimRef, run func(ids, tokens []int64, keys [][]byte) ([]int64, error)) error {
	_, err := conditional(ctx, db, op, []ClaimRef{ref}, run)
	var cl *ClaimsLostError
	if !errors.As(err, &cl) {
		return err
	}
	if len(cl.Details) == 1 && cl.Details[0] != nil {
		return cl.Details[0]
	}
	return fmt.Errorf("%w: id %d", ErrJobNotFound, ref.JobID)
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
		return e.Outcome == OutcomeCompleted
	case "release":
		return e.Outcome == OutcomeReleased
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
	if len(refs) > MaxBatch {
		return nil, fmt.Errorf("%w: %d claims in one call, at most %d", ErrInvalidLimit, len(refs), MaxBatch)
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
