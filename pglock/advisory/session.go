package advisory

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Session-lock defaults and limits.
const (
	// defaultPingInterval is how often a [SessionLock] checks its connection
	// when [SessionConfig.PingInterval] is zero.
	defaultPingInterval = 5 * time.Second
	// defaultPingTimeout bounds each check when [SessionConfig.PingTimeout]
	// is zero.
	defaultPingTimeout = 5 * time.Second
	// minPingInterval is the smallest accepted [SessionConfig.PingInterval]
	// and [SessionConfig.PingTimeout].
	minPingInterval = 10 * time.Millisecond
	// closeTimeout bounds closing a connection that is being destroyed.
	closeTimeout = 5 * time.Second
)

// SessionConfig configures [Acquire] and [TryAcquire]. A nil *SessionConfig
// means all defaults. Out-of-range values are refused with an error matching
// [ErrInvalidConfig], never silently replaced.
type SessionConfig struct {
	// PingInterval is how often the lock's connection is checked (one round
	// trip); Done is closed within about one interval (plus PingTimeout when
	// the network hangs) after the connection dies. Defaults to
	// 5s; at least 10ms.
	PingInterval time.Duration
	// PingTimeout bounds each check. A check that times out counts as a lost
	// lock (the connection is closed, which frees it), so keep it above the
	// server's worst response time. Defaults to 5s; at
	// least 10ms.
	PingTimeout time.Duration
	// AllowPooler accepts a connection through a pooler. Set it only for a
	// pooler in session mode; the backend is still checked on every ping and
	// Done fires if it changes. Defaults to false: any pooler is refused with
	// a *PoolerError.
	AllowPooler bool
}

func (c *SessionConfig) resolve() (SessionConfig, error) {
	var r SessionConfig
	if c != nil {
		r = *c
	}
	switch {
	case r.PingInterval < 0:
		return r, fmt.Errorf("%w: PingInterval %v is negative", ErrInvalidConfig, r.PingInterval)
	case r.PingInterval == 0:
		r.PingInterval = defaultPingInterval
	case r.PingInterval < minPingInterval:
		return r, fmt.Errorf("%w: PingInterval %v is below the minimum %v", ErrInvalidConfig, r.PingInterval, minPingInterval)
	}
	switch {
	case r.PingTimeout < 0:
		return r, fmt.Errorf("%w: PingTimeout %v is negative", ErrInvalidConfig, r.PingTimeout)
	case r.PingTimeout == 0:
		r.PingTimeout = defaultPingTimeout
	case r.PingTimeout < minPingInterval:
		return r, fmt.Errorf("%w: PingTimeout %v is below the minimum %v", ErrInvalidConfig, r.PingTimeout, minPingInterval)
	}
	return r, nil
}

// SessionLock is a session-scoped advisory lock held on a connection taken
// from a pool for the lock's lifetime. Make one with [Acquire] or
// [TryAcquire]; release it with [SessionLock.Release].
//
// A session lock is an efficiency lock: it does not protect data. When its
// connection dies the server frees the lock at once and another process can
// take it while the first is still working. For correctness use [Xact] or a
// lease with fenced writes (package pglock).
//
// Its methods are safe for concurrent use.
type SessionLock struct {
	key   Key
	mode  Mode
	pid   uint32
	conn  *pgxpool.Conn
	cfg   SessionConfig
	sem   chan struct{} // one user of conn at a time (ping or Release)
	stop  chan struct{} // closed to stop the pinger
	done  chan struct{} // closed when the lock is released or lost
	wg    sync.WaitGroup
	state lockState // guarded by sem
	err   error     // guarded by errMu: nil while held
	errMu sync.Mutex
}

type lockState uint8

const (
	stateHeld lockState = iota
	stateLost
	stateUnlocked
)

// Acquire takes a session-scoped advisory lock on key in mode
// (pg_advisory_lock or pg_advisory_lock_shared), waiting as long as ctx
// allows. It takes a connection from pool and keeps it until Release or until
// the lock is lost; the pool has one connection fewer meanwhile, and
// pool.Close waits for it.
//
// Before locking it checks that the connection leads to one dedicated
// backend; a pooler is refused with a [*PoolerError] unless cfg.AllowPooler
// is set. After locking it confirms that pg_locks shows the lock granted to
// that backend. The checks cost about three round trips.
//
// A wait ended by the session's lock_timeout setting (for example set in the
// pool's connection string) returns a [*LockedError].
//
// If ctx ends while Acquire waits, pgx closes the connection: nothing is
// held, and the error matches ctx.Err(). ctx does not govern the lock after
// Acquire returns.
func Acquire(ctx context.Context, pool *pgxpool.Pool, key Key, mode Mode, cfg *SessionConfig) (*SessionLock, error) {
	return acquire(ctx, pool, key, mode, cfg, false)
}

// TryAcquire is like [Acquire] but does not wait: when another session holds
// a conflicting lock it returns a [*LockedError] (matching [ErrLocked]) and
// the connection goes back to the pool. It uses pg_try_advisory_lock or
// pg_try_advisory_lock_shared.
func TryAcquire(ctx context.Context, pool *pgxpool.Pool, key Key, mode Mode, cfg *SessionConfig) (*SessionLock, error) {
	return acquire(ctx, pool, key, mode, cfg, true)
}

func acquire(ctx context.Context, pool *pgxpool.Pool, key Key, mode Mode, cfg *SessionConfig, try bool) (*SessionLock, error) {
	if pool == nil {
		return nil, ErrNilDB
	}
	if err := key.valid(); err != nil {
		return nil, err
	}
	if err := mode.valid(); err != nil {
		return nil, err
	}
	c, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, &DBError{Op: "acquire connection for", Key: key, Err: ctxErr(ctx, err)}
	}

	// 1. Dedicated backend? Checked before locking: a lock taken through a
	// transaction-mode pooler would stay on a server connection we cannot
	// reach again.
	startup := conn.Conn().PgConn().PID()
	var pid1 uint32
	if err := conn.QueryRow(ctx, pidSQL, execMode).Scan(&pid1); err != nil {
		// Closed now, not by the pool later: a cancelled statement leaves
		// the connection closing, and the caller gets it back accounted for.
		destroy(conn)
		return nil, &DBError{Op: "check backend for", Key: key, Err: ctxErr(ctx, err)}
	}
	if pid1 != startup && !c.AllowPooler {
		conn.Release()
		return nil, &PoolerError{StartupPID: startup, BackendPIDs: []uint32{pid1},
			Reason: "the process ID announced at connection start is not the backend's"}
	}

	if pid1 != startup {
		// AllowPooler: the user says the pooler runs in session mode. Test it
		// from a second client connection: in session mode it must reach
		// another backend; a transaction-mode pooler hands out the server
		// connection our statement just released.
		if err := probeSharedBackend(ctx, pool, pid1); err != nil {
			if ctx.Err() != nil {
				destroy(conn)
			} else {
				conn.Release()
			}
			var pe *PoolerError
			if errors.As(err, &pe) {
				pe.StartupPID = startup
				return nil, pe
			}
			return nil, &DBError{Op: "check pooler for", Key: key, Err: ctxErr(ctx, err)}
		}
	}

	// 2. Lock; the same statement reports the backend that took it.
	var ok bool
	var pid2 uint32
	if try {
		sql, args := sessionTryLockSQL(key, mode)
		err = conn.QueryRow(ctx, sql, args...).Scan(&ok, &pid2)
	} else {
		sql, args := sessionLockSQL(key, mode)
		err = conn.QueryRow(ctx, sql, args...).Scan(&ok, &pid2)
	}
	if err != nil {
		// A failed lock statement holds nothing; a cancelled one closed the
		// connection. Destroy it either way: its state is unknown.
		destroy(conn)
		return nil, lockErr(ctx, "lock", key, mode, err)
	}
	if !ok {
		if pid2 != pid1 {
			destroy(conn)
			return nil, &PoolerError{StartupPID: startup, BackendPIDs: []uint32{pid1, pid2},
				Reason: "statements of one connection ran on different backends"}
		}
		conn.Release()
		return nil, &LockedError{Key: key, Mode: mode}
	}

	// 3. In a separate statement: same backend, and the lock is granted to it.
	sql, args := heldSQL(key, mode)
	var pid3 uint32
	var held bool
	if err := conn.QueryRow(ctx, sql, args...).Scan(&pid3, &held); err != nil {
		destroy(conn)
		return nil, &DBError{Op: "verify lock", Key: key, Err: ctxErr(ctx, err)}
	}
	if pid1 != pid2 || pid2 != pid3 || !held {
		// The lock may now be held by a backend we cannot reach; closing our
		// connection is all we can do (it frees it when there is no pooler).
		destroy(conn)
		reason := "statements of one connection ran on different backends"
		if pid1 == pid2 && pid2 == pid3 {
			reason = "pg_locks does not show the lock granted to this backend"
		}
		return nil, &PoolerError{StartupPID: startup, BackendPIDs: []uint32{pid1, pid2, pid3}, Reason: reason}
	}

	l := &SessionLock{
		key:  key,
		mode: mode,
		pid:  pid1,
		conn: conn,
		cfg:  c,
		sem:  make(chan struct{}, 1),
		stop: make(chan struct{}),
		done: make(chan struct{}),
	}
	l.wg.Add(1)
	go l.pinger()
	return l, nil
}

// Key returns the locked key.
func (l *SessionLock) Key() Key { return l.key }

// Mode returns the lock mode.
func (l *SessionLock) Mode() Mode { return l.mode }

// PID returns the process ID of the backend holding the lock (pg_locks.pid),
// for operators: pg_terminate_backend(pid) frees the lock.
func (l *SessionLock) PID() uint32 { return l.pid }

// Done returns a channel that is closed when the lock ends: when its
// connection fails a check or when Release is called; Err says which. After a
// loss another session may already hold the lock: stop the work. Done is
// advisory: the connection can die right after a successful check.
func (l *SessionLock) Done() <-chan struct{} { return l.done }

// Err returns nil while the lock is held, a [*LostError] (matching [ErrLost])
// after the lock was lost, and [ErrReleased] after a successful Release.
func (l *SessionLock) Err() error {
	l.errMu.Lock()
	defer l.errMu.Unlock()
	return l.err
}

// Release releases the lock (pg_advisory_unlock or pg_advisory_unlock_shared)
// and returns the connection to the pool clean. If PostgreSQL does not
// confirm the unlock, or the statement fails, the connection is destroyed
// instead (ending the backend frees the lock) and the error matches
// [ErrReleaseFailed].
//
// If the lock had been lost, Release frees what is left and returns the
// [*LostError], so a caller learns that its exclusive section was not
// exclusive. Calling Release again returns [ErrReleased].
//
// If ctx ends before a running check finishes, Release returns ctx's error and
// the lock is still held: call Release again. If ctx ends during the unlock
// statement, pgx closes the connection, which frees the lock; the error then
// matches both ErrReleaseFailed and ctx.Err().
func (l *SessionLock) Release(ctx context.Context) error {
	if l == nil {
		return ErrNilDB
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("advisory: unlock key %v: %w", l.key, err)
	}
	select {
	case l.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("advisory: unlock key %v: %w", l.key, ctx.Err())
	}
	defer func() { <-l.sem }()

	switch l.state {
	case stateUnlocked:
		return ErrReleased
	case stateLost:
		l.state = stateUnlocked
		return l.Err()
	}
	l.state = stateUnlocked
	close(l.stop)
	l.wg.Wait() // the pinger is not using conn: we hold sem

	sql, args := unlockSQL(l.key, l.mode)
	var ok bool
	err := l.conn.QueryRow(ctx, sql, args...).Scan(&ok)
	if err != nil || !ok {
		destroy(l.conn)
		l.finish(ErrReleased)
		if err == nil {
			err = errors.New("pg_advisory_unlock returned false: the backend did not hold the lock")
		}
		return &DBError{Op: "unlock", Key: l.key, Err: errors.Join(ErrReleaseFailed, ctxErr(ctx, err))}
	}
	l.conn.Release()
	l.finish(ErrReleased)
	return nil
}

// finish records why the lock ended and closes Done.
func (l *SessionLock) finish(err error) {
	l.errMu.Lock()
	l.err = err
	l.errMu.Unlock()
	close(l.done)
}

// pinger checks the connection every PingInterval until stop is closed or a
// check fails.
func (l *SessionLock) pinger() {
	defer l.wg.Done()
	t := time.NewTicker(l.cfg.PingInterval)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-t.C:
		}
		select {
		case l.sem <- struct{}{}:
		case <-l.stop:
			return
		}
		if l.state != stateHeld {
			<-l.sem
			return
		}
		if err := l.check(); err != nil {
			l.state = stateLost
			destroy(l.conn)
			l.finish(&LostError{Key: l.key, PID: l.pid, Cause: err})
			<-l.sem
			return
		}
		<-l.sem
	}
}

// check runs one cheap statement on the lock's connection and confirms the
// backend did not change.
func (l *SessionLock) check() error {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.PingTimeout)
	defer cancel()
	var pid uint32
	if err := l.conn.QueryRow(ctx, pidSQL, execMode).Scan(&pid); err != nil {
		return ctxErr(ctx, err)
	}
	if pid != l.pid {
		return fmt.Errorf("the connection now reaches backend %d (a pooler switched backends)", pid)
	}
	return nil
}

// destroy takes conn out of its pool and closes it, so a connection in an
// unknown state (possibly still holding a lock) is never reused.
func destroy(conn *pgxpool.Conn) {
	c := conn.Hijack()
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	_ = c.Close(ctx)
}

// probeSharedBackend opens a separate connection with the pool's settings and
// fails with a *PoolerError when it reaches backend pid, which a pooler in
// session mode can never do while our client connection is open.
func probeSharedBackend(ctx context.Context, pool *pgxpool.Pool, pid uint32) error {
	c, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		defer cancel()
		_ = c.Close(cctx)
	}()
	var other uint32
	if err := c.QueryRow(ctx, pidSQL, execMode).Scan(&other); err != nil {
		return err
	}
	if other == pid {
		return &PoolerError{BackendPIDs: []uint32{pid, other},
			Reason: "two client connections reached the same backend: the pooler shares backends (transaction or statement mode)"}
	}
	return nil
}
