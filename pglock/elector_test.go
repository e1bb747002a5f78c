package pglock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

type term struct {
	cand  int
	token int64
	at    time.Time
}

// Three candidates: exactly one leads at a time; partitioning the leader
// (its connections killed, reconnects refused) hands leadership to another,
// with a higher token, never before the old term's expiry and soon after it;
// cancelling Run resigns.
func TestElectionHandover(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	admin := pgtest.PoolFor(t, dsn)
	cfg := ElectionConfig{LeaseDuration: time.Second, RenewDeadline: 600 * time.Millisecond, RetryPeriod: 150 * time.Millisecond}

	var (
		leading  atomic.Int32
		overlaps atomic.Int32
		started  = make(chan term, 16)
		stopped  = make(chan error, 16)
		pools    []*gatedPool
		electors []*Elector
	)
	for i := range 3 {
		g := newGatedPool(t, dsn)
		pools = append(pools, g)
		l := newLocker(t, g.Pool, &Config{Holder: fmt.Sprintf("cand-%d", i)})
		c := cfg
		c.OnStartedLeading = func(ctx context.Context, s *Lease) {
			if leading.Add(1) != 1 {
				overlaps.Add(1)
			}
			started <- term{i, s.Token(), time.Now()}
			<-ctx.Done()
			leading.Add(-1)
		}
		c.OnStoppedLeading = func(s *Lease, err error) { stopped <- err }
		e, err := l.NewElector("leader", &c)
		if err != nil {
			t.Fatal(err)
		}
		electors = append(electors, e)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	runErrs := make([]error, 3)
	for i, e := range electors {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runErrs[i] = e.Run(ctx)
		}()
	}
	defer func() {
		cancel()
		wg.Wait()
	}()

	first := waitTerm(t, started)
	holder, token, err := Leader(ctx, admin, "leader")
	if err != nil || holder != fmt.Sprintf("cand-%d", first.cand) || token != first.token {
		t.Fatalf("Leader = %q %d %v; want cand-%d %d", holder, token, err, first.cand, first.token)
	}
	if s := electors[first.cand].Lease(); s == nil || s.Token() != first.token {
		t.Errorf("leader's Elector.Lease() = %v", s)
	}
	time.Sleep(3 * cfg.RetryPeriod) // a few renewals; nobody else may lead
	select {
	case tm := <-started:
		t.Fatalf("candidate %d started leading while %d leads", tm.cand, first.cand)
	default:
	}

	killed := time.Now()
	pools[first.cand].partition(t, admin)
	// Once the partitioned leader's backends are gone none of its renewals
	// can land any more: the row's expiry is final, and the takeover is
	// timed from it (not from the kill, which is up to a RetryPeriod and a
	// round trip earlier, so a bound from the kill leaves less room for a
	// loaded machine's scheduling delays).
	gone := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", pools[first.cand].app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(gone) {
			t.Fatalf("%d backends of the partitioned leader still running 10s after they were terminated", n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	settled := time.Now()
	old := inspect(t, admin, "leader")
	second := waitTerm(t, started)
	handover := second.at.Sub(killed)
	if second.cand == first.cand {
		t.Fatalf("the partitioned candidate led again")
	}
	if second.token <= first.token {
		t.Errorf("new leader token %d not above %d", second.token, first.token)
	}
	var grantedAt time.Time
	if err := admin.QueryRow(ctx, "SELECT acquired_at FROM pgfence.locks WHERE name = 'leader'").Scan(&grantedAt); err != nil {
		t.Fatal(err)
	}
	// Liveness: the takeover comes within takeoverLimit of the old term's
	// expiry. A candidate wakes at the expiry it read (or after at most
	// RetryPeriod), so this is typically tens of milliseconds; the limit
	// leaves a loaded machine ample room yet stays well short of a takeover
	// that waits one more LeaseDuration (or the one-minute longest sleep).
	const takeoverLimit = 600 * time.Millisecond
	if old.Token == first.token && old.Holder == fmt.Sprintf("cand-%d", first.cand) {
		if grantedAt.Before(old.ExpiresAt) {
			t.Errorf("new leader granted %v before the old term's expiry", old.ExpiresAt.Sub(grantedAt))
		}
		if late := second.at.Sub(old.ExpiresAt); late > takeoverLimit {
			t.Errorf("takeover %v after the old term's expiry, want within %v", late, takeoverLimit)
		}
		t.Logf("handover: %v after the leader's connections were killed, %v after its term expired (granted %v after; lease %v, retry %v)",
			handover, second.at.Sub(old.ExpiresAt), grantedAt.Sub(old.ExpiresAt), cfg.LeaseDuration, cfg.RetryPeriod)
	} else {
		// Taken over before the expiry could be read (the backends took
		// that long to exit): the old term expired by settled + LeaseDuration
		// at the latest.
		if limit := cfg.LeaseDuration + takeoverLimit; second.at.Sub(settled) > limit {
			t.Errorf("takeover %v after the partitioned leader's backends were gone, want within %v", second.at.Sub(settled), limit)
		}
		t.Logf("handover: %v after the leader's connections were killed (row already taken over when read: %+v)", handover, old)
	}
	select {
	case err := <-stopped:
		if !errors.Is(err, pgfence.ErrLost) {
			t.Errorf("old leader stopped with %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("old leader never stopped leading")
	}
	pools[first.cand].heal()
	time.Sleep(3 * cfg.RetryPeriod) // the healed candidate campaigns but must not lead
	if overlaps.Load() != 0 {
		t.Fatalf("%d times two candidates led at once", overlaps.Load())
	}

	cancel()
	wg.Wait()
	for i, err := range runErrs {
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Run %d = %v", i, err)
		}
	}
	if _, tok, err := Leader(context.Background(), admin, "leader"); !errors.Is(err, pgfence.ErrNotFound) || tok < second.token {
		t.Errorf("after every Run returned: Leader = %d, %v; want pgfence.ErrNotFound (resigned)", tok, err)
	}
	if overlaps.Load() != 0 {
		t.Fatalf("%d times two candidates led at once", overlaps.Load())
	}
}

func waitTerm(t *testing.T, ch <-chan term) term {
	t.Helper()
	select {
	case tm := <-ch:
		return tm
	case <-time.After(10 * time.Second):
		t.Fatal("no leader elected")
		return term{}
	}
}

// Resigning wakes the other candidates at once through LISTEN, without
// waiting for the lease to expire.
func TestElectionResignWakesCandidate(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	cfg := &ElectionConfig{LeaseDuration: 10 * time.Second, RenewDeadline: 5 * time.Second, RetryPeriod: 4 * time.Second}
	started := make(chan int64, 4)
	mk := func(h string) *Elector {
		l := newLocker(t, pool, &Config{Holder: h})
		c := *cfg
		c.OnStartedLeading = func(ctx context.Context, s *Lease) { started <- s.Token(); <-ctx.Done() }
		e, err := l.NewElector("resign", &c)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	e1, e2 := mk("one"), mk("two")
	ctx1, cancel1 := context.WithCancel(context.Background())
	ctx2, cancel2 := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	go func() { _ = e1.Run(ctx1); done <- struct{}{} }()
	tok1 := <-started
	go func() { _ = e2.Run(ctx2); done <- struct{}{} }()
	time.Sleep(100 * time.Millisecond) // e2 is campaigning
	t0 := time.Now()
	cancel1()
	<-done
	select {
	case tok2 := <-started:
		if tok2 <= tok1 {
			t.Errorf("token %d after %d", tok2, tok1)
		}
		if d := time.Since(t0); d > 2*time.Second {
			t.Errorf("takeover after resign took %v", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("second candidate did not take over after resign")
	}
	cancel2()
	<-done
}

// A candidate whose Run is cancelled while another Locker with the same
// Holder and Key (as processes sharing a key for Adopt are configured)
// leads leaves the leader's lease alone. Before, Run's end released any
// lease of the name held under its holder string that its own Locker had
// no Lease for, guessing it was a grant whose answer the cancellation had
// lost: it released the leader's lease, and the next candidate was granted
// the name while the leader still led.
func TestElectionCancelledCandidateLeavesLeader(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	pool := pgtest.Pool(t)
	key := []byte("0123456789abcdef-shared")
	cfg := &ElectionConfig{LeaseDuration: 30 * time.Second, RenewDeadline: 20 * time.Second, RetryPeriod: 10 * time.Second}
	l1 := newLocker(t, pool, &Config{Holder: "svc", Key: key})
	l2 := newLocker(t, pool, &Config{Holder: "svc", Key: key})
	started := make(chan int64, 1)
	c1 := *cfg
	c1.OnStartedLeading = func(ctx context.Context, s *Lease) { started <- s.Token(); <-ctx.Done() }
	e1, err := l1.NewElector("shared-holder", &c1)
	if err != nil {
		t.Fatal(err)
	}
	e2, err := l2.NewElector("shared-holder", cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx1, cancel1 := context.WithCancel(ctx)
	done1 := make(chan error, 1)
	go func() { done1 <- e1.Run(ctx1) }()
	defer func() { cancel1(); <-done1 }()
	var tok int64
	select {
	case tok = <-started:
	case <-ctx.Done():
		t.Fatal("e1 never led")
	}
	ctx2, cancel2 := context.WithCancel(ctx)
	done2 := make(chan error, 1)
	go func() { done2 <- e2.Run(ctx2) }()
	// e2 finds the name held (its first attempt's answer) before it is
	// cancelled: wait for its wait to be queued in the database.
	waitQueued(t, pool, "shared-holder")
	cancel2()
	if err := <-done2; !errors.Is(err, context.Canceled) {
		t.Fatalf("e2.Run: %v, want context.Canceled", err)
	}
	info, err := Inspect(ctx, pool, "shared-holder")
	if err != nil {
		t.Fatal(err)
	}
	if !info.Held || info.Token != tok {
		t.Fatalf("after the candidate's Run ended: %+v, want held by the leader with token %d", info, tok)
	}
	if e1.Lease() == nil {
		t.Fatal("the leader lost its lease")
	}
}

// waitQueued returns once a wait for name is queued in pgfence.lock_queue
// (another Locker's: there is no signal for it, it is looked up).
func waitQueued(t testing.TB, db *pgxpool.Pool, name string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM pgfence.lock_queue WHERE name = $1`, name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no wait for %q queued after 30s", name)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// When Run's context ends, the term ends, and the lease is no longer kept
// alive while Run waits for OnStartedLeading to return: with
// Config.KeepAlive, a callback that never returned kept the leadership for
// as long as the process lived (without it, the lease already expired).
func TestElectorStuckCallbackLeaseExpires(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{Holder: "stuck", KeepAlive: true})
	leases := make(chan *Lease, 1)
	unblock := make(chan struct{})
	e, err := l.NewElector("stuck-leader", &ElectionConfig{
		LeaseDuration: 2 * time.Second,
		OnStartedLeading: func(ctx context.Context, s *Lease) {
			leases <- s
			<-unblock // ignores ctx
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- e.Run(ctx) }()
	defer func() {
		cancel()
		close(unblock)
		if err := <-runErr; !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v", err)
		}
	}()
	var lease *Lease
	select {
	case lease = <-leases:
	case <-time.After(30 * time.Second):
		t.Fatal("never led")
	}
	cancel() // Run stops; the callback does not return
	select {
	case <-lease.Done():
	case <-time.After(20 * time.Second):
		t.Fatalf("the lease is still live 20 s after Run's context ended (TTL %v): the keep-alive renews it while the callback hangs", 2*time.Second)
	}
	other := newLocker(t, pool, &Config{Holder: "next"}) // its Acquire waits for the expiry
	s, err := other.Acquire(testCtx(t, 10*time.Second), "stuck-leader", time.Minute)
	if err != nil {
		t.Fatalf("another holder cannot take the name of the stuck leader: %v", err)
	}
	_ = s.Release(context.Background())
}
