package pglock

import (
	"context"
	"crypto/rand"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/holder"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/observe"
)

// Locker grants leases on pgfence.locks through a pool. It is safe for
// concurrent use. All its leases share one holder identity, so two
// acquisitions of one name through the same Locker exclude each other like
// any two holders do.
type Locker struct {
	pool   *pgxpool.Pool
	q      *dbsqlc.Queries
	holder string
	key    []byte // the lease key (Config.Key), never changed
	log    *slog.Logger
	m      metrics
	cfg    Config

	mu     sync.Mutex
	closed bool
	leases map[*Lease]struct{}
	lis    *listener
	// claims are the grants (name, token) an Adopt is turning into a
	// Lease or a give-back is releasing, under mu: one excludes the other
	// (see claim).
	claims map[grantID]*grantClaim

	closedCh chan struct{}
	// abortCtx ends once Close has waited closeWait for the calls in
	// flight: it ends the waiting statements of callers that gave up
	// (queueGrant) and the grant batches whose callers all gave up
	// (coalescer.loop), so that they do not hold a pooled connection past
	// it.
	abortCtx context.Context
	abort    context.CancelFunc
	wg       sync.WaitGroup // the keep-alive goroutine
	calls    callTracker    // work that may use the pool after Close is called (calls.go)
	keeper   *keeper        // renews the leases of a Locker with KeepAlive

	grants   *coalescer[grantReq, grantRes]         // non-waiting grants (see coalesce.go)
	releases *coalescer[releaseReq, fastReleaseRow] // releases
	inCalls  atomic.Int64                           // calls in either coalescer's do

	hotMu sync.Mutex
	hot   map[string]struct{} // names whose last Acquire waited (see isHot)
	nHot  atomic.Int64        // len(hot), read without hotMu
	slots map[string][]int64  // per name, queue keys whose wait is over (see takeSlot); under hotMu

	hkMu    sync.Mutex
	hk      []byte    // the handoff key (see handoff.go); nil until read; under hkMu
	hkRetry time.Time // after a failed read of hk: not before then; under hkMu

	// waitHook, when set (tests), is called each time a waiter starts waiting.
	waitHook func(name string)
	// detachedHook, when set (tests), is called once a detached wait has
	// left the queue (finishDetached).
	detachedHook func(name string)
	// claimHook, when set (tests), is called once Adopt or a give-back has
	// claimed a grant, before its statement.
	claimHook func(kind claimKind, name string, token int64)
	// handedReads counts HandedLock reads (tests).
	handedReads atomic.Int64
}

// New returns a Locker on pool. It validates cfg and does no I/O; a nil cfg
// means defaults. The schema must have been migrated (package migrations).
// The pool is not owned: close the Locker before the pool.
func New(pool *pgxpool.Pool, cfg *Config) (*Locker, error) {
	const op = "pglock.New"
	if pool == nil {
		return nil, invalid(op, "pool", "nil pool")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Holder == "" {
		c.Holder = holder.Default()
	}
	if err := validateHolder(op, c.Holder); err != nil {
		return nil, err
	}
	if c.Key == nil {
		c.Key = make([]byte, keyBytes)
		_, _ = rand.Read(c.Key) // never fails (crypto/rand)
	} else {
		if len(c.Key) < minKeyBytes || len(c.Key) > maxKeyBytes {
			return nil, invalid(op, "Config.Key", "%d bytes, want %d to %d", len(c.Key), minKeyBytes, maxKeyBytes)
		}
		c.Key = slices.Clone(c.Key)
	}
	if c.KeepAliveFraction == 0 {
		c.KeepAliveFraction = 1.0 / 3
	}
	if !(c.KeepAliveFraction > 0 && c.KeepAliveFraction <= 0.8) {
		return nil, invalid(op, "Config.KeepAliveFraction", "%v outside (0, 0.8]", c.KeepAliveFraction)
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.PollInterval < 10*time.Millisecond {
		return nil, invalid(op, "Config.PollInterval", "%v shorter than 10ms", c.PollInterval)
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
		key:      c.Key,
		log:      log,
		m:        metrics{c.Metrics},
		cfg:      c,
		leases:   make(map[*Lease]struct{}),
		closedCh: make(chan struct{}),
	}
	l.abortCtx, l.abort = context.WithCancel(context.Background())
	l.keeper = newKeeper(l)
	l.grants = newGrantCoalescer(l)
	l.releases = newReleaseCoalescer(l)
	if !c.PollOnly {
		l.lis = newListener(l)
	}
	if c.Metrics != nil {
		metricdefs.InitLeases(context.Background(), c.Metrics)
	}
	return l, nil
}

// metrics is Config.Metrics (nil: nothing recorded) with label slices that
// stay on the caller's stack: a variadic argument passed straight to an
// interface method escapes, so every call would allocate one even when
// nothing is recorded.
type metrics struct{ m observe.Metrics }

func (m metrics) Add(ctx context.Context, name string, delta float64, labels ...string) {
	if m.m != nil {
		m.m.Add(ctx, name, delta, slices.Clone(labels)...)
	}
}

func (m metrics) Observe(ctx context.Context, name string, value float64, labels ...string) {
	if m.m != nil {
		m.m.Observe(ctx, name, value, slices.Clone(labels)...)
	}
}

// Holder returns the identity stored in the rows of this Locker's leases.
func (l *Locker) Holder() string { return l.holder }

// Listen opens the LISTEN connection that wakes this Locker's waiters now,
// instead of at the first Acquire that has to wait, and returns once it is
// listening. The connection is the one the open Lockers of the pool share, so
// one Listen serves them all. Waiting does not need it: without it, the first
// waits of a process start the connection, and a lease handed to a waiter
// before it is listening is noticed only when it is (every waiter is then
// woken to look), which on a busy server can be a noticeable stall. Call it
// at start-up, before taking traffic, where that matters; it also makes a
// readiness check for the LISTEN path. If a connection attempt fails first
// (server down, wrong database or password) the error is a [*pgfence.Error]
// whose cause is that attempt's error; if ctx ends first, a [*pgfence.Error]
// matching ctx's error (and the latest failed attempt's, if any). Either way
// the connection keeps trying in the background and Listen may be called
// again. A closed Locker returns a [*pgfence.Error] matching
// [pgfence.ErrClosed]; with Config.PollOnly there is no connection and Listen
// returns nil at once.
func (l *Locker) Listen(ctx context.Context) error {
	if l.isClosed() {
		return closedError("pglock.Listen", "")
	}
	if l.lis == nil {
		return nil
	}
	return l.lis.listen(ctx, l.closedCh)
}

// Close stops the listener and every keep-alive, and ends the Context of each
// live lease with a cause matching [pgfence.ErrClosed]. It does not release
// live leases in the database: release them first, or they stay held until
// their TTL passes. Waiting Acquire calls (also those whose queueing
// statement is out, whatever their context), and TryAcquire calls queued
// behind another grant statement of the Locker (a call that found no grant
// statement out but other calls of the Locker in progress queues with the
// calls that arrive as it yields: see the package documentation), return an
// error matching [pgfence.ErrClosed] at once; a grant whose statement answers after Close,
// or a lease a release hands to a waiter at that moment, is given back, and
// the call that asked for it returns that error too. Close waits for those
// calls and statements, for the queueing statements of waits that gave up
// earlier, and for the batched grant statements whose callers all gave up
// (see the package documentation), at most 5 seconds (a server that does
// not answer); then it ends the queueing and batched grant statements
// still out, so that the pool can be closed right after it. Their outcome
// is then unknown: a grant one of them makes anyway, or a lease a release
// hands to its wait, stays held by nobody until its TTL (Close logs a
// warning). A lone grant statement (a TryAcquire's, or an Acquire's first
// attempt, sent at once on its caller's context because no other call
// queued as it yielded) ends with that context only. Do not call Close from the Locker's Logger, Metrics or a hook of
// its pool: they can run inside such a call, and Close would then wait the
// 5 seconds. Close is safe to call more than once.
func (l *Locker) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	l.calls.refuse() // before any lease ends: no call starts from here on
	close(l.closedCh)
	leases := make([]*Lease, 0, len(l.leases))
	for s := range l.leases {
		leases = append(leases, s)
	}
	l.mu.Unlock()
	for _, s := range leases {
		s.end(closedError("pglock.Close", s.name))
	}
	if l.lis != nil {
		l.lis.stop()
	}
	if !l.calls.closeAndWait(closeWait) {
		l.log.Warn("pglock: Close did not wait longer for calls still talking to the database; " +
			"a lease granted or handed to one of them may stay held until its TTL")
	}
	l.abort()
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
