package skiplocked

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgerr"
)

// Sentinel errors. Every error returned by this package that is caused by one
// of these conditions matches it with [errors.Is].
var (
	// ErrClaimLost means a leased claim is no longer held under the presented
	// claim token: another worker re-claimed the row after the claim expired,
	// or the claim already ended (completed, failed or released). Nothing was
	// changed. The concrete error is a [*ClaimLostError] ([Fail]) or a
	// [*ClaimsLostError] ([Complete], [Release], [Renew]).
	ErrClaimLost = errors.New("skiplocked: claim lost")
	// ErrJobNotFound means no job has the given id.
	ErrJobNotFound = errors.New("skiplocked: job not found")

	// ErrInvalidQueue means a queue name is empty, longer than 128
	// bytes or contains control characters.
	ErrInvalidQueue = errors.New("skiplocked: invalid queue name")
	// ErrInvalidHolder means a holder identity is empty, longer than
	// 512 bytes or contains control characters.
	ErrInvalidHolder = errors.New("skiplocked: invalid holder")
	// ErrInvalidLimit means a batch size (rows per claim) is <= 0 or larger
	// than 10,000.
	ErrInvalidLimit = errors.New("skiplocked: invalid batch size")
	// ErrInvalidTTL means a claim duration is outside 100ms..24h.
	ErrInvalidTTL = errors.New("skiplocked: invalid claim TTL")
	// ErrInvalidToken means a claim token or job id is <= 0.
	ErrInvalidToken = errors.New("skiplocked: invalid claim token or job id")
	// ErrInvalidPayload means a job payload is not valid JSON or is larger
	// than its limit (EnqueueParams.MaxPayloadBytes).
	ErrInvalidPayload = errors.New("skiplocked: invalid payload")
	// ErrInvalidJob means an enqueue option is out of range (max attempts,
	// retry delay, batch length).
	ErrInvalidJob = errors.New("skiplocked: invalid job")
	// ErrInvalidConfig means a [Config] field is out of range.
	ErrInvalidConfig = errors.New("skiplocked: invalid config")
	// ErrNilDB means a nil pool, connection or transaction was passed.
	ErrNilDB = errors.New("skiplocked: nil database handle")
	// ErrTokenExhausted means the claim token sequence reached its maximum.
	// It never wraps around; an operator must intervene.
	ErrTokenExhausted = errors.New("skiplocked: claim token sequence exhausted")
	// ErrConnection means the connection to PostgreSQL failed or was closed
	// (for example by pg_terminate_backend) during the call. Whether a write
	// landed is unknown unless the call documents otherwise; in-transaction
	// claims of that connection are released by the server. [Complete],
	// [Fail] and [Release] may simply be called again: they are idempotent.
	ErrConnection = errors.New("skiplocked: connection lost")
	// ErrNotDrained is the error of [Worker.Drain] when it stopped (its
	// context was cancelled) while the queue still had available or running
	// jobs. The [Summary] it returns counts what was done until then.
	ErrNotDrained = errors.New("skiplocked: queue not drained")
	// ErrNoJobs means a queue has no job at all, in any state: it was never
	// used, its name is misspelt, or its finished jobs were deleted.
	// [Worker.Drain] returns it rather than report an empty queue as a
	// finished one.
	ErrNoJobs = errors.New("skiplocked: queue has no jobs")
	// ErrShutdown is the cause of a handler's context cancellation when the
	// [Worker] stops and [Config].ShutdownTimeout has passed.
	ErrShutdown = errors.New("skiplocked: worker shutting down")
)

// Outcomes of a leased claim, as kept in pgfence.jobs.claim_outcome and
// reported in [ClaimLostError.Outcome].
const (
	// outcomeCompleted: the claim ended with [Complete].
	outcomeCompleted = "completed"
	// outcomeFailed: the claim ended with [Fail] (the job is available for a
	// retry, or dead).
	outcomeFailed = "failed"
	// outcomeReleased: the claim ended with [Release].
	outcomeReleased = "released"
	// "expired": the claim ran out on the job's last attempt and a later
	// claim sent the job to dead.
)

// ClaimLostError reports that a conditional Complete, Fail, Renew or
// Release changed nothing because the job is no longer held under Token.
type ClaimLostError struct {
	// JobID is the job the caller tried to change.
	JobID int64
	// Token is the claim token the caller presented.
	Token int64
	// CurrentToken is the job's claim token now (0 when unknown).
	CurrentToken int64
	// State is the job's state now ("" when unknown).
	State State
	// Holder is the worker of the job's latest claim ("" when unknown).
	Holder string
	// Outcome is how the claim under CurrentToken ended: "completed",
	// "failed", "released" or "expired" (the claim ran out on the job's last
	// attempt and a later claim sent the job to dead); "" while that
	// claim runs, or when unknown. When CurrentToken == Token it says how
	// your own claim ended, by a call other than the one refused (a Complete
	// after your Release, for example).
	Outcome string

	keyHash  []byte // claim_key_hash of the job as read
	wrongKey bool   // Token is the job's claim token, but the key presented is not its key
}

// checkKey marks e when the claim of e.Token is the job's current one but
// key is not its key: such a call is refused as a lost claim, never taken
// for one already done.
func (e *ClaimLostError) checkKey(key [16]byte) {
	if e.CurrentToken != e.Token {
		return
	}
	h := sha256.Sum256(key[:])
	if !bytes.Equal(e.keyHash, h[:]) {
		e.wrongKey = true
	}
}

// Reclaimed reports whether the job was claimed again after the claim of
// Token: another worker holds it now or finished it.
func (e *ClaimLostError) Reclaimed() bool { return e.CurrentToken > e.Token }

// Error describes why the claim is lost.
func (e *ClaimLostError) Error() string {
	switch {
	case e.wrongKey:
		return fmt.Sprintf("skiplocked: claim lost: job %d claim %d was not made with this claim key, state %s", e.JobID, e.Token, e.State)
	case e.CurrentToken > e.Token:
		return fmt.Sprintf("skiplocked: claim lost: job %d was re-claimed with token %d by %q (yours: %d), state %s",
			e.JobID, e.CurrentToken, e.Holder, e.Token, e.State)
	case e.CurrentToken == e.Token && e.Outcome != "":
		return fmt.Sprintf("skiplocked: claim lost: job %d claim %d already ended (%s), state %s", e.JobID, e.Token, e.Outcome, e.State)
	case e.CurrentToken == e.Token:
		return fmt.Sprintf("skiplocked: claim lost: job %d claim %d already ended, state %s", e.JobID, e.Token, e.State)
	default:
		return fmt.Sprintf("skiplocked: claim lost: job %d is not held under token %d (current %d, state %s)",
			e.JobID, e.Token, e.CurrentToken, e.State)
	}
}

// Is reports whether target is [ErrClaimLost].
func (e *ClaimLostError) Is(target error) bool { return target == ErrClaimLost }

// ClaimsLostError is the error of [Complete], [Release] and [Renew] when
// some of their claims changed nothing (lost, or the job does not exist): a
// call with a refused claim is never a plain success. The other claims of
// the call were applied (or had already been applied under the same tokens:
// a retried call is not a loss). errors.Is(err, [ErrClaimLost]) reports
// true, and errors.As(err, &e) with e a [*ClaimLostError] finds the first
// lost claim whose job exists.
type ClaimsLostError struct {
	Op    string     // "complete", "release" or "renew"
	Total int        // claims in the call
	Lost  []ClaimRef // the claims that changed nothing, in the caller's order
	// Details says, for each claim of Lost (same order), what the job looks
	// like now: current token, state, holder and outcome. An entry is nil
	// when the job does not exist (deleted, or a wrong id).
	Details []*ClaimLostError
}

// Error says which claims were refused: the one claim's story for a call
// with one claim, else how many claims were refused, naming the first.
func (e *ClaimsLostError) Error() string {
	if e.Total == 1 && len(e.Lost) == 1 {
		if d := e.Details[0]; d != nil {
			return d.Error()
		}
		return fmt.Sprintf("skiplocked: claim lost: job %d not found", e.Lost[0].JobID)
	}
	first := ""
	if len(e.Lost) > 0 {
		first = fmt.Sprintf(" (first: job %d token %d)", e.Lost[0].JobID, e.Lost[0].Token)
	}
	return fmt.Sprintf("skiplocked: %s refused for %d of %d claims: claim lost%s; the others were applied",
		e.Op, len(e.Lost), e.Total, first)
}

// Is reports whether target is [ErrClaimLost].
func (e *ClaimsLostError) Is(target error) bool { return target == ErrClaimLost }

// Unwrap returns one error per lost claim: its [*ClaimLostError], or an
// error matching [ErrJobNotFound] when the job does not exist.
func (e *ClaimsLostError) Unwrap() []error {
	errs := make([]error, len(e.Lost))
	for i, r := range e.Lost {
		if i < len(e.Details) && e.Details[i] != nil {
			errs[i] = e.Details[i]
		} else {
			errs[i] = fmt.Errorf("%w: id %d", ErrJobNotFound, r.JobID)
		}
	}
	return errs
}

// DBError is a database or connection error of one of this package's calls,
// with the operation that failed. Kind is the sentinel it matches with
// [errors.Is] ([ErrConnection], [ErrTokenExhausted], [ErrInvalidPayload]),
// or nil; Unwrap returns the pgx or PostgreSQL error. On a database without pgfence's schema, its text
// says to run "pgfence migrate up" as the schema owner.
type DBError struct {
	Op   string // "claim", "complete", "enqueue", ...
	Kind error
	Err  error
}

func (e *DBError) Error() string {
	if e.Kind != nil {
		return fmt.Sprintf("%v: %s: %s", e.Kind, e.Op, pgerr.Describe(e.Err))
	}
	return fmt.Sprintf("skiplocked: %s: %s", e.Op, pgerr.Describe(e.Err))
}

// Is reports whether target is the error's Kind.
func (e *DBError) Is(target error) bool { return e.Kind != nil && target == e.Kind }

// Unwrap returns the pgx or PostgreSQL error.
func (e *DBError) Unwrap() error { return e.Err }

// Transient reports whether the same call may succeed when made again (see
// [IsRetryable] for what a retry must tolerate).
func (e *DBError) Transient() bool { return pgerr.IsTransient(e.Err) }

// translate maps pgx and PostgreSQL errors to a *DBError whose Kind is this
// package's sentinel, keeping the original error in the chain.
func translate(op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return &DBError{Op: op, Err: err}
	}
	var kind error
	switch code := pgerr.Code(err); {
	case code == pgerr.SequenceGeneratorLimit:
		kind = ErrTokenExhausted
	case code == pgerr.InvalidTextRepresentation || code == pgerr.InvalidJSONText || pgerr.PayloadTooLarge(err):
		kind = ErrInvalidPayload
	case pgerr.IsConnectionLost(err) || errors.Is(err, pgx.ErrTxClosed):
		kind = ErrConnection
	}
	return &DBError{Op: op, Kind: kind, Err: err}
}

// IsConnectionError reports whether err, returned by a statement run through
// pgx (yours or this package's), means that the connection to PostgreSQL
// failed or was closed, so the session and any open transaction are gone
// (SQLSTATE class 08, 57P01..57P03, network errors, a closed connection or
// pool, [ErrConnection]). It reports false for nil and for a context's end.
//
// A true answer does not say whether the statement took effect (a COMMIT may
// have landed): retry only work that is harmless to run twice, such as this
// package's idempotent [Complete], [Fail] and [Release].
func IsConnectionError(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	return errors.Is(err, ErrConnection) || pgerr.IsConnectionLost(err)
}

// IsRetryable reports whether running the whole transaction again, from
// BEGIN, is the right reaction to err: SQLSTATE 40001 or 40P01 (the server
// rolled it back), or an error for which [IsConnectionError] is true, with
// its caveat. It reports false for nil, a context's end, lock and statement
// timeouts (limits the caller set) and every other error.
func IsRetryable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	return pgerr.IsRetryable(err) || errors.Is(err, ErrConnection)
}
