package pglock

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
)

// Default election timings, in the spirit of Kubernetes leader election.
const (
	defaultLeaseDuration = 15 * time.Second
	minRetryPeriod       = 10 * time.Millisecond // a leader renewing in a tight loop helps nobody
)

// ElectionConfig configures an [Elector]. A nil *ElectionConfig means all
// defaults. Timings must satisfy 10ms <= RetryPeriod < RenewDeadline <
// LeaseDuration. An unset RenewDeadline is 2/3 of LeaseDuration, an unset
// RetryPeriod 1/5 of RenewDeadline (10s and 2s for the default 15s).
type ElectionConfig struct {
	// LeaseDuration is the TTL of the leader's lease: after the leader stops
	// renewing (crash, partition), a candidate takes over within about
	// LeaseDuration + RetryPeriod. Defaults to 15s.
	LeaseDuration time.Duration
	// RenewDeadline is how long the leader keeps retrying failed renewals
	// (counted from the send time of the last successful one) before it steps
	// down on its own, at that moment even between two RetryPeriod ticks.
	// Being shorter than LeaseDuration, it makes the old leader stop before
	// the database lets anyone else in. Defaults to 2/3 of LeaseDuration.
	RenewDeadline time.Duration
	// RetryPeriod is the interval between the leader's renewals and the
	// longest a candidate sleeps between attempts (a release wakes it at once
	// through LISTEN; the holder's expiry wakes it too). At least 10ms.
	// Defaults to 1/5 of RenewDeadline.
	RetryPeriod time.Duration
	// OnStartedLeading is called in its own goroutine when this candidate
	// becomes leader. ctx ends when leadership ends (lost, stepped down, Run's
	// context cancelled); the function must return promptly then, because
	// Run waits for it before campaigning again, and on a resign before it
	// releases the lease: the next leader's OnStartedLeading never begins
	// while this one's ctx is live. While Run waits for it, the lease is no
	// longer renewed (not by Config.KeepAlive either): a function that never
	// returns leaves the lease to expire. A function that returns before its ctx
	// ends does not end the term: the Elector keeps leading (and renewing)
	// until Run's context ends or the lease is lost. lease.Token() is the
	// term's fencing token: fence the leader's writes with it.
	OnStartedLeading func(ctx context.Context, lease *Lease)
	// OnStoppedLeading is called after OnStartedLeading returned, with why the
	// term ended (the lease's Err). Optional.
	OnStoppedLeading func(lease *Lease, err error)
}

// Elector campaigns for leadership of one lock name. Create it with
// [Locker.NewElector] and run [Elector.Run]. "Am I leader?" answers
// ([Elector.Lease], the callbacks) are advisory like every lease: the leader's
// writes must be fenced with its token.
type Elector struct {
	l       *Locker
	name    string
	cfg     ElectionConfig
	running atomic.Bool

	mu    sync.Mutex
	lease *Lease
}

// errRenewDeadline is the cause of a term that ended because renewals kept
// failing for RenewDeadline.
var errRenewDeadline = errors.New("renewals failed for longer than the renew deadline; stepped down")

// NewElector returns an Elector for lock name. It validates and does no I/O.
func (l *Locker) NewElector(name string, cfg *ElectionConfig) (*Elector, error) {
	const op = "pglock.NewElector"
	if err := validateName(op, name); err != nil {
		return nil, err
	}
	var c ElectionConfig
	if cfg != nil {
		c = *cfg
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = defaultLeaseDuration
	}
	if err := validateTTL(op, c.LeaseDuration); err != nil {
		return nil, err
	}
	// Scaled (the defaults' 15s : 10s : 2s), so that setting LeaseDuration
	// alone, or with RenewDeadline, gives a valid configuration.
	if c.RenewDeadline == 0 {
		c.RenewDeadline = c.LeaseDuration * 2 / 3
	}
	if c.RetryPeriod == 0 {
		c.RetryPeriod = max(minRetryPeriod, c.RenewDeadline/5)
	}
	if !(c.RetryPeriod >= minRetryPeriod && c.RetryPeriod < c.RenewDeadline && c.RenewDeadline < c.LeaseDuration) {
		return nil, invalid(op, "ElectionConfig", "need %v <= RetryPeriod (%v) < RenewDeadline (%v) < LeaseDuration (%v)",
			minRetryPeriod, c.RetryPeriod, c.RenewDeadline, c.LeaseDuration)
	}
	return &Elector{l: l, name: name, cfg: c}, nil
}

// Name returns the election's lock name.
func (e *Elector) Name() string { return e.name }

// Lease returns the current term's lease while this candidate leads, else
// nil. Advisory: leadership can end right after the call.
func (e *Elector) Lease() *Lease {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lease != nil && e.lease.Err() == nil && time.Now().Before(e.lease.Deadline()) {
		return e.lease
	}
	return nil
}

// Run campaigns until ctx ends: it waits for the lock, leads (renewing every
// RetryPeriod) until the term ends, then campaigns again. When ctx is
// cancelled while leading, it resigns (releases the lease, waking the other
// candidates at once) and returns ctx's error after OnStoppedLeading. Database
// errors while campaigning are logged and retried every RetryPeriod. Run
// returns a [*pgfence.Error] matching [pgfence.ErrClosed] when the Locker is
// closed, and one matching [pgfence.ErrInvalid] if it is already running.
func (e *Elector) Run(ctx context.Context) error {
	const op = "pglock.Run"
	if !e.running.CompareAndSwap(false, true) {
		return invalid(op, "Elector", "Run is already running")
	}
	defer e.running.Store(false)
	for {
		lease, err := e.l.acquire(ctx, op, e.name, e.cfg.LeaseDuration, waitOpts{
			cap:      e.cfg.RetryPeriod,
			retryErr: e.cfg.RetryPeriod,
			onErr: func(err error) {
				e.l.log.Warn("pglock: election campaign attempt failed", "name", e.name, "err", err)
			},
			finish: true, // a grant is never lost to ctx: it is given back below
		})
		if lease != nil && ctx.Err() != nil {
			// Granted while ctx ended: resign before leading.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resignTimeout)
			if err := lease.Release(rctx); err != nil {
				e.l.log.Warn("pglock: release of a lease granted as the campaign was cancelled", "name", e.name, "token", lease.Token(), "err", err)
			}
			cancel()
			return ctx.Err()
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		e.lead(ctx, lease)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if e.l.isClosed() {
			return closedError(op, e.name)
		}
	}
}

// resignTimeout bounds the release of a lease when Run's ctx ends.
const resignTimeout = 5 * time.Second

// lead runs one term.
func (e *Elector) lead(ctx context.Context, lease *Lease) {
	e.mu.Lock()
	e.lease = lease
	e.mu.Unlock()
	e.l.log.Info("pglock: started leading", "name", e.name, "token", lease.Token())
	e.l.m.Add(ctx, metricdefs.LeaderChangesTotal, 1, e.name, "started")

	// The term's context ends with the lease's, and on a resign before the
	// lease is released: the callback has returned by the time the release
	// hands the lease to the next candidate.
	term, endTerm := context.WithCancelCause(lease.Context())
	defer endTerm(nil)
	cbDone := make(chan struct{})
	go func() {
		defer close(cbDone)
		if e.cfg.OnStartedLeading != nil {
			e.cfg.OnStartedLeading(term, lease)
		}
	}()

	t := time.NewTicker(e.cfg.RetryPeriod)
	defer t.Stop()
	// The leader steps down RenewDeadline after the send time of its last
	// successful renewal (or grant), whenever that falls between two ticks.
	stepDownAt := func() time.Time { return lease.Deadline().Add(e.cfg.RenewDeadline - e.cfg.LeaseDuration) }
	step := time.NewTimer(time.Until(stepDownAt()))
	defer step.Stop()
loop:
	for {
		select {
		case <-ctx.Done():
			endTerm(context.Cause(ctx)) // why Run stops; the release may still fail
			// The keep-alive (Config.KeepAlive) leaves the lease alone from
			// here, as this loop does: an OnStartedLeading that never
			// returns must not keep the leadership for as long as the
			// process lives; the lease then expires at its TTL.
			lease.mu.Lock()
			lease.releasing = true
			lease.mu.Unlock()
			<-cbDone
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resignTimeout)
			if err := lease.Release(rctx); err != nil {
				e.l.log.Warn("pglock: resign failed; the lease expires at its TTL", "name", e.name, "err", err)
				lease.end(lease.lost("pglock.Run", err))
			}
			cancel()
			break loop
		case <-lease.Done():
			break loop
		case <-step.C:
			if d := stepDownAt(); time.Now().Before(d) {
				step.Reset(time.Until(d)) // renewed since the timer was set
				continue
			}
			lease.end(lease.lost("pglock.Run", errRenewDeadline))
			break loop
		case <-t.C:
			stepDown := stepDownAt()
			rctx, cancel := context.WithDeadline(ctx, stepDown)
			err := lease.Renew(rctx)
			cancel()
			if err == nil {
				step.Reset(time.Until(stepDownAt()))
			}
			if err == nil || lease.Err() != nil || ctx.Err() != nil {
				continue
			}
			if !time.Now().Before(stepDown) {
				lease.end(lease.lost("pglock.Run", errRenewDeadline))
				break loop
			}
			e.l.log.Warn("pglock: leader renewal failed; retrying", "name", e.name, "err", err)
		}
	}
	<-cbDone
	e.mu.Lock()
	e.lease = nil
	e.mu.Unlock()
	err := lease.Err()
	e.l.log.Info("pglock: stopped leading", "name", e.name, "token", lease.Token(), "err", err)
	e.l.m.Add(ctx, metricdefs.LeaderChangesTotal, 1, e.name, "stopped")
	if e.cfg.OnStoppedLeading != nil {
		e.cfg.OnStoppedLeading(lease, err)
	}
}

// Leader returns the current holder and token of election (or any lock)
// name, read from db on the database clock, or a [*pgfence.Error] matching
// [pgfence.ErrNotFound] (with the latest token, 0 if never granted, also in
// its Token) when nobody holds it. The answer is advisory.
func Leader(ctx context.Context, db pgfence.DBTX, name string) (holder string, token int64, err error) {
	const op = "pglock.Leader"
	info, err := inspectAs(ctx, op, db, name)
	if err != nil {
		return "", 0, err
	}
	if !info.Held {
		return "", info.Token, &pgfence.Error{Op: op, Kind: pgfence.ErrNotFound, Name: name, Token: info.Token, Reason: "nobody leads: the lock is not held"}
	}
	return info.Holder, info.Token, nil
}
