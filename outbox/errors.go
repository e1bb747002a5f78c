package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/pglock"
)

// SQLSTATEs of pgfence.outbox_enqueue that no other package names.
const (
	sqlStateBadArgument  = "PF011" // an argument out of its bounds (the message names it)
	sqlStateLeaseNotHeld = "PF012" // the lease is released, expired, or held with another key
)

// Sentinel errors, matched with [errors.Is]. Bad input is refused before any
// SQL runs and records nothing.
var (
	// ErrStaleToken means a newer grant of the lock exists: the caller is a
	// superseded holder and its intent was not recorded. It is
	// [fencedwrite.ErrStaleToken] itself, so a caller that handles refused
	// fenced writes handles refused intents the same way. The error is a
	// [*RefusedError] that also unwraps to a [*fencedwrite.StaleTokenError].
	ErrStaleToken = fencedwrite.ErrStaleToken
	// ErrTokenNotIssued means the lock never issued the token (a forged or
	// mistyped token), or no lock has that name. Nothing was recorded. The
	// error is a [*RefusedError].
	ErrTokenNotIssued = errors.New("outbox: token not issued by the lock")
	// ErrInvalidToken means a token is <= 0.
	ErrInvalidToken = errors.New("outbox: invalid token: must be > 0")
	// ErrInvalidTopic means a topic is not 1..100 bytes of ASCII
	// letters, digits and . _ : / -.
	ErrInvalidTopic = errors.New("outbox: invalid topic")
	// ErrInvalidKey means an idempotency key is not 1..255 visible
	// ASCII characters (it travels in an HTTP header).
	ErrInvalidKey = errors.New("outbox: invalid idempotency key")
	// ErrInvalidPayload means a payload is empty, not valid JSON, or larger
	// than 1 MiB.
	ErrInvalidPayload = errors.New("outbox: invalid payload")
	// ErrInvalidIntent means another field of an [Intent] is out of range.
	ErrInvalidIntent = errors.New("outbox: invalid intent")
	// ErrInvalidConfig means a [Config] or [HTTPConfig] field is out of range.
	ErrInvalidConfig = errors.New("outbox: invalid config")
	// ErrNilDB means a nil pool, connection or transaction was passed.
	ErrNilDB = errors.New("outbox: nil database handle")
	// ErrNotAnIntent is the error a [Dispatcher] gives a job of its queue
	// that has no intent in pgfence.outbox (inserted into pgfence.jobs
	// directly, not through [Enqueue]): it is sent to dead, never delivered.
	ErrNotAnIntent = errors.New("outbox: job has no outbox intent")
)

// RefusedError reports an intent the database refused because its token is
// not the latest grant of its lock, or because the lease is not held with its
// key. errors.Is(err, Reason) holds: Reason is [ErrStaleToken],
// [ErrTokenNotIssued] or [pgfence.ErrLost] (the lease was released, expired
// on the database's clock, or the key is not its key). For a stale token,
// Unwrap returns a [*fencedwrite.StaleTokenError] (Token, and Fence =
// Latest); for a lease not held, a [*pgfence.Error] of kind [pgfence.ErrLost]
// (Name, Holder, Token) whose cause is the server's error.
//
// The refusal comes from [Enqueue], or from the COMMIT of the caller's
// transaction when a grant committed after Enqueue returned: pass the
// commit's error through [TranslateError] to get this type (the COMMIT checks
// the token only, so it never refuses with pgfence.ErrLost).
type RefusedError struct {
	Reason   error
	LockName string // the lock named by the intent ("" when refused at COMMIT)
	Key      string // the intent's idempotency key
	Token    int64  // the token presented
	Latest   int64  // the lock's latest token (0: the lock does not exist, or unknown)
	Err      error  // the translated server error
}

// Error names the reason, lock, token and latest token.
func (e *RefusedError) Error() string {
	switch {
	case e.Reason == ErrStaleToken:
		return fmt.Sprintf("outbox: intent refused: stale token %d, lock %q has granted %d since (key %s)",
			e.Token, e.LockName, e.Latest, e.Key)
	case e.Reason == pgfence.ErrLost:
		return fmt.Sprintf("outbox: intent refused: the lease of lock %q with token %d is not held with its key "+
			"(released, expired, or another key) (key %s)", e.LockName, e.Token, e.Key)
	default:
		return fmt.Sprintf("outbox: intent refused: lock %q never issued token %d (latest %d) (key %s)",
			e.LockName, e.Token, e.Latest, e.Key)
	}
}

// Is reports whether target is the Reason.
func (e *RefusedError) Is(target error) bool { return target == e.Reason }

// Unwrap returns the translated server error.
func (e *RefusedError) Unwrap() error { return e.Err }

// DBError is a database or connection error of one of this package's calls
// that is not a refusal. Unwrap returns the pgx or PostgreSQL error. On a
// database without pgfence's schema, its text says to run
// "pgfence migrate up" as the schema owner.
type DBError struct {
	Op  string // "enqueue", "load intent", "status"
	Err error
}

func (e *DBError) Error() string { return "outbox: " + e.Op + ": " + pgerr.Describe(e.Err) }

// Unwrap returns the pgx or PostgreSQL error.
func (e *DBError) Unwrap() error { return e.Err }

// Transient reports whether the same call may succeed when made again
// (connection failures, serialization failures). Enqueue retried with the
// same key records the intent at most once.
func (e *DBError) Transient() bool { return pgerr.IsTransient(e.Err) }

// TranslateError turns the database's refusal of an intent (SQLSTATE PF003
// or PF002 raised for pgfence.outbox, PF012 raised by
// pgfence.outbox_enqueue) into a [*RefusedError]; context errors are returned
// as they are, anything else becomes a [*DBError]. [Enqueue] already calls
// it; call it on the error of your transaction's COMMIT, where the final
// check of every intent runs.
func TranslateError(err error) error { return translate("", nil, err) }

// translate is TranslateError for the call op made under lease (nil when
// unknown: the lock name, token and key then come from the error's DETAIL).
func translate(op string, lease *pglock.Lease, err error) error {
	if err == nil {
		return nil
	}
	lock, holder := "", ""
	if lease != nil {
		lock, holder = lease.Name(), lease.Holder()
	}
	var re *RefusedError
	if errors.As(err, &re) {
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	switch pgerr.Code(err) {
	case pgerr.StaleToken:
		var stale *fencedwrite.StaleTokenError
		if tr := fencedwrite.TranslateError(err); errors.As(tr, &stale) {
			return &RefusedError{Reason: ErrStaleToken, LockName: lock, Key: keyOf(stale.Key), Token: stale.Token,
				Latest: stale.Fence, Err: tr}
		}
	case pgerr.TokenNotIssued:
		tr := fencedwrite.TranslateError(err)
		r := &RefusedError{Reason: ErrTokenNotIssued, LockName: lock, Err: tr}
		var ge *fencedwrite.GuardError
		if errors.As(tr, &ge) {
			parseNotIssued(ge.Detail, r)
		}
		return r
	case sqlStateLeaseNotHeld:
		r := &RefusedError{Reason: pgfence.ErrLost, LockName: lock}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			parseNotIssued(pgErr.Detail, r)
		}
		r.Err = &pgfence.Error{Op: "outbox.Enqueue", Kind: pgfence.ErrLost, Name: r.LockName, Holder: holder, Token: r.Token, Err: err}
		return r
	case pgerr.InvalidToken:
		return fmt.Errorf("%w: %w", ErrInvalidToken, fencedwrite.TranslateError(err))
	case sqlStateBadArgument:
		return fmt.Errorf("%w: refused by the server: %w", ErrInvalidIntent, err)
	}
	if pgerr.PayloadTooLarge(err) {
		return fmt.Errorf("%w: larger than the server's limit of %d bytes (text form): %w", ErrInvalidPayload, maxPayloadBytes, err)
	}
	if op == "" {
		op = "statement"
	}
	return &DBError{Op: op, Err: err}
}

// parseNotIssued reads the DETAIL "op INSERT, key K, token N, lock L, latest
// token M" (M may be "none") of a PF002 or PF012 refusal.
func parseNotIssued(detail string, r *RefusedError) {
	_, rest, ok := strings.Cut(detail, ", key ")
	if !ok {
		return
	}
	i := strings.Index(rest, ", token ") // the key has no spaces
	j := strings.LastIndex(rest, ", latest token ")
	if i < 0 || j < i {
		return
	}
	r.Key = keyOf(rest[:i])
	tok, lock, _ := strings.Cut(rest[i+len(", token "):j], ", lock ")
	r.Token, _ = strconv.ParseInt(tok, 10, 64)
	if r.LockName == "" {
		r.LockName = lock
	}
	r.Latest, _ = strconv.ParseInt(rest[j+len(", latest token "):], 10, 64)
}

// keyOf returns the idempotency key of the server's {"idempotency_key": K}.
func keyOf(s string) string {
	var v struct {
		Key string `json:"idempotency_key"`
	}
	if json.Unmarshal([]byte(s), &v) != nil || v.Key == "" {
		return s
	}
	return v.Key
}

// isNoRows reports pgx's "no rows".
func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }
