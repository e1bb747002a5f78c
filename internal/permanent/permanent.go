// Package permanent is the one type behind skiplocked.Permanent and
// outbox.Permanent, so that each package recognises the other's: a
// Dispatcher handler that returns skiplocked.Permanent sends its intent to
// dead and is counted as a permanent failure, as with outbox.Permanent.
package permanent

import "errors"

// Error marks a failure that must not be retried.
type Error struct{ Err error }

// Wrap returns err marked permanent.
func Wrap(err error) error { return &Error{err} }

// Is reports whether err is marked permanent anywhere in its chain.
func Is(err error) bool {
	var e *Error
	return errors.As(err, &e)
}

// Error returns "permanent: " and the wrapped error's text, or "permanent
// failure" for a nil one.
func (e *Error) Error() string {
	if e.Err == nil {
		return "permanent failure"
	}
	return "permanent: " + e.Err.Error()
}

// Unwrap returns the wrapped error.
func (e *Error) Unwrap() error { return e.Err }
