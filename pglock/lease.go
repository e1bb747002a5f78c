package pglock

import (
	"context"
	"errors"
	"log/slog"
	mrand "math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/metricdefs"
)

// Lease is one grant of a lock: a name, the holder, the fencing token of this
// grant and its expiry. Pass [Lease.Token] to every write the lease protects.
// Its methods are safe for concurrent use.
//
// A Lease ends — Done is closed, Context is cancelled, Err is non-nil — when
// it is released, when the database refuses a renewal, when its local
// deadline passes, or when the Locker is closed. An ended lease never comes
// back; take a new one.
type Lease struct {
	l      *Locker
	name   string
	holder string
	token  int64
	ttl    time.Duration

	renewMu sync.Mutex // serialises renewals so the last sent is the last committed

	grantedAt    time.Time // local, for the hold-time metric
	bornClosed   bool      // made after the Locker closed, and ended at once (set before it is returned)
	renewFailing bool      // the latest renewal failed with a connection error (under mu)

	mu        sync.Mutex
	expiresAt time.Time // database clock
	deadline  time.Time // local, monotonic: send time of the grant/renewal + ttl
	timer     *time.Timer
	err       error
	released  bool
	// ctx and cancel are made on first use (Done, Context, keep-alive): most
	// leases are released without anyone asking for them. cancelled is set
	// once end has recorded its metrics and cancels ctx.
	ctx       context.Context
	cancel    context.CancelCauseFunc
	cancelled bool

	releasing bool // Release is under way: the keep-alive leaves the lease alone (under mu)
	// releaseTried: a Release failed with an unknown outcome (under renewMu).
	releaseTried bool
	// acquiredDB is the grant's acquired_at in the lock row (database
	// clock), as the grant's expiry implies it (releasedEarlier).
	acquiredDB time.Time
}

func (l *Locker) newLease(name string, token int64, ttl time.Duration, expiresAt, sent time.Time) *Lease {
	s := &Lease{l: l, name: name, holder: l.holder, token: token, ttl: ttl, expiresAt: expiresAt, deadline: sent.Add(ttl), grantedAt: sent,
		// Every grant sets expires_at = now() + ttl (µs) and acquired_at =
		// now(). (For an adopted lease, expiresAt is its renewal's: this is
		// then not the row's acquired_at, unless the renewal kept an expiry
		// set by that grant, and Release's retry inference does not apply.)
		acquiredDB: expiresAt.Add(-time.Duration(ttl.Microseconds()) * time.Microsecond)}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		s.bornClosed = true
		s.end(closedError("pglock.Close", name))
		return s
	}
	l.leases[s] = struct{}{}
	l.mu.Unlock()
	// The deadline timer starts once the lease is registered: a deadline
	// already past (a grant answered after its TTL) ends the lease at once,
	// and end must find it registered to take it out again (it stayed in
	// l.leases until Close).
	s.mu.Lock()
	if s.err == nil {
		s.timer = time.AfterFunc(time.Until(s.deadline), s.deadlinePassed)
	}
	s.mu.Unlock()
	if l.cfg.KeepAlive {
		// Kept alive once its timer exists (a renewal re-arms it), and only
		// while registered: end takes it out of l.leases before it takes it
		// out of the keeper. Not once Close has begun (it ends s): the
		// keeper's goroutine must not start after Close waits for it.
		l.mu.Lock()
		if _, ok := l.leases[s]; ok && !l.closed {
			l.keeper.add(s)
		}
		l.mu.Unlock()
	}
	return s
}

// Name returns the lock name.
func (s *Lease) Name() string { return s.name }

// Holder returns the holder identity stored in the lock row.
func (s *Lease) Holder() string { return s.holder }

// Token returns the fencing token of this grant: larger than the token of
// every earlier grant of the same lock name. Pass it to fenced writes.
func (s *Lease) Token() int64 { return s.token }

// Key returns a copy of the lease key the lease was granted with, its
// Locker's [Config.Key]. With the name and the token it is what renewing or
// releasing the lease takes: pass it to another process (a Locker with the
// same Config.Key, the CLI's --key) that must renew or release this lease.
// Keep it secret; unlike the token, it is never written to a fenced row.
func (s *Lease) Key() []byte { return slices.Clone(s.l.key) }

// TTL returns the lease duration requested at acquisition; renewals extend
// by the same duration.
func (s *Lease) TTL() time.Duration { return s.ttl }

// ExpiresAt returns the expiry granted by the latest successful grant or
// renewal, on the database's clock. Do not compare it with time.Now(): use
// [Lease.Deadline] for local decisions.
func (s *Lease) ExpiresAt() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.expiresAt
}

// Deadline returns the local deadline: the send time of the latest successful
// grant or renewal plus the TTL, on this process's monotonic clock. The
// database cannot expire the lease before it. Advisory: a pause can begin
// right after the check; only a fenced write is safe.
func (s *Lease) Deadline() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deadline
}

// Done returns a channel closed when the lease ends (see [Lease]).
func (s *Lease) Done() <-chan struct{} { return s.context().Done() }

// Context returns a context cancelled when the lease ends; context.Cause
// returns the same error as [Lease.Err]. Derive the work's context from it.
func (s *Lease) Context() context.Context { return s.context() }

// context returns the lease's context, making it on first use; if end has
// already cancelled, the new context is cancelled at once with the same cause.
func (s *Lease) context() context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx == nil {
		s.ctx, s.cancel = context.WithCancelCause(context.Background())
		if s.cancelled {
			s.cancel(s.err)
		}
	}
	return s.ctx
}

// Err returns nil while the lease is live, then why it ended, as a
// [*pgfence.Error] whose Op is the call that ended it: one matching
// [pgfence.ErrLost] when it was lost (a refused renewal or release; it also
// matches context.DeadlineExceeded when the local deadline passed, Op
// "pglock.Lease"), [pgfence.ErrReleased] after Release, or
// [pgfence.ErrClosed] after Locker.Close.
//
// Once the local deadline has passed, Err reports the lease lost even if
// the deadline's timer has not fired yet (a busy machine can run it late),
// and ends the lease there and then: Done is closed by the time Err
// returns. A caller that checks Err before each write never writes on a
// lease past its deadline.
func (s *Lease) Err() error {
	s.mu.Lock()
	err := s.err
	passed := err == nil && s.timer != nil && !time.Now().Before(s.deadline)
	s.mu.Unlock()
	if !passed {
		return err
	}
	s.end(s.lost("pglock.Lease", errDeadline))
	return s.state()
}

// state is why the lease ended, nil while it has not: Err without the
// deadline check, for callers that hold the Locker's mutex (end takes it).
func (s *Lease) state() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// lost is the error of this lease lost in op (see lostError).
func (s *Lease) lost(op string, cause error) *pgfence.Error {
	return lostError(op, s.name, s.holder, s.token, cause)
}

func (s *Lease) deadlinePassed() {
	s.mu.Lock()
	early := time.Now().Before(s.deadline) // the timer was re-armed by a renewal in between
	s.mu.Unlock()
	if early {
		return
	}
	s.end(s.lost("pglock.Lease", errDeadline))
}

// end records why the lease ended (the first reason wins), cancels its
// context, stops its timer and keep-alive and forgets it in the Locker.
func (s *Lease) end(err error) {
	s.mu.Lock()
	if s.err != nil {
		s.mu.Unlock()
		return
	}
	s.err = err
	if s.timer != nil {
		s.timer.Stop()
	}
	renewFailing := s.renewFailing
	s.mu.Unlock()
	// Metrics before cancelling, so whoever waits on Done sees them; logs
	// after, so a slow log handler cannot delay Done. The metrics get a
	// background context: the lease's own carries no values.
	s.l.m.Observe(context.Background(), metricdefs.LeaseHoldSeconds, time.Since(s.grantedAt).Seconds())
	reason := ""
	if errors.Is(err, pgfence.ErrLost) {
		reason = metricdefs.LostRenewalRefused
		if errors.Is(err, errDeadline) || errors.Is(err, errRenewDeadline) {
			reason = metricdefs.LostDeadline
			if renewFailing {
				reason = metricdefs.LostConnection
			}
		}
		s.l.m.Add(context.Background(), metricdefs.LeasesLostTotal, 1, reason)
	}
	s.mu.Lock()
	s.cancelled = true
	cancel := s.cancel
	s.mu.Unlock()
	if cancel != nil {
		cancel(err)
	}
	switch {
	case errors.Is(err, pgfence.ErrReleased):
		if s.l.log.Enabled(context.Background(), slog.LevelInfo) {
			s.l.log.Info("pglock: released", "name", s.name, "token", s.token)
		}
	case reason != "":
		s.l.log.Warn("pglock: lease lost", "name", s.name, "token", s.token, "reason", reason, "err", err)
	default:
		s.l.log.Debug("pglock: lease ended", "name", s.name, "token", s.token, "err", err)
	}
	s.l.mu.Lock()
	delete(s.l.leases, s)
	s.l.mu.Unlock()
	s.l.keeper.remove(s)
}

// Renew extends the lease by its TTL from now (database clock) and moves the
// local deadline to this renewal's send time plus the TTL. If the database
// refuses (the lease expired, was released or was granted to someone else),
// the lease ends at once and Renew returns a [*pgfence.Error] matching
// [pgfence.ErrLost], with the holder and the token. A connection error is a
// [*pgfence.Error] with no Kind whose cause is the driver's error, and leaves
// the lease as it was. On an ended lease Renew returns [Lease.Err] without
// SQL. After a failed [Lease.Release], Renew still renews the lease, but
// KeepAlive does not take it up again.
func (s *Lease) Renew(ctx context.Context) error {
	const op = "pglock.Renew"
	s.renewMu.Lock()
	defer s.renewMu.Unlock()
	if err := s.Err(); err != nil {
		return err
	}
	if !time.Now().Before(s.Deadline()) {
		// The deadline timer is about to fire: do not extend a lease that has
		// ended locally.
		lost := s.lost(op, errDeadline)
		s.end(lost)
		return lost
	}
	exp, sent, err := s.l.renew(ctx, op, s.name, s.token, s.ttl)
	if err != nil {
		if errors.Is(err, pgfence.ErrLost) {
			s.l.m.Add(ctx, metricdefs.LeaseRenewalsTotal, 1, metricdefs.RenewRefused)
			s.end(err)
		} else {
			s.l.m.Add(ctx, metricdefs.LeaseRenewalsTotal, 1, metricdefs.RenewError)
			s.mu.Lock()
			s.renewFailing = true
			s.mu.Unlock()
		}
		return err
	}
	s.l.m.Add(ctx, metricdefs.LeaseRenewalsTotal, 1, metricdefs.RenewOK)
	s.mu.Lock()
	if s.err != nil {
		err := s.err
		s.mu.Unlock()
		return err
	}
	if !time.Now().Before(s.deadline) {
		// The old deadline passed while the renewal was in flight: the lease
		// has ended locally, whatever the database says now.
		s.mu.Unlock()
		lost := s.lost(op, errDeadline)
		s.end(lost)
		return lost
	}
	s.expiresAt = exp
	s.renewFailing = false
	s.deadline = sent.Add(s.ttl)
	s.timer.Reset(time.Until(s.deadline))
	s.mu.Unlock()
	return nil
}

// Release gives the lock back and wakes its waiters; the row keeps its token.
// It is conditional on (name, token, key): if the lease was lost, nothing
// changes and Release returns a [*pgfence.Error] matching [pgfence.ErrLost].
// A Release of a Lease that has ended still releases the grant if the
// database holds it; another Lease of the same grant ([Locker.Adopt])
// then ends with [pgfence.ErrLost].
// It is sent even after the local deadline passed (the database may still
// hold the lease); a second Release after a successful one returns nil
// without SQL. A connection error, or ctx ending while the statement is
// out, is a [*pgfence.Error] with no Kind whose cause is the driver's (or
// ctx's) error: the release may have happened or not (a statement that
// carries other Releases of the Locker goes on for them). The Lease stays
// live locally until its local deadline, but KeepAlive no longer renews it:
// call Release again to know (before the TTL passes, to be sure of an
// answer: it returns nil if the row shows that the lease was released and
// nobody took the name since, by the failed attempt or by another process
// holding its key, even once the local deadline has ended the Lease with
// [pgfence.ErrLost]; not for an adopted lease, whose grant time this Locker
// does not know); a caller that gives up leaves the grant to expire at its TTL,
// rather than held for as long as the process lives. Until then Done and
// Context do not end, even if the release did happen.
func (s *Lease) Release(ctx context.Context) error {
	const op = "pglock.Release"
	s.renewMu.Lock()
	defer s.renewMu.Unlock()
	s.mu.Lock()
	done := s.released
	s.releasing = true // the keep-alive stops renewing it
	s.mu.Unlock()
	if done {
		return nil
	}
	err := s.l.releaseGrant(ctx, op, s.name, s.token, s)
	if errors.Is(err, pgfence.ErrLost) && s.releaseTried {
		if done, rerr := s.releasedEarlier(ctx); done {
			err = nil // an earlier attempt of this Release did it
			s.l.grantReleased(s.name, s.token, s)
		} else if rerr != nil {
			e := lostError(op, s.name, s.holder, s.token, rerr)
			e.Reason = "not held any more; an earlier Release whose outcome was unknown may have released it (the lock row could not be read to tell)"
			err = e
		}
	}
	if err == nil {
		s.mu.Lock()
		s.released = true
		s.mu.Unlock()
		s.end(errReleased) // shared: a release allocates nothing for it
		return nil
	}
	if errors.Is(err, pgfence.ErrLost) {
		s.end(err)
		return err
	}
	s.releaseTried = true
	// Not known to be released (a connection error, ctx ended): the lease
	// stays live locally until its deadline, and the keep-alive leaves it
	// alone (releasing stays set): renewing it again would keep a grant its
	// caller gave up on held for as long as the process lives, when that
	// caller does not call Release again. Its end at the deadline is
	// counted as a connection loss, not as a too-short TTL.
	s.mu.Lock()
	s.renewFailing = true
	s.mu.Unlock()
	return err
}

// releasedEarlier reports, after a Release was refused, whether the row
// says that an earlier attempt whose outcome was unknown released the
// lease: it still carries this grant (its token, and its acquired_at) and
// nobody holds it. Only a release with the lease's key clears the holder
// and keeps the token, and only while the lease is live, so no other holder
// had the name in between (a process holding the same key may have been
// the one: Lease.Key). A lease handed on to a waiter by that release has a
// new token: its Release stays refused. err is set when the row could not
// be read.
func (s *Lease) releasedEarlier(ctx context.Context) (bool, error) {
	s.l.calls.add() // Close waits for the read
	defer s.l.calls.done()
	var h dbsqlc.LockHolderRow
	err := s.l.onLiveConn(ctx, func(conn *pgxpool.Conn) (err error) {
		h, err = s.l.q.LockHolder(ctx, conn, s.name)
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return h.Token == s.token && h.Holder == nil && h.AcquiredAt != nil && h.AcquiredAt.Equal(s.acquiredDB), nil
}

// errReleased is the end of every released lease (Lease.Err after Release);
// the lease itself says its name and token.
var errReleased = &pgfence.Error{Op: "pglock.Release", Kind: pgfence.ErrReleased}

// jitter returns d ± 10%.
func jitter(d time.Duration) time.Duration {
	spread := d / 5
	if spread <= 0 {
		return d
	}
	return d - spread/2 + mrand.N(spread)
}
