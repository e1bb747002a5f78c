// Package joblimit holds the limits of a job of pgfence.jobs that
// skiplocked and outbox both apply.
package joblimit

import (
	"fmt"
	"time"
)

const (
	// DefaultMaxAttempts is the max_attempts of a job enqueued without one.
	DefaultMaxAttempts = 25
	// MaxMaxAttempts is the largest max_attempts a job may have.
	MaxMaxAttempts = 1000000
)

// Years a job's run_at may be in (UTC). Outside them pgx's encoding of a
// time.Time overflows (time.Unix(math.MaxInt64, 0), a common "never", went
// out as 1969 and made the job due at once) or PostgreSQL refuses it.
const (
	MinRunAtYear = 1
	MaxRunAtYear = 9999
)

// RunAtProblem says why t cannot be a job's run_at, or "" if it can (the
// zero time means "now" and can).
func RunAtProblem(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	if y := t.UTC().Year(); y < MinRunAtYear || y > MaxRunAtYear {
		return fmt.Sprintf("year %d is outside %d..%d", y, MinRunAtYear, MaxRunAtYear)
	}
	return ""
}
