package pglock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
)

type term struct {
	cand  int
	token int64
	at    time.Time
}

// Three candidates: exactly one leads at a time; partitioning the leader
// (its connections killed, reconnects refused) hands leadership to another
// within LeaseDuration + RetryPeriod, with a higher token; cancelling Run
// resigns.
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
	second := waitTerm(t, started)
	handover := second.at.Sub(killed)
	if second.cand == first.cand {
		t.Fatalf("the partitioned candidate led again")
	}
	if second.token <= first.token {
		t.Errorf("new leader token %d not above %d", second.token, first.token)
	}
	if limit := cfg.LeaseDuration + cfg.RetryPeriod + 300*time.Millisecond; handover > limit {
		t.Errorf("handover took %v, want within %v", handover, limit)
	}
	t.Logf("handover after the leader's connections were killed: %v (lease %v, retry %v)", handover, cfg.LeaseDuration, cfg.RetryPeriod)
	select {
	case err := <-stopped:
		if !errors.Is(err, ErrLeaseLost) {
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
	if _, tok, err := Leader(context.Background(), admin, "leader"); !errors.Is(err, ErrNoLeader) || tok < second.token {
		t.Errorf("after every Run returned: Leader = %d, %v; want ErrNoLeader (resigned)", tok, err)
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
