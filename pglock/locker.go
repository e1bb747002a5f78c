package pglock

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"slices"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/observe"
)

// Limits on input. Violations are rejected before any SQL runs.
const (
	// MaxNameBytes is the longest lock name, in bytes (the table's CHECK).
	MaxNameBytes = 512
	// MaxHolderBytes is the longest holder identity, in bytes (the table's CHECK).
	MaxHolderBytes = 512
	// MinTTL is the shortest lease duration accepted. Shorter leases end before
	// a round trip to the database completes.
	MinTTL = time.Millisecond
	// MaxTTL is the longest lease duration accepted: 24 hours. A lease is a
	// promise to finish or renew; a holder that crashes blocks the lock for up
	// to a whole TTL, and work longer than a day should renew (KeepAlive).
	MaxTTL = 24 * time.Hour
)

// NotifyChannel is the PostgreSQL NOTIFY channel on which a release announces
// the lock name (the payload). Each [Locker] LISTENs on it with one dedicated
// connection to wake its waiters.
const NotifyChannel = "pgfence_lock_released"

// DBTX is what the package needs from a database handle: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Config configures a [Locker]. A nil *Config means all defaults.
type Config struct {
	// Holder identifies this Locker in the lock rows, so a DBA can see who holds
	// what. Every lease of one Locker carries the same holder. 1..512 bytes.
	// Defaults to [DefaultHolder]() ("hostname/pid/random").
	Holder string
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
	// TTL (with ±10% jitter) until it is released or lost. Defaults to false.
	// A keep-alive keeps renewing while the worker is stuck: it proves the
	// process is alive, not that the work is progressing. Fencing is still
	// required; see the package documentation.
	KeepAlive bool
	// KeepAliveFraction is the fraction of the TTL between renewals, in
	// (0, 0.8]. Defaults to 1/3.
	KeepAliveFraction float64
	// NoListen disables the LISTEN connection: waiters then wake only at the
	// holder's expiry and every PollInterval. Use it where LISTEN does not
	// work (a transaction-pooling PgBouncer). Defaults to false.
	NoListen bool
	// PollInterval, when > 0, makes waiters also retry at this period. It is
	// never needed with LISTEN (a release wakes waiters, an expiry timer covers
	// crashed holders); it exists for NoListen setups and for comparison.
	// Defaults to 0: no polling.
	PollInterval time.Duration
}

// DefaultHolder returns "hostname/pid/random" with 8 random hex digits, so
// that two Lockers in one process differ.
func DefaultHolder() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// Locker grants leases on pgfence.locks through a pool. It is safe for
// concurrent use. All its leases share one holder identity, so two
// acquisitions of one name through the same Locker exclude each other like
// any two holders do.
type Locker struct {
	pool   *pgxpool.Pool
	q      *dbsqlc.Queries
	holder string
	log    *slog.Logger
	m      observe.Metrics
	cfg    Config

	mu     sync.Mutex
	closed bool
	leases map[*Lease]struct{}
	lis    *listener

	closedCh chan struct{}
	wg       sync.WaitGroup // keep-alive goroutines

	// waitHook, when set (tests), is called each time a waiter starts waiting.
	waitHook func(name string)
}

// New returns a Locker on pool. It validates cfg and does no I/O; a nil cfg
// means defaults. The schema must have been migrated (package migrations).
// The pool is not owned: close the Locker before the pool.
func New(pool *pgxpool.Pool, cfg *Config) (*Locker, error) {
	if pool == nil {
		return nil, invalid(ErrInvalidConfig, "nil pool")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Holder == "" {
		c.Holder = DefaultHolder()
	}
	if err := validateHolder(c.Holder); err != nil {
		return nil, err
	}
	if c.KeepAliveFraction == 0 {
		c.KeepAliveFraction = 1.0 / 3
	}
	if !(c.KeepAliveFraction > 0 && c.KeepAliveFraction <= 0.8) {
		return nil, invalid(ErrInvalidConfig, "KeepAliveFraction %v outside (0, 0.8]", c.KeepAliveFraction)
	}
	if c.PollInterval < 0 {
		return nil, invalid(ErrInvalidConfig, "negative PollInterval %v", c.PollInterval)
	}
	log := c.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("holder", c.Holder)
	l := &Locker{
		pool:     pool,
		q:        dbsqlc.New(),
		holder:   c.Holder,
		log:      log,
		m:        observe.OrNop(c.Metrics),
		cfg:      c,
		leases:   make(map[*Lease]struct{}),
		closedCh: make(chan struct{}),
	}
	if !c.NoListen {
		l.lis = newListener(l)
	}
	return l, nil
}

// Holder returns the identity stored in the rows of this Locker's leases.
func (l *Locker) Holder() string { return l.holder }

// Close stops the listener and every keep-alive, and ends the Context of each
// live lease with cause [ErrClosed]. It does not release leases in the
// database (Close does no SQL): release them first, or they stay held until
// their TTL passes. Waiting Acquire calls return [ErrClosed]. Close is safe to
// call more than once.
func (l *Locker) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.closedCh)
	leases := make([]*Lease, 0, len(l.leases))
	for s := range l.leases {
		leases = append(leases, s)
	}
	l.mu.Unlock()
	for _, s := range leases {
		s.end(ErrClosed)
	}
	if l.lis != nil {
		l.lis.stop()
	}
	l.wg.Wait()
	return nil
}

func (l *Locker) isClosed() bool {
	select {
	case <-l.closedCh:
		return true
	default:
		return false
	}
}

// ValidateName reports whether name is acceptable as a lock name: 1 to
// [MaxNameBytes] bytes of valid UTF-8 without NUL bytes. Any other content,
// including quotes, semicolons and SQL keywords, is fine: names are always
// bind parameters and stored verbatim.
func ValidateName(name string) error {
	switch {
	case name == "":
		return invalid(ErrInvalidName, "empty name")
	case len(name) > MaxNameBytes:
		return invalid(ErrInvalidName, "name is %d bytes, more than %d", len(name), MaxNameBytes)
	case !utf8.ValidString(name):
		return invalid(ErrInvalidName, "name is not valid UTF-8")
	case containsNUL(name):
		return invalid(ErrInvalidName, "name contains a NUL byte")
	}
	return nil
}

func validateHolder(h string) error {
	switch {
	case h == "":
		return invalid(ErrInvalidHolder, "empty holder")
	case len(h) > MaxHolderBytes:
		return invalid(ErrInvalidHolder, "holder is %d bytes, more than %d", len(h), MaxHolderBytes)
	case !utf8.ValidString(h):
		return invalid(ErrInvalidHolder, "holder is not valid UTF-8")
	case containsNUL(h):
		return invalid(ErrInvalidHolder, "holder contains a NUL byte")
	}
	return nil
}

// ValidateTTL reports whether ttl is within [MinTTL, MaxTTL].
func ValidateTTL(ttl time.Duration) error {
	if ttl < MinTTL || ttl > MaxTTL {
		return invalid(ErrInvalidTTL, "%v is outside [%v, %v]", ttl, MinTTL, MaxTTL)
	}
	return nil
}

func validateToken(token int64) error {
	if token <= 0 {
		return invalid(ErrInvalidToken, "token %d is not positive", token)
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

// TryAcquire makes one attempt to take the lock name for ttl. It returns the
// lease, or a [*LockedError] (errors.Is(err, [ErrLocked])) naming the current
// holder when the lock is held — including by this same Locker. The grant is
// one statement that commits with synchronous_commit on. Cancelling ctx
// abandons the round trip (pgx closes that connection); the grant may or may
// not have committed, in which case the lock stays held by this Locker's
// holder until ttl passes. A grant whose answer arrives after ttl has
// passed since it was sent is given back and reported as a transient
// [*DBError] wrapping a [*SlowGrantError] ([ErrSlowGrant]): a lease is never
// returned already past its local deadline.
func (l *Locker) TryAcquire(ctx context.Context, name string, ttl time.Duration) (*Lease, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	if err := ValidateTTL(ttl); err != nil {
		return nil, err
	}
	if l.isClosed() {
		return nil, ErrClosed
	}
	start := time.Now()
	lease, locked, _, err := l.grant(ctx, name, ttl, attemptTry)
	if err == nil && locked != nil {
		err = locked
	}
	l.recordAcquire(name, start, false, lease, err)
	if err != nil {
		return nil, err
	}
	return lease, nil
}

// recordAcquire reports one TryAcquire/Acquire call to the metrics and log.
func (l *Locker) recordAcquire(name string, start time.Time, waited bool, lease *Lease, err error) {
	elapsed := time.Since(start).Seconds()
	switch {
	case err == nil:
		l.m.Observe(observe.LeaseAcquireSeconds, elapsed, observe.OutcomeGranted)
		if waited {
			l.m.Observe(observe.LeaseWaitSeconds, elapsed)
		}
		if l.log.Enabled(context.Background(), slog.LevelInfo) { // no argument boxing on the hot path when silent
			l.log.Info("pglock: granted", "name", name, "token", lease.token, "ttl", lease.ttl, "expires_at", lease.ExpiresAt())
		}
	case errors.Is(err, ErrLocked):
		l.m.Observe(observe.LeaseAcquireSeconds, elapsed, observe.OutcomeLocked)
	default:
		l.m.Observe(observe.LeaseAcquireSeconds, elapsed, observe.OutcomeError)
	}
}

// Acquire takes the lock name for ttl, waiting while someone else holds it,
// until it gets the lease or ctx ends. While waiting it sleeps: a release
// wakes it through the Locker's single LISTEN connection, and a timer at the
// current holder's expiry (plus a little jitter) covers holders that crashed.
// If the LISTEN connection is down, the expiry timer still works and every
// waiter retries when the connection is back, so no release is missed.
//
// When ctx ends while waiting, the error is a [*LockedError] that also
// matches ctx's error (errors.Is(err, context.DeadlineExceeded)); when it
// ends during a round trip, a [*DBError] that matches it too. Database
// errors end the wait and are returned as [*DBError], and so does a grant
// that arrived too late to be used ([ErrSlowGrant], see [Locker.TryAcquire]).
func (l *Locker) Acquire(ctx context.Context, name string, ttl time.Duration) (*Lease, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	if err := ValidateTTL(ttl); err != nil {
		return nil, err
	}
	start := time.Now()
	lease, waited, err := l.acquireWaited(ctx, name, ttl, waitOpts{})
	l.recordAcquire(name, start, waited, lease, err)
	return lease, err
}

// acquireWaited is acquire, also reporting whether it had to wait.
func (l *Locker) acquireWaited(ctx context.Context, name string, ttl time.Duration, o waitOpts) (*Lease, bool, error) {
	waited := false
	o.onWait = func() { waited = true }
	lease, err := l.acquire(ctx, name, ttl, o)
	return lease, waited, err
}

// waitOpts adjust acquire for the election campaign.
type waitOpts struct {
	cap      time.Duration // longest single sleep; 0 = Config.PollInterval or none
	retryErr time.Duration // > 0: retry database errors after this long instead of returning them
	onErr    func(error)
	onWait   func() // called before each sleep
}

func (l *Locker) acquire(ctx context.Context, name string, ttl time.Duration, o waitOpts) (*Lease, error) {
	var w *waiter
	defer func() {
		if w != nil {
			l.lis.unregister(w)
		}
	}()
	var timer, backoff *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
		if backoff != nil {
			backoff.Stop()
		}
	}()
	woken, losses := false, 0 // the last sleep ended with a wake-up; wake-ups lost in a row
	for {
		if l.isClosed() {
			return nil, ErrClosed
		}
		kind := attemptTry
		switch {
		case w != nil:
			kind = attemptWait
		case l.lis != nil:
			kind = attemptFirst // if refused, register and retry as a waiter at once
		}
		lease, locked, wait, err := l.grant(ctx, name, ttl, kind)
		if err != nil && (o.retryErr <= 0 || ctx.Err() != nil) {
			return nil, err
		}
		if lease != nil {
			return lease, nil
		}
		if err != nil {
			if o.onErr != nil {
				o.onErr(err)
			}
			locked, wait = &LockedError{Name: name}, o.retryErr
		} else if w == nil && l.lis != nil {
			// Register before the next attempt: a release that commits after
			// that attempt is then seen by the listener (or, if the listener
			// is not up yet, its (re)connection wakes every waiter).
			w = l.lis.register(name)
			continue
		}
		if p := l.cfg.PollInterval; p > 0 && p < wait {
			wait = p
		}
		if o.cap > 0 && o.cap < wait {
			wait = o.cap
		}
		if l.waitHook != nil {
			l.waitHook(name)
		}
		if o.onWait != nil {
			o.onWait()
		}
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		var wake <-chan struct{}
		if w != nil {
			wake = w.ch
		}
		var backoffC <-chan time.Time
		if woken {
			// Woken by a release and beaten to the grant: the lock is hot.
			// Back off before answering the next wake-up, so that N waiters
			// of one hot lock do not each run a statement on every release.
			losses++
			if backoff == nil {
				backoff = time.NewTimer(hotBackoff(losses))
			} else {
				backoff.Reset(hotBackoff(losses))
			}
			backoffC = backoff.C
		}
		var end turnEnd
		end, woken = waitTurn(ctx, l.closedCh, wake, timer.C, backoffC)
		timer.Stop()
		if backoff != nil {
			backoff.Stop()
		}
		switch end {
		case turnCtxDone:
			locked.Err = context.Cause(ctx)
			return nil, locked
		case turnClosed:
			return nil, ErrClosed
		}
	}
}

// turnEnd says why waitTurn returned.
type turnEnd uint8

const (
	turnNext    turnEnd = iota // try again: a wake-up, or the timer fired
	turnCtxDone                // ctx ended
	turnClosed                 // the Locker was closed
)

// waitTurn is a waiter's sleep between two attempts. It ends when ctx ends,
// the Locker closes, timerC fires (the holder's expiry, the poll interval or
// a retry delay: try at once, backoff or not), or a wake-up arrives on wake.
// While backoffC is not nil and has not fired, wake-ups are held back (they
// stay in the buffered channel, none is lost). woken reports whether a
// wake-up ended it.
func waitTurn(ctx context.Context, closed <-chan struct{}, wake <-chan struct{}, timerC, backoffC <-chan time.Time) (end turnEnd, woken bool) {
	for {
		w := wake
		if backoffC != nil {
			w = nil
		}
		select {
		case <-ctx.Done():
			return turnCtxDone, false
		case <-closed:
			return turnClosed, false
		case <-timerC:
			return turnNext, false
		case <-backoffC:
			backoffC = nil // now answer wake-ups
		case <-w:
			return turnNext, true
		}
	}
}

// hotBackoff is how long a waiter that lost the race after its n-th
// consecutive wake-up waits before it answers the next one: 0.5 ms doubling
// up to maxHotBackoff, with up to 50% jitter.
func hotBackoff(n int) time.Duration {
	d := min(maxHotBackoff, (time.Millisecond/2)<<min(n-1, 10))
	return d/2 + mrand.N(d/2+1)
}

// maxHotBackoff caps hotBackoff: far below a polling interval, so that on a
// hot lock a waiter still hears a release within a few milliseconds.
const maxHotBackoff = 16 * time.Millisecond

// maxWait bounds a single sleep of a waiter whose holder's expiry is far away,
// so that a lost notification (for example after a failover that the listener
// did not notice) costs at most this long. The wait-mark windows of the
// WaitGrant and ReleaseLock statements depend on it: a waiter sleeps on a
// mark at most 30 s old, and releases notify while a mark is under 100 s
// old, which covers 30 s + maxWait + jitter. Do not raise it alone.
const maxWait = time.Minute

// attemptKind selects the statements of one grant attempt.
type attemptKind uint8

const (
	// attemptTry: GrantLock, and when refused LockHolder for the holder and
	// its expiry (TryAcquire; Acquire without a listener).
	attemptTry attemptKind = iota
	// attemptFirst: GrantLock alone; when refused the caller registers as a
	// waiter and goes on with attemptWait, which reads the holder anyway.
	attemptFirst
	// attemptWait: WaitGrant, grant or mark-and-read in one statement.
	attemptWait
)

// grant makes one attempt. It returns either a lease, or a LockedError with
// how long to wait for the holder's expiry (database clock, plus jitter).
// attemptTry and attemptFirst run GrantLock, the cheapest statement when
// the lock is free; when the lock is held, attemptTry reads the holder with
// a second statement for the diagnostics and the wait, and attemptFirst
// returns a LockedError without one. attemptWait (a waiter whose listener is
// registered) runs WaitGrant, which grants, or marks the lock so that the
// next release sends a NOTIFY and returns the holder, in one round trip: a
// woken waiter that loses the race costs one statement. Who gets the lock
// rests on the grant alone.
func (l *Locker) grant(ctx context.Context, name string, ttl time.Duration, kind attemptKind) (*Lease, *LockedError, time.Duration, error) {
	mark := kind == attemptWait
	deadConns := 0
	insert := false // the next statement is InsertLock (attemptTry, no row yet)
	for attempt := 0; ; {
		conn, err := l.pool.Acquire(ctx)
		if err != nil {
			return nil, nil, 0, &DBError{Op: "acquire", Name: name, Err: err}
		}
		// The local deadline counts from here: after the pool wait, right
		// before the statement is written to the connection.
		sent := time.Now()
		var (
			granted   bool
			token     int64
			expiresAt *time.Time
			holder    *string
			dbNow     time.Time
		)
		if mark {
			var r dbsqlc.WaitGrantRow
			r, err = l.q.WaitGrant(ctx, conn, dbsqlc.WaitGrantParams{Name: name, Holder: l.holder, TtlUs: ttl.Microseconds()})
			granted, token, expiresAt, holder, dbNow = r.Granted, r.Token, r.ExpiresAt, r.Holder, r.DbNow
		} else if insert {
			var r dbsqlc.InsertLockRow
			r, err = l.q.InsertLock(ctx, conn, dbsqlc.InsertLockParams{Name: name, Holder: l.holder, TtlUs: ttl.Microseconds()})
			granted, token, expiresAt = err == nil, r.Token, r.ExpiresAt
			insert = false
		} else {
			var r dbsqlc.GrantLockRow
			r, err = l.q.GrantLock(ctx, conn, dbsqlc.GrantLockParams{Name: name, Holder: l.holder, TtlUs: ttl.Microseconds()})
			granted, token, expiresAt = err == nil, r.Token, r.ExpiresAt
		}
		if err != nil && deadConns < maxDeadConns && ctx.Err() == nil && deadConnection(conn, err) {
			// The pool handed out a connection whose backend was already
			// gone (pgxpool only pings connections idle for over a
			// second). Send the statement again on another connection.
			conn.Release()
			deadConns++
			continue
		}
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			conn.Release()
			return nil, nil, 0, translateGrantError(name, err)
		}
		if granted {
			conn.Release()
			if expiresAt == nil {
				return nil, nil, 0, &DBError{Op: "acquire", Name: name, Err: errors.New("grant returned no expiry")}
			}
			if took := time.Since(sent); took >= ttl {
				// The answer came back after the lease's local deadline: the
				// lease would end the moment it was returned. Give the
				// token back (best effort, conditional on it) and report.
				if ctx.Err() == nil {
					_ = l.release(ctx, name, l.holder, token)
				}
				return nil, nil, 0, &DBError{Op: "acquire", Name: name, Err: &SlowGrantError{Token: token, Took: took, TTL: ttl}}
			}
			return l.newLease(name, token, ttl, *expiresAt, sent), nil, 0, nil
		}
		if kind == attemptFirst {
			conn.Release()
			return nil, &LockedError{Name: name}, 0, nil
		}
		if !mark { // GrantLock refused: read the holder.
			var h dbsqlc.LockHolderRow
			h, err = l.q.LockHolder(ctx, conn, name)
			if h.Held {
				holder, expiresAt, dbNow = h.Holder, h.ExpiresAt, h.DbNow
			}
			if errors.Is(err, pgx.ErrNoRows) && attempt < 3 {
				// The lock has no row yet: its first grant inserts it.
				conn.Release()
				insert = true
				attempt++
				continue
			}
			if err != nil && !errors.Is(err, pgx.ErrNoRows) {
				conn.Release()
				return nil, nil, 0, &DBError{Op: "acquire", Name: name, Err: err}
			}
		}
		conn.Release()
		if holder != nil && expiresAt != nil {
			return nil, &LockedError{Name: name, Holder: *holder, ExpiresAt: *expiresAt},
				jitterWait(expiresAt.Sub(dbNow)), nil
		}
		// Released or expired between the snapshot and the statement (or
		// between the two statements): try again.
		if attempt++; attempt > 3 {
			return nil, &LockedError{Name: name}, jitterWait(0), nil
		}
	}
}

// maxDeadConns bounds how many dead pooled connections one grant skips: a
// pool emptied by a failover or a mass pg_terminate_backend is drained one
// connection per retry.
const maxDeadConns = 3

// deadConnection reports whether a grant failed because its connection was
// dead, with the statement not executed or rolled back: the connection is
// closed now, and either nothing was written to it (pgconn.SafeToRetry) or the
// answer was the server's termination notice (SQLSTATE 57P01 admin shutdown,
// 57P02 crash shutdown, 57P03 cannot connect now), which a backend sends
// when it is ended while idle, before it reads the statement. A statement
// cannot commit after its answer was that notice except in the instant
// between an implicit transaction's commit and its ReadyForQuery; then the
// retried grant finds the lock held by this holder and is refused
// ([*LockedError] naming this holder, as documented for unknown outcomes),
// so a retry never produces a second holder.
func deadConnection(conn *pgxpool.Conn, err error) bool {
	if !conn.Conn().IsClosed() {
		return false
	}
	if pgconn.SafeToRetry(err) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57P01", "57P02", "57P03":
			return true
		}
	}
	return false
}

func translateGrantError(name string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "22003" { // numeric_value_out_of_range: token + 1
		return fmt.Errorf("%w: lock %q already has token 9223372036854775807; nothing changed", ErrTokenOverflow, name)
	}
	return &DBError{Op: "acquire", Name: name, Err: err}
}

// jitterWait turns the remaining time of the holder's lease into a sleep:
// the remainder plus 1ms plus up to 5% (at most 50ms) of jitter, so that
// waiters on a crashed holder do not all retry in the same millisecond.
func jitterWait(remaining time.Duration) time.Duration {
	if remaining < 0 {
		remaining = 0
	}
	if remaining > maxWait {
		return maxWait
	}
	spread := min(remaining/20, 50*time.Millisecond) + time.Millisecond
	return remaining + time.Millisecond + mrand.N(spread)
}

// AcquireMany acquires every name with [Locker.Acquire] in one canonical
// order (sorted by bytes), so that two callers asking for overlapping sets in
// any order cannot deadlock. It is all or nothing: if one acquisition fails
// (ctx ends, database error), the leases already taken are released and the
// error is returned. The leases are returned in the order of names. Duplicate
// names are rejected with [ErrInvalidName]. Every name is validated before
// any SQL runs.
func (l *Locker) AcquireMany(ctx context.Context, names []string, ttl time.Duration) ([]*Lease, error) {
	if len(names) == 0 {
		return nil, invalid(ErrInvalidName, "no names")
	}
	if err := ValidateTTL(ttl); err != nil {
		return nil, err
	}
	order := make([]int, len(names))
	for i, n := range names {
		if err := ValidateName(n); err != nil {
			return nil, err
		}
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case names[a] < names[b]:
			return -1
		case names[a] > names[b]:
			return 1
		}
		return 0
	})
	for i := 1; i < len(order); i++ {
		if names[order[i]] == names[order[i-1]] {
			return nil, invalid(ErrInvalidName, "duplicate name %q", names[order[i]])
		}
	}
	leases := make([]*Lease, len(names))
	for _, i := range order {
		s, err := l.acquire(ctx, names[i], ttl, waitOpts{})
		if err != nil {
			l.releaseAll(leases)
			return nil, err
		}
		leases[i] = s
	}
	return leases, nil
}

// releaseAll releases the non-nil leases, best effort, with its own timeout
// (the caller's context may already be over).
func (l *Locker) releaseAll(leases []*Lease) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, s := range leases {
		if s != nil {
			if err := s.Release(ctx); err != nil {
				l.log.Warn("pglock: release after failed AcquireMany", "name", s.name, "token", s.token, "err", err)
			}
		}
	}
}

// RenewToken extends the lease (name, holder, token) to ttl from now
// (database clock) and returns the new expiry. It is the stateless form of
// [Lease.Renew] for callers that only have the three values (shell scripts).
// A lease that expired, was released or was granted to someone else is not
// renewed: the error is a [*LeaseLostError] and nothing changes.
func (l *Locker) RenewToken(ctx context.Context, name, holder string, token int64, ttl time.Duration) (time.Time, error) {
	if err := validateTriple(name, holder, token); err != nil {
		return time.Time{}, err
	}
	if err := ValidateTTL(ttl); err != nil {
		return time.Time{}, err
	}
	exp, _, err := l.renew(ctx, name, holder, token, ttl)
	return exp, err
}

// ReleaseToken releases the lease (name, holder, token): the row keeps its
// token, holder and expiry become NULL, and waiters are notified. If the lease
// is no longer held by exactly that holder and token, nothing changes and the
// error is a [*LeaseLostError].
func (l *Locker) ReleaseToken(ctx context.Context, name, holder string, token int64) error {
	if err := validateTriple(name, holder, token); err != nil {
		return err
	}
	return l.release(ctx, name, holder, token)
}

// Adopt turns a grant of name to this Locker's holder, for which the caller
// has no [Lease], into one: typically a grant found with [Inspect] after
// TryAcquire or Acquire returned a transient [*DBError] (an unknown outcome
// that did land), or one left by an earlier run of this process under the
// same holder. It renews (name, holder, token) to ttl from now on the
// database clock, conditionally, so a grant that expired, was released or
// was granted to someone else is not adopted: the error is a
// [*LeaseLostError] and nothing changes. The Lease's local deadline counts
// from that renewal's send time, and Config.KeepAlive applies to it. Adopt
// never creates a grant and never changes the token. A (name, token) that
// already has a live Lease in this Locker is rejected with [ErrInvalidToken]
// (use that Lease); a renewal answered after ttl is reported like a slow
// grant ([ErrSlowGrant]), the grant left to expire.
func (l *Locker) Adopt(ctx context.Context, name string, token int64, ttl time.Duration) (*Lease, error) {
	if err := validateTriple(name, l.holder, token); err != nil {
		return nil, err
	}
	if err := ValidateTTL(ttl); err != nil {
		return nil, err
	}
	l.mu.Lock()
	closed := l.closed
	dup := false
	for s := range l.leases {
		if s.name == name && s.token == token && s.Err() == nil {
			dup = true
			break
		}
	}
	l.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if dup {
		return nil, invalid(ErrInvalidToken, "lock %q token %d already has a live Lease in this Locker; use it", name, token)
	}
	exp, sent, err := l.renew(ctx, name, l.holder, token, ttl)
	if err != nil {
		return nil, err
	}
	if took := time.Since(sent); took >= ttl {
		return nil, &DBError{Op: "adopt", Name: name, Err: &SlowGrantError{Token: token, Took: took, TTL: ttl}}
	}
	if l.log.Enabled(context.Background(), slog.LevelInfo) {
		l.log.Info("pglock: adopted", "name", name, "token", token, "ttl", ttl, "expires_at", exp)
	}
	return l.newLease(name, token, ttl, exp, sent), nil
}

func validateTriple(name, holder string, token int64) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	if err := validateHolder(holder); err != nil {
		return err
	}
	return validateToken(token)
}

func (l *Locker) renew(ctx context.Context, name, holder string, token int64, ttl time.Duration) (expiresAt time.Time, sent time.Time, err error) {
	var row dbsqlc.RenewLockRow
	err = l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		sent = time.Now() // a renewal applied twice only extends the lease again
		row, err = l.q.RenewLock(ctx, oneRoundTrip{conn}, dbsqlc.RenewLockParams{TtlUs: ttl.Microseconds(), Name: name, Holder: holder, Token: token})
		return err
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return time.Time{}, sent, &LeaseLostError{Name: name, Holder: holder, Token: token}
	case err != nil:
		return time.Time{}, sent, &DBError{Op: "renew", Name: name, Err: err}
	case row.ExpiresAt == nil:
		return time.Time{}, sent, &DBError{Op: "renew", Name: name, Err: errors.New("renew returned no expiry")}
	}
	return *row.ExpiresAt, sent, nil
}

// onLiveConn runs f on a pooled connection, and runs it again on another one
// (up to maxDeadConns times) when it failed because its connection was dead
// (see deadConnection).
func (l *Locker) onLiveConn(ctx context.Context, f func(*pgxpool.Conn) error) error {
	for deadConns := 0; ; deadConns++ {
		conn, err := l.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		err = f(conn)
		retry := err != nil && deadConns < maxDeadConns && ctx.Err() == nil && deadConnection(conn, err)
		conn.Release()
		if !retry {
			return err
		}
	}
}

// oneRoundTrip runs statements with pgx.QueryExecModeExec: parse, bind and
// execute in one round trip, never the extra prepare round trip that the
// default mode spends the first time a statement runs on a connection.
// Renewals use it: a keep-alive renewal is rare (once per TTL fraction), so
// parsing it each time costs nothing that matters, while on a new pooled
// connection over a slow network the prepare round trip would come out of
// the lease's remaining time. The statements' parameters all carry casts,
// so the server needs no type inference from the client.
type oneRoundTrip struct{ db DBTX }

func (o oneRoundTrip) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return o.db.Exec(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (o oneRoundTrip) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return o.db.Query(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (o oneRoundTrip) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return o.db.QueryRow(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
}

func (l *Locker) release(ctx context.Context, name, holder string, token int64) error {
	var n int64
	err := l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		n, err = l.q.ReleaseLock(ctx, conn, dbsqlc.ReleaseLockParams{Name: name, Holder: holder, Token: token})
		return err
	})
	switch {
	case err != nil:
		return &DBError{Op: "release", Name: name, Err: err}
	case n == 0:
		return &LeaseLostError{Name: name, Holder: holder, Token: token}
	}
	return nil
}

// LockInfo is a snapshot of one lock row, read with [Inspect].
type LockInfo struct {
	Name      string
	Token     int64     // latest grant's token; 0 = never granted
	Holder    string    // "" when released
	ExpiresAt time.Time // database clock; zero when released
	Held      bool      // holder set and expires_at > now() on the database clock
	DBNow     time.Time // the database's now() when read
}

// Inspect reads the row of lock name from db. A name that was never granted
// returns a zero LockInfo with Name set and no error. The answer is advisory:
// it may change right after it is read.
func Inspect(ctx context.Context, db DBTX, name string) (LockInfo, error) {
	if err := ValidateName(name); err != nil {
		return LockInfo{}, err
	}
	h, err := dbsqlc.New().LockHolder(ctx, db, name)
	if errors.Is(err, pgx.ErrNoRows) {
		return LockInfo{Name: name}, nil
	}
	if err != nil {
		return LockInfo{}, &DBError{Op: "inspect", Name: name, Err: err}
	}
	info := LockInfo{Name: h.Name, Token: h.Token, Held: h.Held, DBNow: h.DbNow}
	if h.Holder != nil {
		info.Holder = *h.Holder
	}
	if h.ExpiresAt != nil {
		info.ExpiresAt = *h.ExpiresAt
	}
	return info, nil
}
