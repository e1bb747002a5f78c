package skiplocked

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Sentinel errors. Every error returned by this package that is caused by one
// of these conditions matches it with [errors.Is].
var (
	// ErrClaimLost means a leased claim is no longer held under the presented
	// claim token: another worker re-claimed the row after the claim expired,
	// or the claim already ended (completed, failed or released). Nothing was
	// changed. The concrete error is a [*ClaimLostError].
	ErrClaimLost = errors.New("skiplocked: claim lost")
	// ErrJobNotFound means no job has the given id.
	ErrJobNotFound = errors.New("skiplocked: job not found")

	// ErrInvalidQueue means a queue name is empty, longer than [MaxQueueLen]
	// bytes or contains control characters.
	ErrInvalidQueue = errors.New("skiplocked: invalid queue name")
	// ErrInvalidWorker means a worker identity is empty, longer than
	// [MaxWorkerLen] bytes or contains control characters.
	ErrInvalidWorker = errors.New("skiplocked: invalid worker identity")
	// ErrInvalidLimit means a batch size (rows per claim) is <= 0 or larger
	// than [MaxBatch].
	ErrInvalidLimit = errors.New("skiplocked: invalid batch size")
	// ErrInvalidTTL means a claim duration is outside [MinClaimTTL, MaxClaimTTL].
	ErrInvalidTTL = errors.New("skiplocked: invalid claim TTL")
	// ErrInvalidToken means a claim token or job id is <= 0.
	ErrInvalidToken = errors.New("skiplocked: invalid claim token or job id")
	// ErrInvalidPayload means a job payload is not valid JSON or is larger
	// than its limit (EnqueueParams.MaxPayloadBytes).
	ErrInvalidPayload = errors.New("skiplocked: invalid payload")
	// ErrInvalidJob means an enqueue option is out of range (max attempts,
	// retry delay, batch length).
	ErrInvalidJob = errors.New("skiplocked: invalid job")
	// ErrInvalidIdentifier means a table or column name in a [Spec] is empty,
	// too long, or not a plain identifier (letters, digits, _ and $, not
	// starting with a digit or $). Such names are refused rather than quoted.
	ErrInvalidIdentifier = errors.New("skiplocked: invalid identifier")
	// ErrInvalidSpec means a [Spec] is inconsistent: no key columns, an
	// unknown operator, a bad value for an operator, or a trusted filter
	// fragment that contains ; or comment or dollar-quote markers.
	ErrInvalidSpec = errors.New("skiplocked: invalid claim spec")
	// ErrInvalidConfig means a [Config] field is out of range.
	ErrInvalidConfig = errors.New("skiplocked: invalid config")
	// ErrNilDB means a nil pool, connection or transaction was passed.
	ErrNilDB = errors.New("skiplocked: nil database handle")
	// ErrUnknownTable means the table of a [Spec] does not exist (or is not
	// an ordinary or partitioned table).
	ErrUnknownTable = errors.New("skiplocked: unknown table")
	// ErrUnknownColumn means a column named in a [Spec] does not exist.
	ErrUnknownColumn = errors.New("skiplocked: unknown column")
	// ErrTokenExhausted means the claim token sequence reached its maximum.
	// It never wraps around; an operator must intervene.
	ErrTokenExhausted = errors.New("skiplocked: claim token sequence exhausted")
	// ErrConnection means the connection to PostgreSQL failed or was closed
	// (for example by pg_terminate_backend) during the call. Whether a write
	// landed is unknown unless the call documents otherwise; in-transaction
	// claims of that connection are released by the server.
	ErrConnection = errors.New("skiplocked: connection lost")
)

// ClaimLostError reports that a conditional Complete, Fail, Heartbeat or
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
	// ClaimedBy is the worker of the job's latest claim ("" when unknown).
	ClaimedBy string
}

// Error describes why the claim is lost.
func (e *ClaimLostError) Error() string {
	switch {
	case e.CurrentToken > e.Token:
		return fmt.Sprintf("skiplocked: claim lost: job %d was re-claimed with token %d by %q (yours: %d), state %s",
			e.JobID, e.CurrentToken, e.ClaimedBy, e.Token, e.State)
	case e.CurrentToken == e.Token:
		return fmt.Sprintf("skiplocked: claim lost: job %d claim %d already ended, state %s", e.JobID, e.Token, e.State)
	default:
		return fmt.Sprintf("skiplocked: claim lost: job %d is not held under token %d (current %d, state %s)",
			e.JobID, e.Token, e.CurrentToken, e.State)
	}
}

// Is reports whether target is [ErrClaimLost].
func (e *ClaimLostError) Is(target error) bool { return target == ErrClaimLost }

// ClaimsLostError is the error of [CompleteMany], [ReleaseMany] and
// [HeartbeatMany] when some of the claims changed nothing (lost, or the job
// does not exist): a batch with a refused claim is never a plain success.
// The other claims of the batch were applied. errors.Is(err, [ErrClaimLost])
// reports true.
type ClaimsLostError struct {
	Op    string     // "complete", "release" or "heartbeat"
	Total int        // claims in the batch
	Lost  []ClaimRef // the claims that changed nothing, in the caller's order
}

// Error says how many claims of the batch were refused and names the first.
func (e *ClaimsLostError) Error() string {
	first := ""
	if len(e.Lost) > 0 {
		first = fmt.Sprintf(" (first: job %d token %d)", e.Lost[0].JobID, e.Lost[0].Token)
	}
	return fmt.Sprintf("skiplocked: %s refused for %d of %d claims: claim lost%s; the others were applied",
		e.Op, len(e.Lost), e.Total, first)
}

// Is reports whether target is [ErrClaimLost].
func (e *ClaimsLostError) Is(target error) bool { return target == ErrClaimLost }

// translate maps pgx and PostgreSQL errors to this package's sentinels,
// keeping the original error in the chain.
func translate(op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("skiplocked: %s: %w", op, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == "42P01":
			return fmt.Errorf("%w: %s: %w", ErrUnknownTable, op, err)
		case pgErr.Code == "42703":
			return fmt.Errorf("%w: %s: %w", ErrUnknownColumn, op, err)
		case pgErr.Code == "2200H":
			return fmt.Errorf("%w: %s: %w", ErrTokenExhausted, op, err)
		case pgErr.Code == "22P02" || pgErr.Code == "22032":
			return fmt.Errorf("%w: %s: %w", ErrInvalidPayload, op, err)
		case strings.HasPrefix(pgErr.Code, "08") || pgErr.Code == "57P01" || pgErr.Code == "57P02" || pgErr.Code == "57P03":
			return fmt.Errorf("%w: %s: %w", ErrConnection, op, err)
		}
		return fmt.Errorf("skiplocked: %s: %w", op, err)
	}
	var netErr net.Error
	var connectErr *pgconn.ConnectError
	if errors.As(err, &netErr) || errors.As(err, &connectErr) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) || pgconn.SafeToRetry(err) ||
		errors.Is(err, pgx.ErrTxClosed) || isClosedConn(err) {
		return fmt.Errorf("%w: %s: %w", ErrConnection, op, err)
	}
	return fmt.Errorf("skiplocked: %s: %w", op, err)
}

// isClosedConn recognises pgx's "conn closed" error, which has no exported type.
func isClosedConn(err error) bool {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if e.Error() == "conn closed" || e.Error() == "closed pool" {
			return true
		}
	}
	return false
}
