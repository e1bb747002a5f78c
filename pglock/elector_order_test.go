package pglock

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// slowHoldMetrics holds up the hold-time observation that Lease.end makes
// (once armed) until release closes: a slow metrics sink, a GC pause or a
// descheduled goroutine between a release's commit and whatever follows.
type slowHoldMetrics struct {
	armed   atomic.Bool
	release chan struct{}
}

func (m *slowHoldMetrics) Add(context.Context, string, float64, ...string) {}
func (m *slowHoldMetrics) Observe(_ context.Context, name string, _ float64, _ ...string) {
	if name == metricdefs.LeaseHoldSeconds && m.armed.CompareAndSwap(true, false) {
		select {
		case <-m.release:
		case <-time.After(3 * time.Second):
		}
	}
}

// TestElectorResignEndsTermBeforeRelease: on a resign (Run's context
// cancelled) the old leader's OnStartedLeading context ends, and the
// callback returns, before the lease is released. The release came first
// and the callback's context was cancelled by the lease's end after it, so
// the next candidate, handed the lease by that release, began leading
// while the old callback still ran with a live context (in 5 to 8 of 20
// plain resigns; always here, where the lease's end is held up).
func TestElectorResignEndsTermBeforeRelease(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	cfg := ElectionConfig{LeaseDuration: 10 * time.Second, RenewDeadline: 5 * time.Second, RetryPeriod: 2 * time.Second}
	m := &slowHoldMetrics{release: make(chan struct{})}

	var oldLive atomic.Bool
	oldStarted := make(chan struct{})
	la := newLocker(t, pool, &Config{Holder: "old", Metrics: m})
	ca := cfg
	ca.OnStartedLeading = func(ctx context.Context, _ *Lease) {
		oldLive.Store(true)
		close(oldStarted)
		<-ctx.Done()
		oldLive.Store(false)
	}
	ea, err := la.NewElector("resign-order", &ca)
	if err != nil {
		t.Fatal(err)
	}
	overlap := make(chan bool, 1)
	lb := newLocker(t, pool, &Config{Holder: "new"})
	cb := cfg
	cb.OnStartedLeading = func(ctx context.Context, _ *Lease) {
		overlap <- oldLive.Load()
		close(m.release)
		<-ctx.Done()
	}
	eb, err := lb.NewElector("resign-order", &cb)
	if err != nil {
		t.Fatal(err)
	}
	ctxA, cancelA := context.WithCancel(context.Background())
	ctxB, cancelB := context.WithCancel(context.Background())
	doneA, doneB := make(chan error, 1), make(chan error, 1)
	go func() { doneA <- ea.Run(ctxA) }()
	<-oldStarted
	go func() { doneB <- eb.Run(ctxB) }()
	waitQueued(t, pool, "resign-order")
	m.armed.Store(true)
	cancelA()
	select {
	case o := <-overlap:
		if o {
			t.Error("the new leader's OnStartedLeading began while the old leader's still ran with a live context")
		}
	case <-time.After(30 * time.Second):
		t.Error("the queued candidate never led after the resign")
	}
	<-doneA
	cancelB()
	<-doneB
}

// TestElectorStepsDownAtRenewDeadline: a leader whose renewals fail steps
// down RenewDeadline after its last successful renewal was sent, even
// between two RetryPeriod ticks. It looked at the step-down time on a tick
// only: with ticks at 2.1 s and 4.2 s and a 3.9 s lease, it led until its
// lease's local deadline, the moment the database may let another
// candidate in, and ended as a lost lease instead of stepping down.
func TestElectorStepsDownAtRenewDeadline(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	g := newGatedPool(t, dsn)
	l := newLocker(t, g.Pool, &Config{Holder: "solo"})
	c := ElectionConfig{LeaseDuration: 3900 * time.Millisecond, RenewDeadline: 3 * time.Second, RetryPeriod: 2100 * time.Millisecond}
	begun := make(chan *Lease, 1)
	ended := make(chan error, 1)
	c.OnStartedLeading = func(ctx context.Context, s *Lease) {
		begun <- s
		<-ctx.Done()
		ended <- context.Cause(ctx)
	}
	e, err := l.NewElector("stepdown", &c)
	if err != nil {
		t.Fatal(err)
	}
	var db string
	if err := admin.QueryRow(context.Background(), "SELECT current_database()").Scan(&db); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-begun
	// Every renewal from now on fails at once: new sessions are read-only
	// and the Locker's sessions are ended.
	if _, err := admin.Exec(context.Background(), `ALTER DATABASE "`+db+`" SET default_transaction_read_only = on`); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_, _ = admin.Exec(context.Background(), `ALTER DATABASE "`+db+`" RESET default_transaction_read_only`)
	}()
	if _, err := admin.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, g.app); err != nil {
		t.Fatal(err)
	}
	select {
	case cause := <-ended:
		if !errors.Is(cause, errRenewDeadline) || !errors.Is(cause, pgfence.ErrLost) {
			t.Errorf("the term ended with %v; want the RenewDeadline step-down (not the lease's local deadline)", cause)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the leader never stepped down")
	}
}

// TestElectionConfigScaledDefaults: setting LeaseDuration alone gives
// RenewDeadline and RetryPeriod scaled from it (it was refused below the
// fixed 10 s default RenewDeadline, naming values the caller never set),
// an unset RetryPeriod stays below an explicit RenewDeadline, and a
// RetryPeriod under 10 ms, which renews in a tight loop, is refused.
func TestElectionConfigScaledDefaults(t *testing.T) {
	t.Parallel()
	l := newLocker(t, pgtest.Pool(t), nil)
	e, err := l.NewElector("scaled", &ElectionConfig{LeaseDuration: 3 * time.Second})
	if err != nil {
		t.Fatalf("NewElector(LeaseDuration 3s only) = %v", err)
	}
	if e.cfg.RenewDeadline != 2*time.Second || e.cfg.RetryPeriod != 400*time.Millisecond {
		t.Errorf("LeaseDuration 3s: RenewDeadline %v, RetryPeriod %v; want 2s, 400ms", e.cfg.RenewDeadline, e.cfg.RetryPeriod)
	}
	// An explicit RenewDeadline keeps the RetryPeriod below it (a
	// RetryPeriod scaled from LeaseDuration alone did not: 8s against 5s).
	for _, c := range []ElectionConfig{
		{LeaseDuration: 60 * time.Second, RenewDeadline: 5 * time.Second},
		{LeaseDuration: 30 * time.Second, RenewDeadline: 3 * time.Second},
		{LeaseDuration: 40 * time.Millisecond},
	} {
		if e, err := l.NewElector("explicit", &c); err != nil || e.cfg.RetryPeriod >= e.cfg.RenewDeadline {
			t.Errorf("NewElector(%v, %v, RetryPeriod unset) = %v", c.LeaseDuration, c.RenewDeadline, err)
		}
	}
	if e, err := l.NewElector("default", nil); err != nil || e.cfg.LeaseDuration != 15*time.Second || e.cfg.RenewDeadline != 10*time.Second || e.cfg.RetryPeriod != 2*time.Second {
		t.Errorf("defaults: %+v, %v; want 15s, 10s, 2s", e.cfg, err)
	}
	for _, rp := range []time.Duration{time.Nanosecond, 9 * time.Millisecond} {
		if _, err := l.NewElector("tight", &ElectionConfig{LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: rp}); !errors.Is(err, pgfence.ErrInvalid) {
			t.Errorf("RetryPeriod %v: %v; want ErrInvalid", rp, err)
		}
	}
}
