package advisory

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgfence/pgfence"
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
// [pgfence.ErrInvalid], never silently replaced.
type SessionConfig struct {
	// PingInterval is how often the lock's connection is checked (one round
	// trip); Done is closed within about one interval (plus PingTimeout when
	// the network hangs) after the connection dies. Defaults to
	// 5s; at least 10ms.
	PingInterval time.Duration
	// PingTimeout bounds each check and the unlock statement of Release. A
	// check that times out counts as a lost lock, and an unlock that times
	// out fails (the connection is closed either way, which frees the lock),
	// so keep it above the server's worst response time. Defaults to 5s; at
	// least 10ms.
	PingTimeout time.Duration
	// AllowPooler accepts a connection through a pooler. Set it only for a
	// pooler in session mode: it is your statement that the pooler is one.
	// Acquire probes the pooler once (a second client connection must reach
	// another backend), which catches a transaction-mode pooler while its
	// other clients are idle, not always; the backend is still checked on
	// every ping and Done fires if it changes. Defaults to false: any pooler is refused with
	// [pgfence.ErrInvalid] (Reason: a pooler was detected).
	AllowPooler bool
}

func (c *SessionConfig) resolve(op string) (SessionConfig, error) {
	var r SessionConfig
	if c != nil {
		r = *c
	}
	switch {
	case r.PingInterval < 0:
		return r, invalid(op, "SessionConfig.PingInterval", "%v is negative", r.PingInterval)
	case r.PingInterval == 0:
		r.PingInterval = defaultPingInterval
	case r.PingInterval < minPingInterval:
		return r, invalid(op, "SessionConfig.PingInterval", "%v is below the minimum %v", r.PingInterval, minPingInterval)
	}
	switch {
	case r.PingTimeout < 0:
		return r, invalid(op, "SessionConfig.PingTimeout", "%v is negative", r.PingTimeout)
	case r.PingTimeout == 0:
		r.PingTimeout = defaultPingTimeout
	case r.PingTimeout < minPingInterval:
		return r, invalid(op, "SessionConfig.PingTimeout", "%v is below the minimum %v", r.PingTimeout, minPingInterval)
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
// backend; a pooler is refused with [pgfence.ErrInvalid] unless cfg.AllowPooler
// is set. After locking it confirms that pg_locks shows the lock granted to
// that backend. The checks cost about three round trips.
//
// A wait ended by the session's lock_timeout setting (for example set in the
// pool's connection string) returns an error matching [pgfence.ErrLocked]
// whose Err is the server's error.
//
// If ctx ends while Acquire waits, pgx closes the connection: nothing is
// held, and the error matches ctx.Err(). ctx does not govern the lock after
// Acquire returns.
func Acquire(ctx context.Context, pool *pgxpool.Pool, key Key, mode Mode, cfg *SessionConfig) (*SessionLock, error) {
	return acquire(ctx, "advisory.Acquire", pool, key, mode, cfg, false)
}

// TryAcquire is like [Acquire] but does not wait: when another session holds
// a conflicting lock it returns an error matching [pgfence.ErrLocked] and
// the connection goes back to the pool. It uses pg_try_advisory_lock or
// pg_try_advisory_lock_shared.
func TryAcquire(ctx context.Context, pool *pgxpool.Pool, key Key, mode Mode, cfg *SessionConfig) (*SessionLock, error) {
	return acquire(ctx, "advisory.TryAcquire", pool, key, mode, cfg, true)
}

func acquire(ctx context.Context, op string, pool *pgxpool.Pool, key Key, mode Mode, cfg *SessionConfig, try bool) (*SessionLock, error) {
	if pool == nil {
		return nil, invalid(op, "pool", "nil pool")
	}
	if err := key.valid(op); err != nil {
		return nil, err
	}
	if err := mode.valid(op); err != nil {
		return nil, err
	}
	c, err := cfg.resolve(op)
	if err != nil {
		return nil, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, dbError(op, "acquire connection", key, ctxErr(ctx, err))
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
		return nil, dbError(op, "check backend", key, ctxErr(ctx, err))
	}
	if pid1 != startup && !c.AllowPooler {
		conn.Release()
		return nil, poolerError(op, key, startup, []uint32{pid1},
			"the process ID announced at connection start is not the backend's")
	}

	if pid1 != startup {
		// AllowPooler: the user says the pooler runs in session mode. Test it
		// from a second client connection: in session mode it must reach
		// another backend; a transaction-mode pooler hands out the server
		// connection our statement just released.
		shared, err := probeSharedBackend(ctx, pool, pid1)
		if err != nil || shared {
			if ctx.Err() != nil {
				destroy(conn)
			} else {
				conn.Release()
			}
			if err != nil {
				return nil, dbError(op, "check pooler", key, ctxErr(ctx, err))
			}
			return nil, poolerError(op, key, startup, []uint32{pid1, pid1},
				"two client connections reached the same backend: the pooler shares backends (transaction or statement mode)")
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
		return nil, lockErr(ctx, op, key, mode, err)
	}
	if !ok {
		if pid2 != pid1 {
			destroy(conn)
			return nil, poolerError(op, key, startup, []uint32{pid1, pid2},
				"statements of one connection ran on different backends")
		}
		conn.Release()
		return nil, lockedError(op, key, mode, nil)
	}

	// 3. In a separate statement: same backend, and the lock is granted to it.
	sql, args := heldSQL(key, mode)
	var pid3 uint32
	var held bool
	if err := conn.QueryRow(ctx, sql, args...).Scan(&pid3, &held); err != nil {
		destroy(conn)
		return nil, dbError(op, "verify lock", key, ctxErr(ctx, err))
	}
	if pid1 != pid2 || pid2 != pid3 || !held {
		// The lock may now be held by a backend we cannot reach; closing our
		// connection is all we can do (it frees it when there is no pooler).
		destroy(conn)
		reason := "statements of one connection ran on different backends"
		if pid1 == pid2 && pid2 == pid3 {
			reason = "pg_locks does not show the lock granted to this backend"
		}
		return nil, poolerError(op, key, startup, []uint32{pid1, pid2, pid3}, reason)
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

// Err returns nil while the lock is held. Once a check has found the lock
// lost it returns an error matching [pgfence.ErrLost] (its Err is the failed
// check's error), and it keeps returning that error after Release.
// Otherwise, after Release it returns an error matching
// [pgfence.ErrReleased], whatever Release returned.
func (l *SessionLock) Err() error {
	l.errMu.Lock()
	defer l.errMu.Unlock()
	return l.err
}

// Release releases the lock (pg_advisory_unlock or pg_advisory_unlock_shared)
// and returns the connection to the pool clean. If PostgreSQL does not
// confirm the unlock, or the statement fails, the connection is destroyed
// instead (ending the backend frees the lock): a failed statement is a
// database failure (no Kind; Err is the driver's error), an unlock PostgreSQL
// did not confirm (the backend did not hold the lock) matches
// [pgfence.ErrLost] (Err is nil; Reason says pg_advisory_unlock returned
// false).
//
// If the lock had been lost, Release frees what is left and returns the
// error matching [pgfence.ErrLost], so a caller learns that its exclusive
// section was not exclusive. Calling Release again returns an error matching
// [pgfence.ErrReleased].
//
// Release is final whatever ctx says: when it returns, the lock is released,
// the pinger has stopped and the connection is back in the pool or closed.
// It keeps ctx's values but not its cancellation or deadline, so that
// defer lock.Release(ctx) frees the lock also after ctx ended. It waits for a
// check in progress (at most [SessionConfig.PingTimeout], plus closing the
// connection if the check failed), then runs the unlock statement bounded by
// PingTimeout; an unlock that times out is a failed statement (its error
// matches [context.DeadlineExceeded]) and the connection is destroyed.
func (l *SessionLock) Release(ctx context.Context) error {
	const op = "advisory.SessionLock.Release"
	if l == nil {
		return invalid(op, "lock", "nil *SessionLock")
	}
	// Not abandoned when ctx ends: a check holds sem for at most PingTimeout
	// (plus closeTimeout), and an unlock for at most PingTimeout.
	if ctx == nil {
		// Release is final whatever ctx says (it unlocks on a context
		// that outlives ctx), so a nil one is no reason to keep the lock:
		// it panicked after the pinger was stopped, and a recovered panic
		// left the lock held, and its connection out of the pool, for the
		// life of the process.
		ctx = context.Background()
	}
	l.sem <- struct{}{}
	defer func() { <-l.sem }()

	switch l.state {
	case stateUnlocked:
		return errReleased
	case stateLost:
		l.state = stateUnlocked
		return l.Err()
	}
	uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.cfg.PingTimeout)
	defer cancel()
	l.state = stateUnlocked
	close(l.stop)
	l.wg.Wait() // the pinger is not using conn: we hold sem

	sql, args := unlockSQL(l.key, l.mode)
	var ok bool
	err := l.conn.QueryRow(uctx, sql, args...).Scan(&ok)
	if err != nil || !ok {
		destroy(l.conn)
		l.finish(errReleased)
		if err != nil {
			return dbError(op, "unlock (the connection was closed, which frees the lock)", l.key, ctxErr(uctx, err))
		}
		return &pgfence.Error{Op: op, Kind: pgfence.ErrLost, Name: keyName(l.key),
			Reason: fmt.Sprintf("pg_advisory_unlock returned false: backend %d did not hold the lock", l.pid)}
	}
	l.conn.Release()
	l.finish(errReleased)
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
			l.finish(lostError(l.key, l.pid, err))
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
// reports whether it reaches backend pid, which a pooler in session mode can
// never do while our client connection is open.
func probeSharedBackend(ctx context.Context, pool *pgxpool.Pool, pid uint32) (bool, error) {
	c, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		return false, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		defer cancel()
		_ = c.Close(cctx)
	}()
	var other uint32
	if err := c.QueryRow(ctx, pidSQL, execMode).Scan(&other); err != nil {
		return false, err
	}
	return other == pid, nil
}
