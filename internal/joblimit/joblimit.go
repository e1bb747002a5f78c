// Package joblimit holds the limits of a job of pgfence.jobs that
// skiplocked and outbox both apply.
package joblimit

const (
	// DefaultMaxAttempts is the max_attempts of a job enqueued without one.
	DefaultMaxAttempts = 25
	// MaxMaxAttempts is the largest max_attempts a job may have.
	MaxMaxAttempts = 1000000
)
