package pglock

import (
	"log/slog"
	"time"
	"unicode/utf8"

	"github.com/pgfence/pgfence/observe"
)

// Limits on input. Violations are rejected before any SQL runs.
const (
	// maxNameBytes is the longest lock name, in bytes (the table's CHECK).
	maxNameBytes = 512
	// maxHolderBytes is the longest holder identity, in bytes (the table's CHECK).
	maxHolderBytes = 512
	// MinTTL is the shortest lease duration accepted.
	MinTTL = time.Millisecond
	// MaxTTL is the longest lease duration accepted; longer work renews.
	MaxTTL = 24 * time.Hour
)

// Lease key sizes (Config.Key), the bounds pgfence's lease functions check.
const (
	keyBytes    = 16
	minKeyBytes = 16
	maxKeyBytes = 64
)

// notifyChannel is the PostgreSQL NOTIFY channel on which a release announces
// the lock name (the payload). The Lockers of one pool LISTEN on it with one
// shared dedicated connection to wake their waiters.
const notifyChannel = "pgfence_lock_released"

// handoffChannel is the PostgreSQL NOTIFY channel on which a release that
// handed its lease to the first waiter in the queue (pgfence.lock_queue)
// announces that waiter's key, the id of its wait, the new token and the new
// expiry in microseconds since the Unix epoch, what is left of the lease,
// and a tag (payload "wkey wait_id token expiry_us left_us tag", see
// handoff.go). The LISTEN connection
// listens on it too. Any role that can connect may send one: the waiter takes
// the lease from the payload only if the tag checks with its handoff key, and
// otherwise reads its grant in the database before it returns a lease.
const handoffChannel = "pgfence_lock_handoff"

// Config configures a [Locker]. A nil *Config means all defaults.
type Config struct {
	// Holder identifies this Locker in the lock rows, so a DBA can see who holds
	// what. Every lease of one Locker carries the same holder. 1..512 bytes.
	// Defaults to "hostname/pid/random" (8 random hex digits, so that two
	// Lockers of one process differ).
	Holder string
	// Key is the lease key of this Locker's grants: a secret of 16 to 64
	// bytes, stored in the database only as its SHA-256. Renewing or
	// releasing a lease takes its name, its token and this key, so a session
	// that can read the lock row (name, holder, token) but does not know the
	// key cannot renew, release or take over the lease. Defaults to 16 random
	// bytes from crypto/rand, drawn by [New]. Set it only to renew or release,
	// from another process, leases a Locker with that key was granted (see
	// [Lease.Key]); keep it secret.
	Key []byte
	// Logger receives a line per grant and release (Info), per lost lease and
	// renewal failure (Warn), and listener reconnects. Every line carries the
	// lock name and token; the holder is in the "holder" attribute of the
	// Locker's logger. Defaults to nil: silent.
	Logger *slog.Logger
	// Metrics receives the lease metrics of package observe (acquire latency
	// by outcome, wait time, hold time, leases lost by reason, renewals,
	// leader changes). Defaults to nil: nothing is recorded.
	Metrics observe.Metrics
	// KeepAlive renews every lease automatically at KeepAliveFraction of its
	// TTL (with ±10% jitter) until it is released or lost, or a
	// [Lease.Release] of it failed (it then expires at its TTL unless
	// Release is called again): one goroutine per
	// Locker sends all the leases due in one statement (a lease due within
	// half its interval goes with them, early). It does not wait for a
	// statement: one that gets no answer holds back only its own leases,
	// and only for half of the shortest remaining time among them (at least
	// four measured round trips); it is then cancelled, extends nothing, and
	// its leases are tried again at once on other connections, apart from
	// the others. It keeps renewing while the worker is stuck: fencing is
	// still required. Defaults to false.
	KeepAlive bool
	// KeepAliveFraction is the fraction of the TTL between renewals, in
	// (0, 0.8]. Defaults to 1/3.
	KeepAliveFraction float64
	// PollOnly disables LISTEN, for PgBouncer in transaction pooling mode
	// where LISTEN does not work: waiters then wake at the holder's expiry
	// and every PollInterval. Defaults to false: one dedicated connection,
	// shared by the Lockers of the pool, LISTENs on pgfence_lock_released and
	// pgfence_lock_handoff.
	PollOnly bool
	// PollInterval is the longest a waiter sleeps without retrying: the
	// fallback when a notification is missed, and the release detector in
	// PollOnly mode. At least 10ms. Defaults to 1s.
	PollInterval time.Duration
}

// validateName reports whether name is acceptable as a lock name: 1 to
// 512 bytes of valid UTF-8 without NUL bytes. Any other content,
// including quotes, semicolons and SQL keywords, is fine: names are always
// bind parameters and stored verbatim.
func validateName(op, name string) error {
	switch {
	case name == "":
		return invalid(op, "lock name", "empty name")
	case len(name) > maxNameBytes:
		return invalid(op, "lock name", "%d bytes, more than %d", len(name), maxNameBytes)
	case !utf8.ValidString(name):
		return invalid(op, "lock name", "not valid UTF-8")
	case containsNUL(name):
		return invalid(op, "lock name", "contains a NUL byte")
	}
	return nil
}

func validateHolder(op, h string) error {
	switch {
	case h == "":
		return invalid(op, "holder", "empty holder")
	case len(h) > maxHolderBytes:
		return invalid(op, "holder", "%d bytes, more than %d", len(h), maxHolderBytes)
	case !utf8.ValidString(h):
		return invalid(op, "holder", "not valid UTF-8")
	case containsNUL(h):
		return invalid(op, "holder", "contains a NUL byte")
	}
	return nil
}

// validateTTL reports whether ttl is within [MinTTL, MaxTTL].
func validateTTL(op string, ttl time.Duration) error {
	if ttl < MinTTL || ttl > MaxTTL {
		return invalid(op, "lease duration", "%v is outside [%v, %v]", ttl, MinTTL, MaxTTL)
	}
	return nil
}

func validateToken(op string, token int64) error {
	if token <= 0 {
		return invalid(op, "token", "%d is not positive", token)
	}
	return nil
}

func containsNUL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return true
		}
	}
	return false
}
