package fencedwrite_test

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
)

// TestCheck: Check's answer for each outcome of a generated fenced
// statement, and ErrInvalid for an unknown mode or a token not above 0
// whatever the other arguments (it decided from them before).
func TestCheck(t *testing.T) {
	t.Parallel()
	const tok = 7
	for _, c := range []struct {
		name    string
		mode    fencedwrite.Mode
		token   int64
		applied bool
		fence   int64
		err     error
		want    error // nil: Check returns nil; errConcurrent: an error without Kind
	}{
		{"applied", fencedwrite.Strict, tok, true, tok, nil, nil},
		{"applied, reentrant", fencedwrite.Reentrant, tok, true, tok, nil, nil},
		{"newer fence", fencedwrite.Strict, tok, false, tok + 1, nil, pgfence.ErrStaleToken},
		{"newer fence, reentrant", fencedwrite.Reentrant, tok, false, tok + 3, nil, pgfence.ErrStaleToken},
		{"same grant wrote it, strict", fencedwrite.Strict, tok, false, tok, nil, pgfence.ErrAlreadyApplied},
		{"fence explains nothing, reentrant", fencedwrite.Reentrant, tok, false, tok, nil, errConcurrent},
		{"fence below the token", fencedwrite.Strict, tok, false, tok - 1, nil, errConcurrent},
		{"no such row", fencedwrite.Strict, tok, false, 0, pgx.ErrNoRows, pgfence.ErrNotFound},
		{"unknown mode", fencedwrite.Mode(7), tok, false, tok, nil, invalidArg("mode")},
		{"unknown mode, applied", fencedwrite.Mode(7), tok, true, tok, nil, invalidArg("mode")},
		{"token 0", fencedwrite.Strict, 0, false, 0, nil, invalidArg("token")},
		{"negative token, applied", fencedwrite.Reentrant, -1, true, 0, nil, invalidArg("token")},
		{"negative token, no row", fencedwrite.Strict, -1, false, 0, pgx.ErrNoRows, invalidArg("token")},
	} {
		err := fencedwrite.Check(c.mode, c.token, c.applied, c.fence, c.err)
		switch {
		case c.want == nil:
			if err != nil {
				t.Errorf("%s: %v, want nil", c.name, err)
			}
		case c.want == errConcurrent:
			var pe *pgfence.Error
			if !errors.As(err, &pe) || pe.Kind != nil {
				t.Errorf("%s: %v, want a *pgfence.Error without Kind", c.name, err)
			}
		default:
			if !matches(err, c.want) {
				t.Errorf("%s: %v, want %v", c.name, err, c.want)
			}
		}
	}
}

// errConcurrent stands for "a refusal the fence does not explain" in TestCheck.
var errConcurrent = errors.New("concurrent")
