package pglock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// stressHistory records every lease Acquire returned for one name, and the
// tokens of grants reported as ErrSlowGrant (given back, or left to expire
// when the caller's context had ended: TryAcquire's documented case).
type stressHistory struct {
	mu       sync.Mutex
	leases   []*stressRecord
	tokens   map[int64]string // token -> who was given it
	slow     map[int64]bool   // tokens reported by ErrSlowGrant
	failures []string
}

type stressRecord struct {
	lease     *Lease
	who       string
	releasing bool // Release was called (it may hand the lease on)
}

// granted records lease, returned to who. Every earlier lease of the name
// still recorded as held must have ended locally by now: its Deadline is
// no later than its expiry in the database (the deadline counts from the
// send time of its grant or renewal), that expiry is no later than the new
// grant, and the new grant is no later than now. A token returned twice is
// a failure too.
func (h *stressHistory) granted(who string, lease *Lease) *stressRecord {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if prev, ok := h.tokens[lease.Token()]; ok {
		h.failures = append(h.failures, fmt.Sprintf("token %d returned twice: to %s and to %s", lease.Token(), prev, who))
	}
	h.tokens[lease.Token()] = who
	for _, r := range h.leases {
		if r.releasing || r.lease.Token() >= lease.Token() {
			continue
		}
		if d := r.lease.Deadline(); d.After(now) && r.lease.Err() == nil {
			h.failures = append(h.failures, fmt.Sprintf("%s got token %d while %s's token %d is live for %v more",
				who, lease.Token(), r.who, r.lease.Token(), d.Sub(now)))
		}
	}
	rec := &stressRecord{lease: lease, who: who}
	h.leases = append(h.leases, rec)
	return rec
}

func (h *stressHistory) releasing(r *stressRecord) {
	h.mu.Lock()
	r.releasing = true
	h.mu.Unlock()
}

func (h *stressHistory) fail(format string, args ...any) {
	h.mu.Lock()
	h.failures = append(h.failures, fmt.Sprintf(format, args...))
	h.mu.Unlock()
}

// stressOutcome names err for the run's statistics: its Kind, or "no kind".
func stressOutcome(err error) string {
	var pe *pgfence.Error
	switch {
	case err == nil:
		return "granted"
	case !errors.As(err, &pe):
		return "untyped"
	case pe.Kind == nil:
		return "no kind"
	default:
		return pe.Kind.Error()
	}
}

// TestWaitStressNoOverlap runs twelve goroutines in four Lockers (two with
// KeepAlive) acquiring two names with short TTLs, waits that their
// contexts cut short, holders that overrun their TTL, renew, or release at
// once. It checks that no lease is returned while an earlier one of the
// name is live by its local Deadline (see stressHistory.granted), that no
// token is returned twice, that every error is a *pgfence.Error, and, once
// every call has returned and the Lockers are closed (Close waits for the
// waits that gave up to give back what they got), that no name is held by
// a token nobody was given. It runs 3 s; PGFENCE_WAIT_STRESS=20s (any
// duration) runs longer.
// maxStressTTL bounds the TTLs TestWaitStressNoOverlap asks for.
const maxStressTTL = 450 * time.Millisecond

func TestWaitStressNoOverlap(t *testing.T) {
	t.Parallel()
	run := 3 * time.Second
	if v := os.Getenv("PGFENCE_WAIT_STRESS"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("PGFENCE_WAIT_STRESS=%q: %v", v, err)
		}
		run = d
	}
	pool := pgtest.Pool(t)
	ctx := testCtx(t, run+2*time.Minute)
	names := []string{"stress-a", "stress-b"}
	hists := map[string]*stressHistory{}
	for _, n := range names {
		hists[n] = &stressHistory{tokens: map[int64]string{}, slow: map[int64]bool{}}
	}
	var lockers []*Locker
	for i := range 4 {
		lockers = append(lockers, newLocker(t, pool, &Config{Holder: fmt.Sprintf("L%d", i), KeepAlive: i%2 == 1, PollInterval: 50 * time.Millisecond}))
	}
	var (
		statsMu sync.Mutex
		stats   = map[string]int{}
	)
	count := func(k string) {
		statsMu.Lock()
		stats[k]++
		statsMu.Unlock()
	}
	// checked reports a Renew or Release error that is not a *pgfence.Error.
	checked := func(h *stressHistory, what string, err error) {
		var pe *pgfence.Error
		if err != nil && !errors.As(err, &pe) {
			h.fail("%s: untyped error %T %v", what, err, err)
		}
	}
	stop := time.Now().Add(run)
	var wg sync.WaitGroup
	for g := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), uint64(time.Now().UnixNano())))
			l := lockers[g%len(lockers)]
			who := fmt.Sprintf("%s/g%d", l.Holder(), g)
			for time.Now().Before(stop) && ctx.Err() == nil {
				name := names[rng.IntN(len(names))]
				h := hists[name]
				ttl := time.Duration(150+rng.IntN(300)) * time.Millisecond // < maxStressTTL
				actx, cancel := context.WithTimeout(ctx, time.Duration(5+rng.IntN(300))*time.Millisecond)
				s, err := l.Acquire(actx, name, ttl)
				cancel()
				count(stressOutcome(err))
				if err != nil {
					var pe *pgfence.Error
					switch {
					case !errors.As(err, &pe):
						h.fail("Acquire: untyped error %T %v", err, err)
					case errors.Is(err, pgfence.ErrSlowGrant):
						h.mu.Lock()
						h.slow[pe.Token] = true
						h.mu.Unlock()
					}
					continue
				}
				rec := h.granted(who, s)
				switch rng.IntN(4) {
				case 0: // overrun: let it expire (a KeepAlive lease is renewed meanwhile: release it after)
					count("overrun")
					time.Sleep(ttl + time.Duration(rng.IntN(50))*time.Millisecond)
					if l.cfg.KeepAlive {
						h.releasing(rec)
						checked(h, "Release", s.Release(ctx))
					}
				case 1: // renew a few times, then release
					for range 3 {
						time.Sleep(ttl / 4)
						if err := s.Renew(ctx); err != nil {
							checked(h, "Renew", err)
							break
						}
					}
					h.releasing(rec)
					checked(h, "Release", s.Release(ctx))
				default: // a short critical section
					time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
					h.releasing(rec)
					checked(h, "Release", s.Release(ctx))
				}
			}
		}()
	}
	wg.Wait()
	for _, l := range lockers {
		if err := l.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}
	t.Logf("outcomes: %v", stats)
	for _, n := range names {
		h := hists[n]
		info := inspect(t, pool, n)
		h.mu.Lock()
		_, known := h.tokens[info.Token]
		slow := h.slow[info.Token]
		leases, failures := len(h.leases), h.failures
		h.mu.Unlock()
		// The one documented exception (package doc, "Input and
		// cancellation"): a direct grant statement (an Acquire's first
		// attempt at a name it did not wait for last time) abandoned by
		// its context after the server committed it stays held until its
		// TTL. Here it needs a 5-10 ms context to end during that round
		// trip while the contended name happens to be free, within the
		// last TTL of the run: not seen in 30 s runs beside two CPU-bound
		// processes, where queueing statements and batches abandoned that
		// way gave their grants back within 50 ms. Such a lease ends
		// within its TTL (at most maxStressTTL); any other is an error.
		if left := info.ExpiresAt.Sub(info.DBNow); info.Held && !known && !slow {
			if left > maxStressTTL {
				t.Errorf("%s: held by %q with token %d (expires in %v) that no Acquire returned", n, info.Holder, info.Token, left)
			} else {
				t.Logf("%s: held by %q with token %d that no Acquire returned, for %v more (an abandoned direct grant)", n, info.Holder, info.Token, left)
			}
		}
		for _, f := range failures {
			t.Errorf("%s: %s", n, f)
		}
		// The run did what it is for: leases of each name, one after the other.
		if leases < 5 {
			t.Errorf("%s: %d leases in %v, want at least 5", n, leases, run)
		}
		t.Logf("%s: %d leases", n, leases)
	}
	if stats["overrun"] == 0 || stats[pgfence.ErrLocked.Error()] == 0 {
		t.Errorf("no overrun or no wait cut short (outcomes %v): the run did not exercise them", stats)
	}
}
