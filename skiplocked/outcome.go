package skiplocked

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
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
// not exist) it returns an error matching [pgfence.ErrLost]: one
// [*pgfence.Error] per lost ref, joined with errors.Join when there are
// several (see [Renew]); the other claims were completed. Code that checks
// only err never takes a refused completion for a success. With no refs it
// does nothing and returns nil.
func Complete(ctx context.Context, db pgfence.DBTX, refs ...ClaimRef) error {
	lost, infos, err := completeRefs(ctx, db, refs)
	if err != nil {
		return err
	}
	return lostErrors(opComplete, lost, infos)
}

func completeRefs(ctx context.Context, db pgfence.DBTX, refs []ClaimRef) ([]ClaimRef, []*claimInfo, error) {
	return conditional(ctx, db, opComplete, refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.CompleteJobs(ctx, db, dbsqlc.CompleteJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
}

// Release gives claims back unfinished, in one statement: each job is
// available again at once and the attempt is not counted. Conditional on
// each ref like [Complete], idempotent like it (a claim already released
// under its ref's token counts as released), and refused claims are
// reported like it.
func Release(ctx context.Context, db pgfence.DBTX, refs ...ClaimRef) error {
	lost, infos, err := releaseRefs(ctx, db, refs)
	if err != nil {
		return err
	}
	return lostErrors(opRelease, lost, infos)
}

func releaseRefs(ctx context.Context, db pgfence.DBTX, refs []ClaimRef) ([]ClaimRef, []*claimInfo, error) {
	return conditional(ctx, db, opRelease, refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		return queries.ReleaseJobs(ctx, db, dbsqlc.ReleaseJobsParams{Ids: ids, ClaimTokens: tokens, Keys: keys})
	})
}

// Renew extends claims to now() + ttl on the database clock, in one
// statement, each only if it is still held under its ref's token. ttl is
// 100ms..24h, like [ClaimParams].TTL. expires[i] is the new (advisory) expiry
// of refs[i], zero when it was not extended.
//
// Claims that were lost give an error matching [pgfence.ErrLost], reported
// as by [Complete] and [Release]: one [*pgfence.Error] per lost ref (Token:
// the ref's token; Holder: the job's holder now; Reason: "job 7: reclaimed
// by token 9, state running", "job 7: claim already ended (completed),
// state completed", ...; a job that does not exist also matches
// [pgfence.ErrNotFound]), joined with errors.Join when there are several
// (its Unwrap() []error lists them, in the order of refs). A claim that
// already ended, even by your own Complete, counts as lost. Renew never
// waits for a row lock: a claim whose row another transaction holds at that
// moment (a completion in progress, say) is not extended and not lost; when
// that is the only reason some claims were not extended the error matches
// [pgfence.ErrLocked], not [pgfence.ErrLost] (call again).
func Renew(ctx context.Context, db pgfence.DBTX, ttl time.Duration, refs ...ClaimRef) ([]time.Time, error) {
	expires, lost, infos, skipped, err := renew(ctx, db, ttl, refs)
	if err != nil {
		return nil, err
	}
	if len(lost) > 0 {
		return expires, lostErrors(opRenew, lost, infos)
	}
	if skipped > 0 {
		return expires, &pgfence.Error{Op: opRenew, Kind: pgfence.ErrLocked,
			Reason: fmt.Sprintf("%d of %d claims locked by another transaction at the moment; not extended (still held: call again)",
				skipped, len(refs))}
	}
	return expires, nil
}

// renew is [Renew] for the Worker: a claim skipped because its row was
// locked is not an error (the next renewal extends it). err is a failure of
// the call, never a lost claim.
func renew(ctx context.Context, db pgfence.DBTX, ttl time.Duration, refs []ClaimRef) (expires []time.Time, lost []ClaimRef, infos []*claimInfo, skipped int, err error) {
	if err := checkTTL(opRenew, "ttl", ttl); err != nil {
		return nil, nil, nil, 0, err
	}
	exp := make(map[int64]time.Time, len(refs))
	lost, infos, err = conditional(ctx, db, opRenew, refs, func(ids, tokens []int64, keys [][]byte) ([]int64, error) {
		rows, err := queries.HeartbeatJobs(ctx, db, dbsqlc.HeartbeatJobsParams{TtlMs: ttl.Milliseconds(), Ids: ids, ClaimTokens: tokens, Keys: keys})
		done := make([]int64, len(rows))
		for i, r := range rows {
			done[i] = r.ID
			exp[r.ID] = r.ClaimExpiresAt
		}
		return done, err
	})
	if err != nil {
		return nil, nil, nil, 0, err
	}
	// exp is by job id: a lost ref of a job whose live claim (another ref)
	// was extended gets no expiry.
	isLost := make(map[ClaimRef]bool, len(lost))
	for _, r := range lost {
		isLost[r] = true
	}
	expires = make([]time.Time, len(refs))
	for i, r := range refs {
		if !isLost[r] {
			expires[i] = exp[r.JobID]
		}
	}
	for _, e := range expires {
		if e.IsZero() {
			skipped++
		}
	}
	return expires, lost, infos, skipped - len(lost), nil
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
// the job as it is now. A lost claim gives an error matching
// [pgfence.ErrLost] (as [Renew] describes it) and changes nothing. Fail is idempotent: when the claim of ref.Token already ended with
// a Fail (a retry after a lost reply) it returns the job as it is now and
// nil; the first call's p is the one that was recorded.
func Fail(ctx context.Context, db pgfence.DBTX, ref ClaimRef, p FailParams) (Job, error) {
	job, lost, err := fail(ctx, db, ref, p)
	if lost != nil {
		return Job{}, lostError(opFail, "", ref, lost)
	}
	return job, err
}

// fail is [Fail], with the claim's state when it was lost.
func fail(ctx context.Context, db pgfence.DBTX, ref ClaimRef, p FailParams) (Job, *claimInfo, error) {
	if nilcheck.IsNil(db) {
		return Job{}, nil, nilDB(opFail)
	}
	if err := checkRef(opFail, ref); err != nil {
		return Job{}, nil, err
	}
	if p.RetryIn < 0 || p.RetryIn > maxRetryDelay {
		return Job{}, nil, invalid(opFail, "FailParams.RetryIn", "%s not in 0..%s", p.RetryIn, maxRetryDelay)
	}
	row, err := queries.FailJob(ctx, db, dbsqlc.FailJobParams{
		GiveUp: p.GiveUp, RetryInMs: p.RetryIn.Milliseconds(), LastError: cutError(p.Error), ID: ref.JobID, ClaimToken: ref.Token,
		Key: ref.Key[:],
	})
	if errors.Is(err, pgx.ErrNoRows) {
		lost, err := claimState(ctx, db, opFail, ref)
		if err != nil {
			return Job{}, nil, err
		}
		if lost.CurrentToken != ref.Token || lost.wrongKey || lost.Outcome != outcomeFailed {
			return Job{}, lost, nil
		}
		// Already failed under this token: report the job as it is now.
		job, err := GetJob(ctx, db, ref.JobID)
		return job, nil, err
	}
	if err != nil {
		return Job{}, nil, dbError(opFail, "", "", err)
	}
	return jobFromRow(row), nil, nil
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
func alreadyDone(op string, ref ClaimRef, e *claimInfo) bool {
	if e == nil || e.CurrentToken != ref.Token || e.wrongKey {
		return false
	}
	switch op {
	case opComplete:
		return e.Outcome == outcomeCompleted
	case opRelease:
		return e.Outcome == outcomeReleased
	}
	return false
}

// conditional runs a batch update conditional on (id, token) and returns the
// refs that did not change (lost) and, for each, its job's claim as read
// (nil when the job does not exist). Refs
// that did not change because they had already been applied under their
// token (see alreadyDone) are not lost. When the rows of unchanged refs
// cannot be read to tell which is which, it returns that error (the whole
// call may be retried: every op is conditional and idempotent).
func conditional(ctx context.Context, db pgfence.DBTX, op string, refs []ClaimRef, run func(ids, tokens []int64, keys [][]byte) ([]int64, error)) ([]ClaimRef, []*claimInfo, error) {
	if nilcheck.IsNil(db) {
		return nil, nil, nilDB(op)
	}
	if len(refs) == 0 {
		return nil, nil, nil
	}
	if len(refs) > maxBatch {
		return nil, nil, invalid(op, "refs", "%d claims in one call, at most %d", len(refs), maxBatch)
	}
	ids := make([]int64, len(refs))
	tokens := make([]int64, len(refs))
	keys := make([][]byte, len(refs))
	for i := range refs {
		r := &refs[i] // keys[i] points into refs: no copy of the key per ref
		if err := checkRef(op, *r); err != nil {
			return nil, nil, err
		}
		ids[i], tokens[i], keys[i] = r.JobID, r.Token, r.Key[:]
	}
	done, err := run(ids, tokens, keys)
	if err != nil {
		return nil, nil, dbError(op, "", "", err)
	}
	if len(done) == len(refs) {
		return nil, nil, nil
	}
	ok := make(map[int64]bool, len(done))
	for _, id := range done {
		ok[id] = true
	}
	// A changed id says which ref changed only when refs name its job with
	// one ref. With two claims of one job (a lost claim and the live one: a
	// Worker that claimed its own expired job again holds both; or one token
	// with two keys) the statement changed the job under one of them, and
	// the claim read below tells which.
	refOf := make(map[int64]ClaimRef, len(refs))
	for _, r := range refs {
		if first, seen := refOf[r.JobID]; !seen {
			refOf[r.JobID] = r
		} else if first != r {
			ok[r.JobID] = false
		}
	}
	var unchanged []ClaimRef
	for _, r := range refs {
		if !ok[r.JobID] {
			unchanged = append(unchanged, r)
		}
	}
	if len(unchanged) == 0 { // the same job twice in refs
		return nil, nil, nil
	}
	states, err := claimStates(ctx, db, unchanged)
	if err != nil {
		return nil, nil, dbError(op, "", "read the claims that changed nothing", err)
	}
	var lost []ClaimRef
	var details []*claimInfo
	for _, r := range unchanged {
		e := states[r.JobID]
		if e != nil {
			e = &claimInfo{JobID: r.JobID, Token: r.Token, CurrentToken: e.CurrentToken, State: e.State, Holder: e.Holder, Outcome: e.Outcome,
				keyHash: e.keyHash}
			e.checkKey(r.Key)
		}
		if alreadyDone(op, r, e) {
			continue
		}
		if op == opRenew && e != nil && !e.wrongKey && e.CurrentToken == r.Token && e.State == StateRunning {
			continue // still held, its row locked for a moment: not extended this time
		}
		lost = append(lost, r)
		details = append(details, e)
	}
	return lost, details, nil
}

// claimStates reads the claim columns of the jobs of refs, by job id (the
// Token field of each entry is 0; missing jobs have no entry).
func claimStates(ctx context.Context, db pgfence.DBTX, refs []ClaimRef) (map[int64]*claimInfo, error) {
	ids := make([]int64, len(refs))
	for i, r := range refs {
		ids[i] = r.JobID
	}
	rows, err := queries.GetJobClaims(ctx, db, ids)
	if err != nil {
		return nil, err
	}
	m := make(map[int64]*claimInfo, len(rows))
	for _, row := range rows {
		e := &claimInfo{JobID: row.ID, State: State(row.State)}
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

// claimState reads one job's claim columns for ref, or returns an error
// matching pgfence.ErrNotFound, or the read's error (for op).
func claimState(ctx context.Context, db pgfence.DBTX, op string, ref ClaimRef) (*claimInfo, error) {
	m, err := claimStates(ctx, db, []ClaimRef{ref})
	if err != nil {
		return nil, dbError(op, "", "read the claim", err)
	}
	e := m[ref.JobID]
	if e == nil {
		return nil, notFound(op, ref.JobID, "job")
	}
	e.Token = ref.Token
	e.checkKey(ref.Key)
	return e, nil
}
