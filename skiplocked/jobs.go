package skiplocked

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/nilcheck"
)

// Limits checked before anything is sent to the database.
const (
	// MaxQueueLen is the longest queue name, in bytes.
	MaxQueueLen = 128
	// MaxWorkerLen is the longest worker identity, in bytes.
	MaxWorkerLen = 512
	// MaxBatch is the largest number of rows one claim may take.
	MaxBatch = 10000
	// MaxEnqueueBatch is the largest number of jobs one [EnqueueMany] call inserts.
	MaxEnqueueBatch = 100000
	// MinClaimTTL is the shortest leased claim.
	MinClaimTTL = 100 * time.Millisecond
	// MaxClaimTTL is the longest leased claim.
	MaxClaimTTL = 24 * time.Hour
	// MaxRetryDelay is the longest retry delay [Fail] accepts.
	MaxRetryDelay = 365 * 24 * time.Hour
	// MaxErrorLen is the longest last_error kept, in bytes; longer messages
	// are cut at a UTF-8 boundary.
	MaxErrorLen = 8192
	// DefaultMaxAttempts is the max_attempts of a job enqueued without one.
	DefaultMaxAttempts = 25
	// MaxMaxAttempts is the largest max_attempts a job may have.
	MaxMaxAttempts = 1000000
	// NotifyChannel is the LISTEN/NOTIFY channel on which inserts into
	// pgfence.jobs announce their queue (the payload is the queue name).
	NotifyChannel = "pgfence_jobs"
)

// State is the state of a job in pgfence.jobs.
type State string

// The states of a job.
const (
	// StateAvailable: waiting to be claimed once run_at has passed.
	StateAvailable State = "available"
	// StateRunning: held by a leased claim until ClaimExpiresAt.
	StateRunning State = "running"
	// StateCompleted: done.
	StateCompleted State = "completed"
	// StateDead: failed max_attempts times (or given up); LastError kept.
	StateDead State = "dead"
)

// DB is what the functions of this package need to run a statement: a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var queries = dbsqlc.New()

// Job is one row of pgfence.jobs.
type Job struct {
	// ID is the job id, assigned by the database.
	ID int64
	// Queue is the queue the job belongs to.
	Queue string
	// Payload is the job's arguments as JSON (as stored by jsonb).
	Payload json.RawMessage
	// Priority orders claims: lower first.
	Priority int16
	// RunAt is the earliest database time the job may be claimed.
	RunAt time.Time
	// Attempts counts leased claims so far (in-transaction claims count
	// only failures).
	Attempts int
	// MaxAttempts is the number of attempts before the job goes dead.
	MaxAttempts int
	// State is available, running, completed or dead.
	State State
	// ClaimedBy is the worker of the latest leased claim ("" if never claimed).
	ClaimedBy string
	// ClaimToken is the token of the latest leased claim (0 if never
	// claimed). Pass [Job.Ref] to Complete, Fail, Heartbeat and Release.
	ClaimToken int64
	// ClaimExpiresAt is the database time the current claim ends; zero unless
	// State is running.
	ClaimExpiresAt time.Time
	// LastError is the message of the latest failure or expired claim.
	LastError string
	// CreatedAt is the database time of the insert.
	CreatedAt time.Time
	// UpdatedAt is the database time of the latest change by pgfence.
	UpdatedAt time.Time
	// FinishedAt is zero unless State is completed or dead.
	FinishedAt time.Time
}

// ClaimRef names one leased claim: a job and the claim token it was claimed
// with. Every change made under a claim is conditional on both.
type ClaimRef struct {
	// JobID is the claimed job.
	JobID int64
	// Token is the claim token the job was claimed with.
	Token int64
}

// Ref returns the claim reference of a job returned by [Claim].
func (j Job) Ref() ClaimRef { return ClaimRef{JobID: j.ID, Token: j.ClaimToken} }

func jobFromRow(r dbsqlc.PgfenceJob) Job {
	j := Job{
		ID: r.ID, Queue: r.Queue, Payload: json.RawMessage(r.Payload), Priority: r.Priority, RunAt: r.RunAt,
		Attempts: int(r.Attempts), MaxAttempts: int(r.MaxAttempts), State: State(r.State),
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
	}
	if r.ClaimedBy != nil {
		j.ClaimedBy = *r.ClaimedBy
	}
	if r.ClaimToken.Valid {
		j.ClaimToken = r.ClaimToken.Int64
	}
	if r.ClaimExpiresAt != nil {
		j.ClaimExpiresAt = *r.ClaimExpiresAt
	}
	if r.LastError != nil {
		j.LastError = *r.LastError
	}
	if r.FinishedAt != nil {
		j.FinishedAt = *r.FinishedAt
	}
	return j
}

// EnqueueParams describe one job to insert.
type EnqueueParams struct {
	// Queue is the queue name, 1..[MaxQueueLen] bytes, no control characters.
	Queue string
	// Payload is the job's arguments as JSON. Defaults to {} when empty;
	// invalid JSON is refused with [ErrInvalidPayload].
	Payload json.RawMessage
	// Priority orders claims: lower first. Defaults to 0.
	Priority int16
	// RunAt is the earliest time the job may be claimed. Defaults to now()
	// on the database clock when zero.
	RunAt time.Time
	// MaxAttempts is the number of attempts before the job goes dead.
	// Defaults to [DefaultMaxAttempts] when 0; at most [MaxMaxAttempts].
	MaxAttempts int
	// MaxPayloadBytes bounds len(Payload): a larger payload is refused with
	// [ErrInvalidPayload] before any SQL runs. 0 means
	// [DefaultMaxPayloadBytes]; a negative value means no limit (PostgreSQL's
	// own jsonb limit of about 255 MB still applies, after the client has
	// encoded the whole payload).
	MaxPayloadBytes int
}

// DefaultMaxPayloadBytes is the payload limit of [EnqueueParams] when
// MaxPayloadBytes is 0: 1 MiB. Jobs carry references to large data (a file
// name, an object key), not the data.
const DefaultMaxPayloadBytes = 1 << 20

func (p EnqueueParams) normalize() (EnqueueParams, error) {
	if err := checkQueue(p.Queue); err != nil {
		return p, err
	}
	limit := p.MaxPayloadBytes
	if limit == 0 {
		limit = DefaultMaxPayloadBytes
	}
	if limit > 0 && len(p.Payload) > limit {
		return p, fmt.Errorf("%w: %d bytes (queue %q), the limit is %d (EnqueueParams.MaxPayloadBytes)",
			ErrInvalidPayload, len(p.Payload), p.Queue, limit)
	}
	if len(p.Payload) == 0 {
		p.Payload = json.RawMessage("{}")
	} else if !json.Valid(p.Payload) {
		return p, fmt.Errorf("%w (queue %q)", ErrInvalidPayload, p.Queue)
	}
	if p.MaxAttempts == 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	if p.MaxAttempts < 1 || p.MaxAttempts > MaxMaxAttempts {
		return p, fmt.Errorf("%w: max attempts %d not in 1..%d", ErrInvalidJob, p.MaxAttempts, MaxMaxAttempts)
	}
	return p, nil
}

// Enqueue inserts one job and returns it. Inserting notifies
// [NotifyChannel] with the queue name when the transaction commits, which
// wakes listening [Worker]s. Run it on a transaction to enqueue atomically
// with other writes.
func Enqueue(ctx context.Context, db DB, p EnqueueParams) (Job, error) {
	if nilcheck.IsNil(db) {
		return Job{}, ErrNilDB
	}
	p, err := p.normalize()
	if err != nil {
		return Job{}, err
	}
	arg := dbsqlc.EnqueueJobParams{
		Queue: p.Queue, Payload: p.Payload, Priority: p.Priority, MaxAttempts: int32(p.MaxAttempts),
	}
	if !p.RunAt.IsZero() {
		arg.RunAt = &p.RunAt
	}
	row, err := queries.EnqueueJob(ctx, db, arg)
	if err != nil {
		return Job{}, translate("enqueue", err)
	}
	return jobFromRow(row), nil
}

// EnqueueMany inserts up to [MaxEnqueueBatch] jobs in one statement and
// returns their ids in the order given. Every job is validated first; one bad
// job fails the call and nothing is inserted.
func EnqueueMany(ctx context.Context, db DB, ps []EnqueueParams) ([]int64, error) {
	if nilcheck.IsNil(db) {
		return nil, ErrNilDB
	}
	if len(ps) == 0 {
		return nil, nil
	}
	if len(ps) > MaxEnqueueBatch {
		return nil, fmt.Errorf("%w: %d jobs in one batch, at most %d", ErrInvalidJob, len(ps), MaxEnqueueBatch)
	}
	arg := dbsqlc.EnqueueJobsParams{
		Queues: make([]string, len(ps)), Payloads: make([]string, len(ps)), Priorities: make([]int16, len(ps)),
		RunAts: make([]time.Time, len(ps)), RunNows: make([]bool, len(ps)), MaxAttempts: make([]int32, len(ps)),
	}
	for i, p := range ps {
		p, err := p.normalize()
		if err != nil {
			return nil, fmt.Errorf("job %d: %w", i, err)
		}
		arg.Queues[i], arg.Payloads[i], arg.Priorities[i] = p.Queue, string(p.Payload), p.Priority
		arg.MaxAttempts[i] = int32(p.MaxAttempts)
		if p.RunAt.IsZero() {
			arg.RunNows[i], arg.RunAts[i] = true, time.Unix(0, 0)
		} else {
			arg.RunAts[i] = p.RunAt
		}
	}
	ids, err := queries.EnqueueJobs(ctx, db, arg)
	if err != nil {
		return nil, translate("enqueue many", err)
	}
	return ids, nil
}

// ClaimParams describe one leased claim.
type ClaimParams struct {
	// Queue to claim from.
	Queue string
	// Worker identifies the claimer (stored in claimed_by), 1..[MaxWorkerLen] bytes.
	Worker string
	// Limit is the most rows to claim, 1..[MaxBatch].
	Limit int
	// TTL is how long the claims last on the database clock,
	// [MinClaimTTL]..[MaxClaimTTL]. Extend them with [Heartbeat].
	TTL time.Duration
}

// Claim is the leased claim. In one statement it takes up to p.Limit
// claimable jobs of p.Queue, skipping rows other transactions have locked
// (FOR UPDATE SKIP LOCKED, so it never waits for another worker), marks them
// running with a new claim token each (from a sequence that never cycles, so a
// row's next claim always has a larger token) and an expiry of now() + p.TTL on
// the database clock, and returns them in claim order (priority, run_at, id).
//
// Claimable means available with run_at <= now(), or running with an expired
// claim: the previous holder's token stops matching, so its Complete, Fail,
// Heartbeat and Release calls get [ErrClaimLost] and change nothing. An
// expired claim on a job with no attempts left sends it to dead instead.
//
// The claims are committed when Claim returns (run it on a pool or
// connection, not inside a long transaction, or the rows stay locked until
// that transaction ends). Each claim counts as an attempt. If ctx is
// cancelled the statement is cancelled; it then either took effect fully or
// not at all, and unreported claims simply expire.
func Claim(ctx context.Context, db DB, p ClaimParams) ([]Job, error) {
	if nilcheck.IsNil(db) {
		return nil, ErrNilDB
	}
	if err := checkQueue(p.Queue); err != nil {
		return nil, err
	}
	if err := checkWorker(p.Worker); err != nil {
		return nil, err
	}
	if err := checkLimit(p.Limit); err != nil {
		return nil, err
	}
	if err := checkTTL(p.TTL); err != nil {
		return nil, err
	}
	rows, err := queries.ClaimJobs(ctx, db, dbsqlc.ClaimJobsParams{
		Queue: p.Queue, MaxJobs: int32(p.Limit), Worker: p.Worker, TtlMs: p.TTL.Milliseconds(),
	})
	if err != nil {
		return nil, translate("claim", err)
	}
	jobs := make([]Job, len(rows))
	for i, r := range rows {
		jobs[i] = jobFromRow(dbsqlc.PgfenceJob(r))
	}
	return jobs, nil
}

// Complete marks a claimed job completed, only if it is still running under
// ref.Token. Otherwise it returns a [*ClaimLostError] ([ErrClaimLost]) or
// [ErrJobNotFound] and changes nothing. A claim that expired but was not
// re-claimed by anyone can still be completed: the token, not the clock,
// decides.
//
// Complete is idempotent: when the job is already completed under ref.Token
// (an earlier call landed but its reply was lost, or the handler completed it
// itself), it returns nil. It refuses only real losses: the job was claimed
// again (a larger token), or the claim of ref.Token ended otherwise
// (released, failed, expired; [ClaimLostError.Outcome] says which).
func Complete(ctx context.Context, db DB, ref ClaimRef) error {
	return single(ctx, db, "complete", ref, func(ids, tokens []int64) ([]int64, error) {
		return queries.CompleteJobs(ctx, db, ids, tokens)
	})
}

// CompleteMany completes many claims in one statement. Each job changes only
// if it is still running under its token; a job already completed under its
// token counts as completed (see [Complete]). The refs that did not change
// (their claims were lost, or the jobs do not exist) are returned in lost,
// together with a *[ClaimsLostError] ([ErrClaimLost]): code that checks only
// err never takes a refused completion for a success. The other claims of
// the batch were completed.
func CompleteMany(ctx context.Context, db DB, refs []ClaimRef) (lost []ClaimRef, err error) {
	return conditional(ctx, db, "complete", refs, func(ids, tokens []int64) ([]int64, error) {
		return queries.CompleteJobs(ctx, db, ids, tokens)
	})
}

// Release gives a claim back unfinished: the job is available again at once
// and the attempt is not counted. Conditional on ref like [Complete], and
// idempotent like it: a claim already released under ref.Token returns nil.
func Release(ctx context.Context, db DB, ref ClaimRef) error {
	return single(ctx, db, "release", ref, func(ids, tokens []int64) ([]int64, error) {
		return queries.ReleaseJobs(ctx, db, ids, tokens)
	})
}

// ReleaseMany releases many claims in one statement; see [Release] and
// [CompleteMany] for lost.
func ReleaseMany(ctx context.Context, db DB, refs []ClaimRef) (lost []ClaimRef, err error) {
	return conditional(ctx, db, "release", refs, func(ids, tokens []int64) ([]int64, error) {
		return queries.ReleaseJobs(ctx, db, ids, tokens)
	})
}

// Heartbeat extends a claim to now() + ttl on the database clock, only if it
// is still held under ref.Token, and returns the new expiry. Otherwise it
// returns a [*ClaimLostError] or [ErrJobNotFound]; a claim that already ended
// (even by your own Complete) cannot be extended, so Heartbeat is the one
// call that reports such a claim as lost. It never waits for a row lock: if
// another transaction holds the job's row at that moment, the claim is not
// extended and Heartbeat returns an error that is not [ErrClaimLost] (the
// claim is still held: call again). The expiry it returns is advisory: a
// worker that pauses past it may lose the claim at any moment, and only the
// conditional Complete/Fail decides.
func Heartbeat(ctx context.Context, db DB, ref ClaimRef, ttl time.Duration) (time.Time, error) {
	if err := checkTTL(ttl); err != nil {
		return time.Time{}, err
	}
	var exp time.Time
	err := single(ctx, db, "heartbeat", ref, func(ids, tokens []int64) ([]int64, error) {
		rows, err := queries.HeartbeatJobs(ctx, db, dbsqlc.HeartbeatJobsParams{TtlMs: ttl.Milliseconds(), Ids: ids, ClaimTokens: tokens})
		done := make([]int64, len(rows))
		for i, r := range rows {
			done[i] = r.ID
			if r.ClaimExpiresAt != nil {
				exp = *r.ClaimExpiresAt
			}
		}
		return done, err
	})
	if err != nil {
		return time.Time{}, err
	}
	if exp.IsZero() {
		return time.Time{}, fmt.Errorf("skiplocked: heartbeat: job %d is locked by another transaction at the moment; "+
			"claim %d not extended (it is still held: call again)", ref.JobID, ref.Token)
	}
	return exp, nil
}

// HeartbeatMany extends many claims in one statement. It returns the new
// expiry of each extended job by id, and the refs that were lost with a
// *[ClaimsLostError] (claims that ended, even by your own Complete, are not
// extended: see [Heartbeat]). It never waits for a row lock: a claim still
// held under its token whose row another transaction has locked at that
// moment (your own completion in progress, typically) is skipped, neither in
// the map nor lost; the next heartbeat extends it.
func HeartbeatMany(ctx context.Context, db DB, refs []ClaimRef, ttl time.Duration) (map[int64]time.Time, []ClaimRef, error) {
	if err := checkTTL(ttl); err != nil {
		return nil, nil, err
	}
	exp := make(map[int64]time.Time, len(refs))
	lost, err := conditional(ctx, db, "heartbeat", refs, func(ids, tokens []int64) ([]int64, error) {
		rows, err := queries.HeartbeatJobs(ctx, db, dbsqlc.HeartbeatJobsParams{TtlMs: ttl.Milliseconds(), Ids: ids, ClaimTokens: tokens})
		done := make([]int64, len(rows))
		for i, r := range rows {
			done[i] = r.ID
			if r.ClaimExpiresAt != nil {
				exp[r.ID] = *r.ClaimExpiresAt
			}
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
func Fail(ctx context.Context, db DB, ref ClaimRef, p FailParams) (Job, error) {
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
	})
	if errors.Is(err, pgx.ErrNoRows) {
		lost, err := claimState(ctx, db, "fail", ref)
		if err != nil {
			return Job{}, err
		}
		if lost.CurrentToken != ref.Token || lost.Outcome != OutcomeFailed {
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

// GetJob returns one job, or [ErrJobNotFound].
func GetJob(ctx context.Context, db DB, id int64) (Job, error) {
	if nilcheck.IsNil(db) {
		return Job{}, ErrNilDB
	}
	row, err := queries.GetJob(ctx, db, id)
	if errors.Is(err, pgx.ErrNoRows) {
		return Job{}, fmt.Errorf("%w: id %d", ErrJobNotFound, id)
	}
	if err != nil {
		return Job{}, translate("get job", err)
	}
	return jobFromRow(row), nil
}

// DeleteFinished deletes up to limit completed or dead jobs that finished
// before the given time and returns how many it deleted. Call it in a loop
// to prune a large backlog in small transactions.
func DeleteFinished(ctx context.Context, db DB, before time.Time, limit int) (int64, error) {
	if nilcheck.IsNil(db) {
		return 0, ErrNilDB
	}
	if err := checkLimit(limit); err != nil {
		return 0, err
	}
	n, err := queries.DeleteFinishedJobs(ctx, db, before, int32(limit))
	if err != nil {
		return 0, translate("delete finished", err)
	}
	return n, nil
}

// ClaimJobsTx is the in-transaction claim on pgfence.jobs: it locks up to
// limit available, due jobs of queue with FOR UPDATE SKIP LOCKED for tx and
// returns them. Nothing is written: the row locks are the claim and last
// until tx commits or rolls back; if the worker dies its connection closes
// and PostgreSQL releases them at once. Finish each job in the same tx with
// [CompleteJobTx] or [FailJobTx]; a rollback makes the jobs available again
// without counting an attempt.
func ClaimJobsTx(ctx context.Context, tx pgx.Tx, queue string, limit int) ([]Job, error) {
	if nilcheck.IsNil(tx) {
		return nil, ErrNilDB
	}
	if err := checkQueue(queue); err != nil {
		return nil, err
	}
	if err := checkLimit(limit); err != nil {
		return nil, err
	}
	rows, err := queries.ClaimJobsTx(ctx, tx, queue, int32(limit))
	if err != nil {
		return nil, translate("claim in transaction", err)
	}
	jobs := make([]Job, len(rows))
	for i, r := range rows {
		jobs[i] = jobFromRow(r)
	}
	return jobs, nil
}

// CompleteJobTx marks a job claimed by [ClaimJobsTx] completed, in the same
// transaction. It returns [ErrJobNotFound] if no available job has that id.
// It must run in the transaction that claimed the job: the row lock is what
// makes it safe.
func CompleteJobTx(ctx context.Context, tx pgx.Tx, id int64) error {
	if nilcheck.IsNil(tx) {
		return ErrNilDB
	}
	if id <= 0 {
		return fmt.Errorf("%w: job id %d", ErrInvalidToken, id)
	}
	n, err := queries.CompleteJobTx(ctx, tx, id)
	if err != nil {
		return translate("complete in transaction", err)
	}
	if n == 0 {
		return fmt.Errorf("%w: no available job %d", ErrJobNotFound, id)
	}
	return nil
}

// FailJobTx records a failed attempt of a job claimed by [ClaimJobsTx], in
// the same transaction: attempts + 1, then available at now() + p.RetryIn, or
// dead when no attempts are left or p.GiveUp. The change commits with tx.
func FailJobTx(ctx context.Context, tx pgx.Tx, id int64, p FailParams) (Job, error) {
	if nilcheck.IsNil(tx) {
		return Job{}, ErrNilDB
	}
	if id <= 0 {
		return Job{}, fmt.Errorf("%w: job id %d", ErrInvalidToken, id)
	}
	if p.RetryIn < 0 || p.RetryIn > MaxRetryDelay {
		return Job{}, fmt.Errorf("%w: retry delay %s not in 0..%s", ErrInvalidJob, p.RetryIn, MaxRetryDelay)
	}
	row, err := queries.FailJobTx(ctx, tx, dbsqlc.FailJobTxParams{
		GiveUp: p.GiveUp, RetryInMs: p.RetryIn.Milliseconds(), LastError: cutError(p.Error), ID: id,
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return Job{}, fmt.Errorf("%w: no available job %d", ErrJobNotFound, id)
	}
	if err != nil {
		return Job{}, translate("fail in transaction", err)
	}
	return jobFromRow(row), nil
}

// single runs a conditional update for one ref and explains a refusal with a
// *ClaimLostError (or ErrJobNotFound).
func single(ctx context.Context, db DB, op string, ref ClaimRef, run func(ids, tokens []int64) ([]int64, error)) error {
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
// outcome op writes. A heartbeat is never "already done".
func alreadyDone(op string, ref ClaimRef, e *ClaimLostError) bool {
	if e == nil || e.CurrentToken != ref.Token {
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
func conditional(ctx context.Context, db DB, op string, refs []ClaimRef, run func(ids, tokens []int64) ([]int64, error)) ([]ClaimRef, error) {
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
	for i, r := range refs {
		if err := checkRef(r); err != nil {
			return nil, err
		}
		ids[i], tokens[i] = r.JobID, r.Token
	}
	done, err := run(ids, tokens)
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
			e = &ClaimLostError{JobID: r.JobID, Token: r.Token, CurrentToken: e.CurrentToken, State: e.State, ClaimedBy: e.ClaimedBy, Outcome: e.Outcome}
		}
		if alreadyDone(op, r, e) {
			continue
		}
		if op == "heartbeat" && e != nil && e.CurrentToken == r.Token && e.State == StateRunning {
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
func claimStates(ctx context.Context, db DB, refs []ClaimRef) (map[int64]*ClaimLostError, error) {
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
		if row.ClaimedBy != nil {
			e.ClaimedBy = *row.ClaimedBy
		}
		if row.ClaimOutcome != nil {
			e.Outcome = *row.ClaimOutcome
		}
		m[row.ID] = e
	}
	return m, nil
}

// claimState reads one job's claim columns as a *ClaimLostError for ref, or
// returns ErrJobNotFound, or the read's error (translated for op).
func claimState(ctx context.Context, db DB, op string, ref ClaimRef) (*ClaimLostError, error) {
	m, err := claimStates(ctx, db, []ClaimRef{ref})
	if err != nil {
		return nil, translate(op+": read the claim", err)
	}
	e := m[ref.JobID]
	if e == nil {
		return nil, fmt.Errorf("%w: id %d", ErrJobNotFound, ref.JobID)
	}
	e.Token = ref.Token
	return e, nil
}

func checkRef(r ClaimRef) error {
	if r.JobID <= 0 || r.Token <= 0 {
		return fmt.Errorf("%w: job %d token %d", ErrInvalidToken, r.JobID, r.Token)
	}
	return nil
}

func checkName(s string, maxLen int, sentinel error) error {
	if s == "" {
		return fmt.Errorf("%w: empty", sentinel)
	}
	if len(s) > maxLen {
		return fmt.Errorf("%w: %d bytes, at most %d", sentinel, len(s), maxLen)
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: not valid UTF-8", sentinel)
	}
	if strings.IndexFunc(s, unicode.IsControl) >= 0 {
		return fmt.Errorf("%w: %q contains control characters", sentinel, s)
	}
	return nil
}

func checkQueue(q string) error  { return checkName(q, MaxQueueLen, ErrInvalidQueue) }
func checkWorker(w string) error { return checkName(w, MaxWorkerLen, ErrInvalidWorker) }

func checkLimit(n int) error {
	if n <= 0 || n > MaxBatch {
		return fmt.Errorf("%w: %d not in 1..%d", ErrInvalidLimit, n, MaxBatch)
	}
	return nil
}

func checkTTL(d time.Duration) error {
	if d < MinClaimTTL || d > MaxClaimTTL {
		return fmt.Errorf("%w: %s not in %s..%s", ErrInvalidTTL, d, MinClaimTTL, MaxClaimTTL)
	}
	return nil
}

func cutError(s string) string {
	if len(s) <= MaxErrorLen {
		return strings.ToValidUTF8(s, "?")
	}
	s = s[:MaxErrorLen]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}
