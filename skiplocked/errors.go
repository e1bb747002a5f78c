package skiplocked

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// The errors of this package are [*pgfence.Error]s; the helpers below build
// them. Op names the exported call ("skiplocked.Complete", ...), Name the
// queue where it is known.

// The operations, as Op says them.
const (
	opClaim          = "skiplocked.Claim"
	opClaimTx        = "skiplocked.ClaimTx"
	opCompleteTx     = "skiplocked.CompleteTx"
	opFailTx         = "skiplocked.FailTx"
	opComplete       = "skiplocked.Complete"
	opRelease        = "skiplocked.Release"
	opRenew          = "skiplocked.Renew"
	opFail           = "skiplocked.Fail"
	opEnqueue        = "skiplocked.Enqueue"
	opGetJob         = "skiplocked.GetJob"
	opDeleteFinished = "skiplocked.DeleteFinished"
	opQueueDepths    = "skiplocked.QueueDepths"
	opNewWorker      = "skiplocked.NewWorker"
	opNewTxWorker    = "skiplocked.NewTxWorker"
	opRun            = "skiplocked.Worker.Run"
	opDrain          = "skiplocked.Worker.Drain"
	opWorker         = "skiplocked.Worker" // the worker's own statements (renewals, outcomes)
)

// errShutdown is the cause of a handler's context cancellation when the
// Worker stops and Config.ShutdownTimeout has passed.
var errShutdown error = &pgfence.Error{Op: opWorker, Kind: pgfence.ErrClosed, Reason: "the worker is shutting down"}

// invalid is rejected input (pgfence.ErrInvalid): arg names the argument,
// the rest says what is wrong with it. Nothing was sent to the database.
func invalid(op, arg, format string, args ...any) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Reason: arg + ": " + fmt.Sprintf(format, args...)}
}

// nilDB is a nil pool, connection or transaction.
func nilDB(op string) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Reason: "db: nil database handle"}
}

// notFound says job id does not exist (pgfence.ErrNotFound).
func notFound(op string, id int64, what string) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrNotFound, Reason: fmt.Sprintf("no %s %d", what, id)}
}

// dbError is a database or connection failure of op (on queue name, if
// known); step, if not empty, says which statement of op failed. A token
// sequence at its maximum is pgfence.ErrTokenExhausted, a payload the
// database refused pgfence.ErrInvalid, one of pgfence's SQLSTATEs the kind
// its table gives (PF011 pgfence.ErrInvalid; PFHA1 none, retryable); every
// other failure has no Kind.
func dbError(op, name, step string, err error) *pgfence.Error {
	e := &pgfence.Error{Op: op, Name: name, Reason: step, Err: err}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return e
	}
	if c, ok := pgerr.Classify(err); ok {
		e.Kind = c.Kind
		if e.Reason == "" {
			e.Reason = c.Meaning
		}
		return e
	}
	switch code := pgerr.Code(err); {
	case code == pgerr.SequenceGeneratorLimit:
		e.Kind = pgfence.ErrTokenExhausted
	case code == pgerr.InvalidTextRepresentation || code == pgerr.InvalidJSONText || pgerr.PayloadTooLarge(err):
		e.Kind = pgfence.ErrInvalid
		e.Reason = "Payload: refused by the database"
	}
	return e
}

// connLost reports whether err means the connection (and any transaction on
// it) is gone, so a conditional, idempotent statement may be sent again.
func connLost(err error) bool {
	return pgerr.IsConnectionLost(err) || errors.Is(err, pgx.ErrTxClosed)
}

// Outcomes of a leased claim, as kept in pgfence.jobs.claim_outcome.
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

// claimInfo is what a job's row says of the claim of Token, read when a
// conditional Complete, Fail, Renew or Release changed nothing.
type claimInfo struct {
	JobID        int64  // the job the caller tried to change
	Token        int64  // the claim token the caller presented
	CurrentToken int64  // the job's claim token now (0 when unknown)
	State        State  // the job's state now ("" when unknown)
	Holder       string // the worker of the job's latest claim ("" when unknown)
	// Outcome is how the claim under CurrentToken ended: "completed",
	// "failed", "released" or "expired"; "" while that claim runs, or when
	// unknown.
	Outcome string

	keyHash  []byte // claim_key_hash of the job as read
	wrongKey bool   // Token is the job's claim token, but the key presented is not its key
}

// checkKey marks c when the claim of c.Token is the job's current one but
// key is not its key: such a call is refused as a lost claim, never taken
// for one already done.
func (c *claimInfo) checkKey(key [16]byte) {
	if c.CurrentToken != c.Token {
		return
	}
	h := sha256.Sum256(key[:])
	if !bytes.Equal(c.keyHash, h[:]) {
		c.wrongKey = true
	}
}

// lostError says the claim of ref is lost (pgfence.ErrLost): Token is the
// claim's token, Holder the job's current holder, Reason what happened
// ("job 7: reclaimed by token 9, state running", "job 7: claim already
// ended (completed), state completed", ...). c is nil when the job does not exist: then the error also matches
// pgfence.ErrNotFound.
func lostError(op, name string, ref ClaimRef, c *claimInfo) *pgfence.Error {
	e := &pgfence.Error{Op: op, Kind: pgfence.ErrLost, Name: name, Token: ref.Token}
	switch {
	case c == nil:
		e.Reason = fmt.Sprintf("job %d: no such job", ref.JobID)
		e.Err = pgfence.ErrNotFound
		return e
	case c.State == "":
		e.Reason = fmt.Sprintf("job %d: claim lost; the job could not be read back", c.JobID)
	case c.wrongKey:
		e.Reason = fmt.Sprintf("job %d: claim not made with this claim key, state %s", c.JobID, c.State)
	case c.CurrentToken > c.Token:
		e.Reason = fmt.Sprintf("job %d: reclaimed by token %d, state %s", c.JobID, c.CurrentToken, c.State)
	case c.CurrentToken == c.Token && c.Outcome != "":
		e.Reason = fmt.Sprintf("job %d: claim already ended (%s), state %s", c.JobID, c.Outcome, c.State)
	case c.CurrentToken == c.Token:
		e.Reason = fmt.Sprintf("job %d: claim already ended, state %s", c.JobID, c.State)
	default:
		e.Reason = fmt.Sprintf("job %d: not held under this token (current %d), state %s", c.JobID, c.CurrentToken, c.State)
	}
	e.Holder = c.Holder
	return e
}

// lostErrors is the error of a batch call whose refs lost changed nothing:
// one lost claim's error, or several joined with errors.Join (in the order
// of lost).
func lostErrors(op string, lost []ClaimRef, infos []*claimInfo) error {
	switch len(lost) {
	case 0:
		return nil
	case 1:
		return lostError(op, "", lost[0], infos[0])
	}
	errs := make([]error, len(lost))
	for i, r := range lost {
		errs[i] = lostError(op, "", r, infos[i])
	}
	return errors.Join(errs...)
}
