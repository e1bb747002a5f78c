package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// appAdmin is the application_name of the pools the tests observe and kill
// from; every killer spares it.
const appAdmin = "faults-admin"

// timerSlack is how late, at most, a lease's Done may be observed after its
// local deadline: the deadline timer fires on time, but on a loaded 2-core
// machine under the race detector the goroutine that observes it can be
// scheduled tens of milliseconds later. The believed-holder check of
// holdRegistry does not depend on it.
const timerSlack = 250 * time.Millisecond

// schedProbe measures how late this process's timers fire right now: a
// goroutine sleeps 10 ms at a time and records by how much each sleep
// overran. A liveness bound on when a goroutine observes an event is then
// timerSlack plus the worst overrun seen around the event, so it scales with
// the machine's load (CPU-bound neighbours, the race detector) without
// loosening on an idle machine.
type schedProbe struct {
	mu      sync.Mutex
	samples []probeSample
	stop    chan struct{}
	done    chan struct{}
}

type probeSample struct {
	at   time.Time
	late time.Duration
}

func startSchedProbe(t *testing.T) *schedProbe {
	p := &schedProbe{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		const tick = 10 * time.Millisecond
		for {
			t0 := time.Now()
			select {
			case <-p.stop:
				return
			case <-time.After(tick):
			}
			now := time.Now()
			p.mu.Lock()
			p.samples = append(p.samples, probeSample{now, now.Sub(t0) - tick})
			if len(p.samples) > 100000 {
				p.samples = p.samples[len(p.samples)/2:]
			}
			p.mu.Unlock()
		}
	}()
	t.Cleanup(func() { close(p.stop); <-p.done })
	return p
}

// slack is timerSlack plus the worst timer overrun measured since from.
func (p *schedProbe) slack(from time.Time) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	var worst time.Duration
	for i := len(p.samples) - 1; i >= 0 && !p.samples[i].at.Before(from); i-- {
		worst = max(worst, p.samples[i].late)
	}
	return timerSlack + worst
}

// appPool opens a pool of up to n connections on dsn whose sessions carry
// application_name app, so that a killer can find their backends in
// pg_stat_activity. It is closed when t ends.
func appPool(t *testing.T, dsn, app string, n int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return openPool(t, cfg, app, n)
}

func openPool(t *testing.T, cfg *pgxpool.Config, app string, n int32) *pgxpool.Pool {
	t.Helper()
	cfg.MaxConns = n
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// terminateApp ends every backend of the current database whose
// application_name is app and returns how many it ended.
func terminateApp(ctx context.Context, admin *pgxpool.Pool, app string) (int, error) {
	var n int
	err := admin.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
		FROM pg_stat_activity
		WHERE datname = current_database() AND application_name = $1 AND pid <> pg_backend_pid()`, app).Scan(&n)
	return n, err
}

// terminateOne ends one backend of the current database chosen at random
// among every client backend except the admin's, and reports whether there
// was one.
func terminateOne(ctx context.Context, admin *pgxpool.Pool) (bool, error) {
	var n int
	err := admin.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM (
			SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND backend_type = 'client backend'
			  AND application_name <> $1 AND pid <> pg_backend_pid()
			ORDER BY random() LIMIT 1) victim`, appAdmin).Scan(&n)
	return n > 0, err
}

// killer terminates backends at random intervals in [minGap, maxGap) until
// ctx ends, with kill, and counts the backends it ended.
func killer(ctx context.Context, minGap, maxGap time.Duration, kill func(context.Context) (int, error)) *atomic.Int64 {
	var n atomic.Int64
	go func() {
		for {
			t := time.NewTimer(minGap + rand.N(maxGap-minGap))
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			k, err := kill(ctx)
			if err == nil {
				n.Add(int64(k))
			}
		}
	}()
	return &n
}

// holdRegistry is the in-process view of who believes it holds which lock.
// A client registers right after a grant and unregisters before it releases
// (or when its lease ends). A client believes it holds a lock while its
// lease has not ended (Err is nil) and its local deadline has not passed.
// At every grant the registry checks the two invariants of a lease lock:
// nobody else still believes it holds that lock, and the new token is larger
// than every token a believing holder of that lock had before.
type holdRegistry struct {
	mu         sync.Mutex
	held       map[string]map[*pglock.Lease]struct{}
	maxToken   map[string]int64
	grants     int
	violations []string
}

func newHoldRegistry() *holdRegistry {
	return &holdRegistry{held: map[string]map[*pglock.Lease]struct{}{}, maxToken: map[string]int64{}}
}

func believes(l *pglock.Lease, now time.Time) bool {
	return l.Err() == nil && now.Before(l.Deadline())
}

// register checks the invariants for a fresh grant and records it. It
// returns false, recording nothing, when the lease already ended locally
// (the grant came back after its own local deadline): the client must not
// use it.
func (r *holdRegistry) register(l *pglock.Lease) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	if !believes(l, now) {
		return false
	}
	name := l.Name()
	for o := range r.held[name] {
		if believes(o, now) {
			r.violations = append(r.violations, fmt.Sprintf(
				"lock %q: token %d (holder %s) granted while token %d (holder %s) still believed it held it, %v before its local deadline",
				name, l.Token(), l.Holder(), o.Token(), o.Holder(), o.Deadline().Sub(now)))
		}
	}
	if l.Token() <= r.maxToken[name] {
		r.violations = append(r.violations, fmt.Sprintf("lock %q: token %d granted after token %d: tokens went backwards",
			name, l.Token(), r.maxToken[name]))
	}
	r.maxToken[name] = max(r.maxToken[name], l.Token())
	if r.held[name] == nil {
		r.held[name] = map[*pglock.Lease]struct{}{}
	}
	r.held[name][l] = struct{}{}
	r.grants++
	return true
}

func (r *holdRegistry) unregister(l *pglock.Lease) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.held[l.Name()], l)
}

// check fails t for every violation recorded.
func (r *holdRegistry) check(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, v := range r.violations {
		t.Error(v)
	}
}

// counters is an observe.Metrics that counts, by name and labels.
type counters struct {
	mu sync.Mutex
	m  map[string]float64
}

func (c *counters) Add(_ context.Context, name string, delta float64, labels ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]float64{}
	}
	c.m[name+"|"+strings.Join(labels, ",")] += delta
}

func (c *counters) Observe(context.Context, string, float64, ...string) {}

func (c *counters) get(name string, labels ...string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return int(c.m[name+"|"+strings.Join(labels, ",")])
}

// doneTime records when a lease's Done fires. The returned function gives
// that time, waiting for it to be recorded when Done is already closed (the
// recording goroutine may not have run yet: a zero time would make every
// "before" check on it pass), and the zero time while the lease is live.
func doneTime(l *pglock.Lease) func() time.Time {
	var at time.Time
	recorded := make(chan struct{})
	context.AfterFunc(l.Context(), func() {
		at = time.Now()
		close(recorded)
	})
	return func() time.Time {
		select {
		case <-l.Done():
			<-recorded
			return at
		default:
			return time.Time{}
		}
	}
}

// TestKilledRenewer ends the backends of a holder whose keep-alive renews a
// short lease. In each round an observer holds the lock row (FOR UPDATE) for
// a random 0..2 TTL, so the holder's renewals queue behind it, and during
// that stall a killer terminates the holder's backends (blocked renewals
// included) every 10-40 ms; a contender on its own pool tries to take the
// lock all along.
// Depending on the stall the lease survives (a renewal gets through after
// the stall) or is lost. Pass: whenever the contender gets a grant, the
// holder no longer believes it holds the lock (its local deadline already
// passed: registry check), the contender's token is larger, and the holder's
// Done fired no later than its local deadline (plus scheduling slack).
func TestKilledRenewer(t *testing.T) {
	t.Parallel()
	rounds := 6
	if long() {
		rounds = 30
	}
	const ttl = 400 * time.Millisecond
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 4)
	const appRenewer = "faults-renewer"
	holderPool := appPool(t, dsn, appRenewer, 2)
	contenderPool := appPool(t, dsn, "faults-contender", 2)
	holderMetrics := &counters{}
	holder, err := pglock.New(holderPool, &pglock.Config{Holder: "renewer", KeepAlive: true, PollOnly: true, Metrics: holderMetrics})
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	contender, err := pglock.New(contenderPool, &pglock.Config{Holder: "contender", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer contender.Close()
	reg := newHoldRegistry()
	rec := history.New()
	rec.BoundCutAcquires() // backends killed; no network delay
	hc, cc := rec.NewClient(), rec.NewClient()
	hc.KeepAlive = true

	var kills, lost, survived, lateGrants int64
	var maxLate time.Duration
	probe := startSchedProbe(t)
	for round := range rounds {
		name := fmt.Sprintf("renewer:%d", round)
		// pglock sends a grant again when the pool hands it a connection the
		// previous round's killer ended, but a kill racing the grant still
		// fails it with a transient database error. A grant can also come back too late to use on a loaded machine
		// (pglock reports ErrSlowGrant, or this goroutine was descheduled
		// past the deadline before registering): try again.
		var lease *pglock.Lease
		for attempt := 0; lease == nil; attempt++ {
			lease, err = hc.Acquire(ctx, holder, name, ttl, true)
			if err != nil && (attempt == 4 || !transientDB(err)) {
				t.Fatalf("round %d: %v", round, err)
			}
			if lease != nil && !reg.register(lease) {
				lateGrants++
				_ = hc.Release(ctx, lease)
				lease = nil
			}
		}
		doneAt := doneTime(lease)
		context.AfterFunc(lease.Context(), func() { reg.unregister(lease) })

		// The stall: the observer's transaction holds the lock row.
		stall := time.Duration(rand.Int64N(int64(2 * ttl)))
		tx, err := admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT 1 FROM pgfence.locks WHERE name = $1 FOR UPDATE", name); err != nil {
			t.Fatal(err)
		}
		kctx, stopKiller := context.WithCancel(ctx)
		killed := killer(kctx, 10*time.Millisecond, 40*time.Millisecond, func(ctx context.Context) (int, error) {
			return terminateApp(ctx, admin, appRenewer)
		})

		stallDone := make(chan error, 1)
		go func() {
			time.Sleep(stall)
			stopKiller() // after the stall, renewals may get through again
			stallDone <- tx.Commit(ctx)
		}()

		// The contender tries until it gets the lock or the round ends.
		roundEnd := time.Now().Add(stall + 3*ttl)
		var won *pglock.Lease
		var wonAt time.Time
		for won == nil && time.Now().Before(roundEnd) {
			actx, cancel := context.WithTimeout(ctx, 3*time.Second)
			c, err := cc.Acquire(actx, contender, name, ttl, false)
			cancel()
			switch {
			case err == nil:
				if !reg.register(c) { // descheduled past its deadline: not a win
					lateGrants++
					_ = cc.Release(ctx, c)
					continue
				}
				won, wonAt = c, time.Now()
			case errors.Is(err, pgfence.ErrLocked):
				time.Sleep(20 * time.Millisecond)
			case errors.Is(err, pgfence.ErrSlowGrant):
				// The grant waited behind the stall for longer than the TTL
				// and was given back: a correct refusal, not a win.
				lateGrants++
			default:
				t.Fatalf("round %d: contender: %v", round, err)
			}
		}
		if err := <-stallDone; err != nil {
			t.Fatal(err)
		}
		stopKiller()
		kills += killed.Load()

		if won != nil {
			lost++
			select {
			case <-lease.Done():
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: the contender holds token %d but the holder's lease (token %d) never ended", round, won.Token(), lease.Token())
			}
			if !errors.Is(lease.Err(), pgfence.ErrLost) {
				t.Errorf("round %d: holder's lease ended with %v, want ErrLeaseLost", round, lease.Err())
			}
			dl := lease.Deadline()
			if !dl.Before(wonAt) {
				t.Errorf("round %d: the holder's local deadline %v is not before the contender's grant", round, dl.Sub(wonAt))
			}
			late := doneAt().Sub(dl)
			maxLate = max(maxLate, late)
			if slack := probe.slack(dl.Add(-time.Second)); late > slack {
				t.Errorf("round %d: holder's Done fired %v after its local deadline (allowed %v: %v + the worst timer overrun measured meanwhile)",
					round, late, slack, timerSlack)
			}
			if won.Token() <= lease.Token() {
				t.Errorf("round %d: contender token %d not above holder token %d", round, won.Token(), lease.Token())
			}
			reg.unregister(won)
			// The contender's lease (TTL 400 ms) can expire while the checks
			// above wait for the holder's Done on a loaded machine: its
			// release is then refused as lost, which is right. Lost before
			// its local deadline would be a bug.
			if err := cc.Release(ctx, won); err != nil && (!errors.Is(err, pgfence.ErrLost) || time.Now().Before(won.Deadline())) {
				t.Fatalf("round %d: contender's release (local deadline %v ago): %v", round, time.Since(won.Deadline()), err)
			}
		} else {
			survived++
			if err := lease.Err(); err != nil {
				t.Errorf("round %d: the contender never got the lock, yet the holder's lease ended: %v", round, err)
			}
			reg.unregister(lease)
			for range 5 {
				if err = hc.Release(ctx, lease); err == nil || errors.Is(err, pgfence.ErrLost) {
					break
				}
			}
			if err != nil && !errors.Is(err, pgfence.ErrLost) {
				t.Fatalf("round %d: release: %v", round, err)
			}
		}
	}
	reg.check(t)
	rec.Verify(t)
	t.Logf("killed renewer: %d rounds, %d backends terminated, %d leases lost and taken over, %d survived through later renewals, %d grants too late to use, "+
		"renewals ok/error/refused %d/%d/%d, %d grants, 0 overlapping holders, max Done lateness after local deadline %v",
		rounds, kills, lost, survived, lateGrants, holderMetrics.get(metricdefs.LeaseRenewalsTotal, metricdefs.RenewOK),
		holderMetrics.get(metricdefs.LeaseRenewalsTotal, metricdefs.RenewError), holderMetrics.get(metricdefs.LeaseRenewalsTotal, metricdefs.RenewRefused),
		reg.grants, maxLate.Round(time.Millisecond))
	if kills == 0 {
		t.Error("no backend was terminated")
	}
}

// listenBackend returns the pid of the backend of application app that is
// sitting in LISTEN, or 0.
func listenBackend(ctx context.Context, admin *pgxpool.Pool, app string) (int32, error) {
	var pid int32
	err := admin.QueryRow(ctx, `
		SELECT COALESCE(max(pid), 0) FROM pg_stat_activity
		WHERE datname = current_database() AND application_name = $1 AND query LIKE 'LISTEN%'`, app).Scan(&pid)
	return pid, err
}

// waitFor polls cond every 5 ms until it is true or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	end := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("%s: not after %v", what, timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestKilledListener terminates a waiter's LISTEN backend while the waiter
// waits for a lock whose holder has a long lease (30 s), then releases the
// lock: in even rounds at once (the listener is still reconnecting), in odd
// rounds after the listener is back on a new backend. Pass: the waiter gets
// the lease well before the holder's expiry (so it was woken, not saved by
// its expiry timer), with the next token.
func TestKilledListener(t *testing.T) {
	t.Parallel()
	rounds := 4
	if long() {
		rounds = 20
	}
	const holdTTL = 30 * time.Second
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 2)
	const appWaiter = "faults-waiter"
	holder, err := pglock.New(appPool(t, dsn, "faults-listen-holder", 2), &pglock.Config{Holder: "holder", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	waiter, err := pglock.New(appPool(t, dsn, appWaiter, 2), &pglock.Config{Holder: "waiter"})
	if err != nil {
		t.Fatal(err)
	}
	defer waiter.Close()

	rec := history.New()
	rec.BoundCutAcquires() // backends killed; no network delay
	hc, wc := rec.NewClient(), rec.NewClient()
	var kills int
	var maxWake time.Duration
	for round := range rounds {
		name := fmt.Sprintf("listen:%d", round)
		h, err := hc.Acquire(ctx, holder, name, holdTTL, true)
		if err != nil {
			t.Fatal(err)
		}
		type result struct {
			lease *pglock.Lease
			err   error
			at    time.Time
		}
		got := make(chan result, 1)
		go func() {
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			l, err := wc.Acquire(wctx, waiter, name, 5*time.Second, true)
			got <- result{l, err, time.Now()}
		}()
		// Wait until the waiter sleeps (its LISTEN backend is up and it
		// marked the row), then terminate that backend. pg_terminate_backend
		// answers false for a backend that has already exited: the previous
		// round's, still listed while it ends. Then look again.
		var pid int32
		waitFor(t, 10*time.Second, "waiter listening and marked, its LISTEN backend terminated", func() (bool, error) {
			var err error
			if pid, err = listenBackend(ctx, admin, appWaiter); err != nil || pid == 0 {
				return false, err
			}
			var marked bool
			if err := admin.QueryRow(ctx, "SELECT waiting_since IS NOT NULL FROM pgfence.locks WHERE name = $1", name).Scan(&marked); err != nil || !marked {
				return false, err
			}
			var ok bool
			err = admin.QueryRow(ctx, "SELECT pg_terminate_backend($1)", pid).Scan(&ok)
			return ok, err
		})
		kills++
		if round%2 == 1 {
			waitFor(t, 10*time.Second, "LISTEN reconnected", func() (bool, error) {
				p, err := listenBackend(ctx, admin, appWaiter)
				return p != 0 && p != pid, err
			})
		}
		released := time.Now()
		if err := hc.Release(ctx, h); err != nil {
			t.Fatal(err)
		}
		var r result
		select {
		case r = <-got:
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: waiter never returned", round)
		}
		if r.err != nil {
			t.Fatalf("round %d: waiter: %v", round, r.err)
		}
		wake := r.at.Sub(released)
		maxWake = max(maxWake, wake)
		if wake > 5*time.Second {
			t.Errorf("round %d: waiter got the lease %v after the release", round, wake)
		}
		if r.lease.Token() != h.Token()+1 {
			t.Errorf("round %d: waiter token %d, holder token %d: want the next token", round, r.lease.Token(), h.Token())
		}
		if err := wc.Release(ctx, r.lease); err != nil {
			t.Fatal(err)
		}
	}
	rec.Verify(t)
	t.Logf("killed listener: %d rounds, %d LISTEN backends terminated (%d released while reconnecting, %d after), "+
		"every waiter got the lease, slowest %v after the release (holder's lease %v)",
		rounds, kills, (rounds+1)/2, rounds/2, maxWake.Round(time.Millisecond), holdTTL)
}

// TestKilledBackendsLeaseLoops runs acquire → fenced read → fenced write
// (with a ledger row in the same transaction) → release loops on three locks
// from six goroutines, each with its own Locker (half with keep-alive,
// waiters on LISTEN), while a killer terminates a random backend of the
// test's database (pool connections, LISTEN connections; never the
// observer's) every 20-80 ms. One unit of work in ten pauses past the TTL
// before writing, so stale writes are attempted. Pass: no two clients ever
// believe they hold one lock at the same time (holdRegistry), tokens of
// believing holders strictly increase per lock, no stale write lands and
// every account's ledger balances (no lost or overwritten update).
func TestKilledBackendsLeaseLoops(t *testing.T) {
	t.Parallel()
	run := 4 * time.Second
	if long() {
		run = 30 * time.Second
	}
	const workers = 6
	const ttl = 300 * time.Millisecond
	locks := []string{"loop:a", "loop:b", "loop:c"}
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 4)
	if _, err := admin.Exec(ctx, `
		CREATE TABLE accounts (name text PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0);
		CREATE TABLE ledger (id bigserial PRIMARY KEY, name text NOT NULL, token bigint NOT NULL,
		                     old_balance bigint NOT NULL, new_balance bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "INSERT INTO accounts SELECT unnest($1::text[]), 0, 0", locks); err != nil {
		t.Fatal(err)
	}
	table, err := fencedwrite.Prepare(ctx, admin, fencedwrite.Spec{
		Table: "accounts", Key: []string{"name"}, Set: []string{"balance"}, Mode: fencedwrite.Reentrant,
	})
	if err != nil {
		t.Fatal(err)
	}
	clients := appPool(t, dsn, "faults-loop", 2*workers)
	reg := newHoldRegistry()
	m := &counters{}
	rec := history.New()
	rec.BoundCutAcquires() // backends killed; no network delay
	for _, name := range locks {
		rec.Seed("accounts/"+name, "0")
	}

	var (
		iterations, acquireErrs, lateGrants, writes, staleRejected, writeErrs, paused atomic.Int64
		releaseLost, releaseErrs                                                      atomic.Int64
	)
	wctx, stop := context.WithTimeout(ctx, run)
	defer stop()
	kills := killer(wctx, 20*time.Millisecond, 80*time.Millisecond, func(ctx context.Context) (int, error) {
		ok, err := terminateOne(ctx, admin)
		if ok {
			return 1, err
		}
		return 0, err
	})
	var wg sync.WaitGroup
	for w := range workers {
		locker, err := pglock.New(clients, &pglock.Config{Holder: fmt.Sprintf("loop-%d", w), KeepAlive: w%2 == 0, Metrics: m})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer locker.Close()
			c := rec.NewClient()
			c.KeepAlive = w%2 == 0
			for wctx.Err() == nil {
				iterations.Add(1)
				name := locks[rand.IntN(len(locks))]
				actx, cancel := context.WithTimeout(ctx, 2*time.Second)
				lease, err := c.Acquire(actx, locker, name, ttl, true)
				cancel()
				if err != nil {
					acquireErrs.Add(1)
					continue
				}
				if !reg.register(lease) {
					lateGrants.Add(1)
					_ = c.Release(ctx, lease)
					continue
				}
				context.AfterFunc(lease.Context(), func() { reg.unregister(lease) })
				tok := lease.Token()
				row := "accounts/" + name
				opCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
				var balance int64
				_, err = c.FencedRead(name, tok, row, func() (string, error) {
					_, err := table.Read(opCtx, clients, tok, []any{name}, &balance)
					return strconv.FormatInt(balance, 10), err
				})
				if err == nil {
					if rand.IntN(10) == 0 {
						paused.Add(1)
						time.Sleep(ttl + 50*time.Millisecond) // a pause past the lease
					} else {
						time.Sleep(rand.N(ttl / 10))
					}
					err = c.Fenced(name, tok, fencedwrite.Reentrant, row, strconv.FormatInt(balance+1, 10), func() error {
						return pgx.BeginFunc(opCtx, clients, func(tx pgx.Tx) error {
							if _, err := table.Update(opCtx, tx, tok, []any{name}, []any{balance + 1}); err != nil {
								return err
							}
							_, err := tx.Exec(opCtx, "INSERT INTO ledger(name, token, old_balance, new_balance) VALUES ($1, $2, $3, $4)",
								name, tok, balance, balance+1)
							return err
						})
					})
				}
				cancel()
				switch {
				case err == nil:
					writes.Add(1)
				case errors.Is(err, pgfence.ErrStaleToken):
					staleRejected.Add(1)
				default:
					writeErrs.Add(1)
				}
				if rand.IntN(3) == 0 {
					_ = c.Renew(ctx, lease)
				}
				reg.unregister(lease)
				rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				err = c.Release(rctx, lease)
				cancel()
				switch {
				case errors.Is(err, pgfence.ErrLost):
					releaseLost.Add(1)
				case err != nil:
					releaseErrs.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	reg.check(t)
	rec.Verify(t)

	for _, name := range locks {
		checkLoopLedger(t, admin, name)
		info, err := pglock.Inspect(ctx, admin, name)
		if err != nil {
			t.Fatal(err)
		}
		reg.mu.Lock()
		seen := reg.maxToken[name]
		reg.mu.Unlock()
		if info.Token < seen {
			t.Errorf("lock %s: token %d in the row, but a client was granted %d", name, info.Token, seen)
		}
	}
	t.Logf("killed backends in lease loops: %d iterations in %v, %d backends terminated, %d grants, %d acquire errors, "+
		"%d grants returned after their deadline, %d committed writes, %d stale writes rejected (%d paused past the TTL), "+
		"%d writes failed on a killed connection, releases refused/failed %d/%d, renewals ok/error/refused %d/%d/%d, "+
		"leases lost %d, 0 overlapping holders, lost updates 0",
		iterations.Load(), run, kills.Load(), reg.grants, acquireErrs.Load(), lateGrants.Load(), writes.Load(),
		staleRejected.Load(), paused.Load(), writeErrs.Load(), releaseLost.Load(), releaseErrs.Load(),
		m.get(metricdefs.LeaseRenewalsTotal, metricdefs.RenewOK), m.get(metricdefs.LeaseRenewalsTotal, metricdefs.RenewError),
		m.get(metricdefs.LeaseRenewalsTotal, metricdefs.RenewRefused), leasesLost(m))
	if kills.Load() == 0 || writes.Load() == 0 {
		t.Errorf("the run did not exercise the faults: %d kills, %d writes", kills.Load(), writes.Load())
	}
}

// leasesLost sums pglock's lost-lease counter over its reasons.
func leasesLost(m *counters) int {
	return m.get(metricdefs.LeasesLostTotal, metricdefs.LostRenewalRefused) + m.get(metricdefs.LeasesLostTotal, metricdefs.LostDeadline) +
		m.get(metricdefs.LeasesLostTotal, metricdefs.LostConnection)
}

// checkLoopLedger verifies one account of TestKilledBackendsLeaseLoops: each
// accepted write started from the previous one's result, tokens never went
// down, and the balance is the number of accepted writes.
func checkLoopLedger(t *testing.T, admin *pgxpool.Pool, name string) {
	t.Helper()
	ctx := context.Background()
	rows, err := admin.Query(ctx, "SELECT token, old_balance, new_balance FROM ledger WHERE name = $1 ORDER BY id", name)
	if err != nil {
		t.Fatal(err)
	}
	type entry struct{ Token, Old, New int64 }
	entries, err := pgx.CollectRows(rows, pgx.RowToStructByPos[entry])
	if err != nil {
		t.Fatal(err)
	}
	var balance, lastToken int64
	for _, e := range entries {
		if e.Token < lastToken {
			t.Errorf("account %s: token %d accepted after token %d", name, e.Token, lastToken)
		}
		if e.Old != balance {
			t.Errorf("account %s: write with token %d started from %d, but the balance was %d: an update was lost", name, e.Token, e.Old, balance)
		}
		balance, lastToken = e.New, e.Token
	}
	var final int64
	if err := admin.QueryRow(ctx, "SELECT balance FROM accounts WHERE name = $1", name).Scan(&final); err != nil {
		t.Fatal(err)
	}
	if final != balance || final != int64(len(entries)) {
		t.Errorf("account %s: balance %d, ledger says %d after %d writes", name, final, balance, len(entries))
	}
}

// TestKilledClaimer runs leased claims on pgfence.jobs (Claim, work,
// Complete) from four goroutines while a killer terminates a random claimer
// backend every 20-80 ms; one job in ten is held past its claim TTL before it
// is completed. Claims and completions whose connection was killed are
// simply retried (the jobs come back when their claims expire). Then a
// deterministic round: worker A claims a job, A's backend is killed, the
// claim expires, worker B claims it again, and A's completion must be
// refused with ErrLost naming B's token. Pass: every enqueued job ends
// completed, none dead or stuck; no job's completion was acknowledged twice;
// a job with no acknowledged completion had a completion whose outcome was
// unknown (killed connection) that did land; every refused completion was
// refused because the job had been claimed again under a larger token.
func TestKilledClaimer(t *testing.T) {
	t.Parallel()
	jobs := 60
	if long() {
		jobs = 400
	}
	const claimTTL = 300 * time.Millisecond
	const queue = "killed"
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 4)
	clients := appPool(t, dsn, "faults-claimer", 8)
	ids := make([]int64, 0, jobs)
	for len(ids) < jobs {
		batch := make([]skiplocked.EnqueueParams, min(100, jobs-len(ids)))
		for i := range batch {
			batch[i] = skiplocked.EnqueueParams{Queue: queue, MaxAttempts: 1000}
		}
		got, err := skiplocked.Enqueue(ctx, admin, batch...)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, got...)
	}

	var (
		mu                                        sync.Mutex
		acked                                     = map[int64]int{}
		unknown                                   = map[int64]int{}
		claims, claimErrs, held, stale, ackedDone atomic.Int64
	)
	refusedTokens := map[int64][]int64{} // job id → tokens whose completion was refused
	remaining := func() (int, error) {
		var n int
		err := admin.QueryRow(ctx, "SELECT count(*) FROM pgfence.jobs WHERE queue = $1 AND state <> 'completed'", queue).Scan(&n)
		return n, err
	}
	// Backends are killed for killFor; then the faults stop and every job
	// must still complete (liveness after the faults, not during them: on a
	// loaded machine each statement is slower, so a kill every 20-80 ms of
	// wall time can cut most of them).
	const killFor, drainFor = 10 * time.Second, 60 * time.Second
	start := time.Now()
	wctx, stop := context.WithTimeout(ctx, drainFor)
	defer stop()
	kctx, stopKiller := context.WithTimeout(wctx, killFor)
	defer stopKiller()
	kills := killer(kctx, 20*time.Millisecond, 80*time.Millisecond, func(ctx context.Context) (int, error) {
		ok, err := terminateOne(ctx, admin)
		if ok {
			return 1, err
		}
		return 0, err
	})
	rec := history.New()
	rec.BoundCutAcquires() // backends killed; no network delay
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := rec.NewClient()
			worker := fmt.Sprintf("claimer-%d", w)
			for wctx.Err() == nil {
				cctx, cancel := context.WithTimeout(wctx, 2*time.Second)
				got, err := c.Claim(cctx, clients, skiplocked.ClaimParams{Queue: queue, Holder: worker, Limit: 3, TTL: claimTTL}, ids)
				cancel()
				if err != nil {
					claimErrs.Add(1)
					continue
				}
				if len(got) == 0 {
					time.Sleep(20 * time.Millisecond)
					continue
				}
				claims.Add(int64(len(got)))
				for _, j := range got {
					if rand.IntN(10) == 0 {
						held.Add(1)
						time.Sleep(claimTTL + 100*time.Millisecond) // the claim expires meanwhile
					} else {
						time.Sleep(rand.N(10 * time.Millisecond))
					}
					cctx, cancel := context.WithTimeout(wctx, 2*time.Second)
					err := c.Complete(cctx, clients, j.Ref())
					cancel()
					mu.Lock()
					switch {
					case err == nil:
						acked[j.ID]++
						ackedDone.Add(1)
					case errors.Is(err, pgfence.ErrLost) && !errors.Is(err, pgfence.ErrNotFound):
						stale.Add(1)
						refusedTokens[j.ID] = append(refusedTokens[j.ID], j.ClaimToken)
					default:
						unknown[j.ID]++
					}
					mu.Unlock()
				}
			}
		}()
	}
	// Drain: wait until every job is completed.
	for {
		n, err := remaining()
		if err == nil && n == 0 {
			break
		}
		if wctx.Err() != nil {
			stop()
			wg.Wait()
			t.Fatalf("%d of %d jobs not completed %v after the start (backends killed during the first %v; last error %v)",
				n, jobs, time.Since(start).Round(time.Second), killFor, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop()
	wg.Wait()
	rec.Verify(t)
	// A statement a cancelled worker sent may still run on its backend after
	// the worker returned (a claim that would take the next job). Close the
	// workers' pool and wait for their backends to exit before going on.
	clients.Close()
	waitFor(t, 30*time.Second, "claimer backends gone", func() (bool, error) {
		var n int
		err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'faults-claimer'").Scan(&n)
		return n == 0, err
	})

	// The deterministic stale completion.
	staleRefused := staleAfterKill(t, admin, dsn, queue)

	var states []string
	rows, err := admin.Query(ctx, "SELECT state || ':' || count(*) FROM pgfence.jobs WHERE queue = $1 GROUP BY state ORDER BY 1", queue)
	if err != nil {
		t.Fatal(err)
	}
	if states, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(states) != 1 || states[0] != fmt.Sprintf("completed:%d", jobs+1) {
		t.Errorf("job states %v, want every one of %d completed", states, jobs+1)
	}
	var unknownLanded int
	for _, id := range ids {
		switch {
		case acked[id] > 1:
			t.Errorf("job %d: completion acknowledged %d times", id, acked[id])
		case acked[id] == 0 && unknown[id] == 0:
			t.Errorf("job %d: completed, but no worker completed it", id)
		case acked[id] == 0:
			unknownLanded++
		}
	}
	for id, tokens := range refusedTokens {
		// The refusal's diagnostics may have been cut by a kill
		// (CurrentToken 0 = unknown); the row says whether the job was
		// claimed again after the refused token.
		j, err := skiplocked.GetJob(ctx, admin, id)
		if err != nil {
			t.Fatal(err)
		}
		for _, tok := range tokens {
			if j.ClaimToken <= tok {
				t.Errorf("job %d: completion under token %d refused, but the job was never claimed again (latest token %d)", id, tok, j.ClaimToken)
			}
		}
	}
	t.Logf("killed claimer: %d jobs, %d backends terminated, %d claims (%d failed on a killed connection), "+
		"%d completions acknowledged, %d jobs completed by a completion whose reply was lost, %d claims held past the TTL, "+
		"%d stale completions refused with ErrLost (+%d in the deterministic round), 0 jobs lost, 0 completed twice",
		jobs, kills.Load(), claims.Load(), claimErrs.Load(), ackedDone.Load(), unknownLanded, held.Load(), stale.Load(), staleRefused)
	if kills.Load() == 0 {
		t.Error("no backend was terminated")
	}
}

// staleAfterKill: worker A claims a job, its backend is killed, the claim
// expires, B claims the job again; A's late Complete must be refused with an
// ErrLost naming B's token and B's Complete must succeed. It returns
// the number of refused completions (2: A's before and after B completed).
func staleAfterKill(t *testing.T, admin *pgxpool.Pool, dsn, queue string) int {
	t.Helper()
	ctx := context.Background()
	const ttl = 100 * time.Millisecond
	ids, err := skiplocked.Enqueue(ctx, admin, skiplocked.EnqueueParams{Queue: queue})
	if err != nil {
		t.Fatal(err)
	}
	const appA = "faults-claimer-a"
	poolA := appPool(t, dsn, appA, 1)
	poolB := appPool(t, dsn, "faults-claimer-b", 1)
	a, err := skiplocked.Claim(ctx, poolA, skiplocked.ClaimParams{Queue: queue, Holder: "A", Limit: 1, TTL: ttl})
	if err != nil || len(a) != 1 || a[0].ID != ids[0] {
		t.Fatalf("A's claim: %v %v", a, err)
	}
	if n, err := terminateApp(ctx, admin, appA); err != nil || n != 1 {
		t.Fatalf("terminate A's backend: %d %v", n, err)
	}
	time.Sleep(ttl + 50*time.Millisecond)
	b, err := skiplocked.Claim(ctx, poolB, skiplocked.ClaimParams{Queue: queue, Holder: "B", Limit: 1, TTL: time.Minute})
	if err != nil || len(b) != 1 || b[0].ID != ids[0] {
		t.Fatalf("B's claim: %v %v", b, err)
	}
	refused := 0
	// A completes late. The first use of A's pool after the kill may meet
	// the dead connection; retry on a new one.
	completeA := func() error {
		var err error
		for range 3 {
			if err = skiplocked.Complete(ctx, poolA, a[0].Ref()); !pgfence.IsRetryable(err) {
				break
			}
		}
		return err
	}
	err = completeA()
	var lost *pgfence.Error
	if !errors.As(err, &lost) || !errors.Is(err, pgfence.ErrLost) || lost.Holder != "B" || lost.Token != a[0].ClaimToken ||
		!strings.HasPrefix(lost.Reason, fmt.Sprintf("job %d: reclaimed by token %d,", a[0].ID, b[0].ClaimToken)) {
		t.Fatalf("A's stale completion: %v (%+v), want ErrLost naming B's token %d", err, lost, b[0].ClaimToken)
	}
	refused++
	if err := skiplocked.Complete(ctx, poolB, b[0].Ref()); err != nil {
		t.Fatalf("B's completion: %v", err)
	}
	if err := completeA(); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("A's completion after B completed: %v, want ErrLost", err)
	}
	refused++
	return refused
}

// TestHoldRegistryCatchesDoubleGrant shows that the believed-holder check
// the killed-connection tests rely on can fail: the lock row is freed behind
// the holder's back (as a broken lock authority would), a second client is
// granted the lock while the first still believes it holds it, and the
// registry must report the overlap.
func TestHoldRegistryCatchesDoubleGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	a, err := pglock.New(pool, &pglock.Config{Holder: "a", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := pglock.New(pool, &pglock.Config{Holder: "b", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	reg := newHoldRegistry()
	la, err := a.Acquire(ctx, "broken", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	reg.register(la)
	if _, err := pool.Exec(ctx, "UPDATE pgfence.locks SET holder = NULL, expires_at = NULL WHERE name = 'broken'"); err != nil {
		t.Fatal(err)
	}
	lb, err := b.Acquire(ctx, "broken", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	reg.register(lb)
	if len(reg.violations) != 1 || !strings.Contains(reg.violations[0], "still believed it held it") {
		t.Fatalf("registry violations %q, want the overlap of tokens %d and %d", reg.violations, la.Token(), lb.Token())
	}
	t.Logf("registry self-check: a double grant (tokens %d and %d) was reported", la.Token(), lb.Token())
}
