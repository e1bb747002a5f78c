package pgfence_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
)

func TestErrorMatchesKindAndCause(t *testing.T) {
	cause := &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
	err := fmt.Errorf("wrapped: %w", &pgfence.Error{Op: "pglock.Renew", Kind: pgfence.ErrLost, Name: "jobs", Token: 7, Err: cause})
	if !errors.Is(err, pgfence.ErrLost) {
		t.Error("errors.Is(err, ErrLost) = false")
	}
	if errors.Is(err, pgfence.ErrStaleToken) {
		t.Error("errors.Is(err, ErrStaleToken) = true for a lost lease")
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "40001" {
		t.Errorf("errors.As found %v", pgErr)
	}
	var pe *pgfence.Error
	if !errors.As(err, &pe) || pe.Token != 7 || pe.Name != "jobs" {
		t.Errorf("errors.As(*Error) = %+v", pe)
	}
}

func TestErrorText(t *testing.T) {
	at := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)
	cases := []struct {
		err  *pgfence.Error
		want string
	}{
		{&pgfence.Error{Op: "pglock.TryAcquire", Kind: pgfence.ErrLocked, Name: "jobs", Holder: "h/1", ExpiresAt: at},
			`pglock.TryAcquire "jobs": held by another holder (holder "h/1" until 2026-12-05T10:00:00Z)`},
		{&pgfence.Error{Op: "pglock.Acquire", Kind: pgfence.ErrInvalid, Reason: "lock name is empty"},
			`pglock.Acquire: invalid argument: lock name is empty`},
		{&pgfence.Error{Op: "pglock.Release", Kind: pgfence.ErrLost, Name: "n", Token: 3},
			`pglock.Release "n": not held any more token 3`},
		{&pgfence.Error{Op: "skiplocked.Claim", Name: "q", Err: io.ErrUnexpectedEOF},
			`skiplocked.Claim "q": unexpected EOF`},
	}
	for _, c := range cases {
		if got := c.err.Error(); got != c.want {
			t.Errorf("Error() = %q\nwant      %q", got, c.want)
		}
	}
}

// A database failure that says the schema is missing is ErrNoSchema, and its
// text says what to run.
func TestNoSchema(t *testing.T) {
	err := &pgfence.Error{Op: "pglock.Acquire", Name: "n", Err: &pgconn.PgError{Code: "42883", Message: "function pgfence.lock_grant(text, text, bigint, bytea) does not exist"}}
	if !errors.Is(err, pgfence.ErrNoSchema) {
		t.Error("errors.Is(err, ErrNoSchema) = false")
	}
	if other := (&pgfence.Error{Op: "x", Err: &pgconn.PgError{Code: "42883", Message: "function public.f() does not exist"}}); errors.Is(other, pgfence.ErrNoSchema) {
		t.Error("a missing function outside pgfence is ErrNoSchema")
	}
	if pgfence.IsRetryable(err) {
		t.Error("a missing schema is retryable")
	}
}

func TestIsRetryable(t *testing.T) {
	cases := []struct {
		err  error
		want bool
	}{
		{nil, false},
		{&pgfence.Error{Op: "x", Err: &pgconn.PgError{Code: "40001"}}, true},
		{&pgfence.Error{Op: "x", Err: &pgconn.PgError{Code: "40P01"}}, true},
		{&pgfence.Error{Op: "x", Err: &pgconn.PgError{Code: "57P01"}}, true},
		{&pgfence.Error{Op: "x", Err: io.ErrUnexpectedEOF}, true},
		{&pgfence.Error{Op: "x", Kind: pgfence.ErrSlowGrant}, true},
		{&pgfence.Error{Op: "x", Err: context.DeadlineExceeded}, false},
		{&pgfence.Error{Op: "x", Kind: pgfence.ErrLost, Err: io.ErrUnexpectedEOF}, false},
		{&pgfence.Error{Op: "x", Kind: pgfence.ErrStaleToken}, false},
		{&pgfence.Error{Op: "x", Kind: pgfence.ErrInvalid}, false},
		{&pgfence.Error{Op: "x", Err: &pgconn.PgError{Code: "23505"}}, false},
	}
	for _, c := range cases {
		if got := pgfence.IsRetryable(c.err); got != c.want {
			t.Errorf("IsRetryable(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
