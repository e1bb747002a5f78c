package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgfence/pgfence/pglock"
)

// b2PollInterval is the retry period of B2's polling configuration.
const b2PollInterval = 50 * time.Millisecond

// handoff records release→next-grant latencies.
type handoff struct {
	epoch       time.Time
	lastRelease atomic.Int64 // ns since epoch when the latest Release was called; 0 = none yet
	mu          sync.Mutex
	lat         []time.Duration
}

func (h *handoff) granted() {
	now := time.Since(h.epoch)
	if rel := h.lastRelease.Swap(0); rel != 0 {
		h.mu.Lock()
		h.lat = append(h.lat, now-time.Duration(rel))
		h.mu.Unlock()
	}
}

func (h *handoff) releasing() { h.lastRelease.Store(int64(time.Since(h.epoch))) }

func percentile(d []time.Duration, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(p * float64(len(s)-1))
	return float64(s[i]) / float64(time.Millisecond)
}

// b2Variant: every client has its own Locker (as separate processes would)
// and loops Acquire → Release on one name.
type latSeries struct{ p50, p99 []float64 }

func (b *bench) b2Variant(poll bool, clients int, lat *latSeries) variant {
	name := keyB2Listen
	if poll {
		name = fmt.Sprintf("polling every %s", b2PollInterval)
	}
	lockName := fmt.Sprintf("bench-b2-hot-%t-%d", poll, clients)
	return variant{name: name, clients: clients, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		lockers := make([]*pglock.Locker, clients)
		defer func() {
			for _, l := range lockers {
				if l != nil {
					_ = l.Close()
				}
			}
		}()
		for w := range clients {
			cfg := &pglock.Config{Holder: fmt.Sprintf("bench-b2-%d", w)}
			if poll {
				cfg.PollOnly = true
				cfg.PollInterval = b2PollInterval
			}
			l, err := pglock.New(b.pg.pool, cfg)
			if err != nil {
				return runResult{}, err
			}
			lockers[w] = l
		}
		h := &handoff{epoch: time.Now()}
		res, err := closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			lease, err := lockers[w].Acquire(ctx, lockName, 30*time.Second)
			if err != nil {
				return err
			}
			h.granted()
			h.releasing()
			return lease.Release(ctx)
		})
		if err == nil && dur == b.cfg.dur {
			lat.p50 = append(lat.p50, percentile(h.lat, 0.50))
			lat.p99 = append(lat.p99, percentile(h.lat, 0.99))
		}
		return res, err
	}}
}

func (b *bench) runB2(ctx context.Context) {
	const scen = "B2 contended handoff, one name"
	var (
		vs   []variant
		lats = map[int]*latSeries{} // by index in vs
	)
	for _, c := range b.cfg.clients {
		if c < 2 {
			continue // no contention with one client
		}
		if b.want("B2") {
			for _, poll := range []bool{false, true} {
				lat := &latSeries{}
				lats[len(vs)] = lat
				vs = append(vs, b.b2Variant(poll, c, lat))
			}
		}
		if b.etcd != nil {
			vs = append(vs, b.p1Variant(true, c))
		}
		if b.redisAddr != "" {
			vs = append(vs, b.p2Variant(true, c))
		}
	}
	if len(vs) == 0 {
		if b.want("B2") {
			b.add(notMeasured(scen, "", 0, "grants/s", "needs at least 2 clients"))
		}
		return
	}
	res := b.measure(ctx, "B2+hot keys", vs)
	for i, v := range vs {
		lat, ok := lats[i]
		if !ok {
			continue // P1/P2 hot-key variants add their own rows
		}
		b.add(rateRow(scen, v.name, v.clients, "grants/s", res[i]))
		b.keep(keyB2, v.name, v.clients, res[i].rates)
		if len(lat.p50) > 0 {
			b.add(newRow(scen, v.name, v.clients, "release→grant p50 ms", lat.p50),
				newRow(scen, v.name, v.clients, "release→grant p99 ms", lat.p99))
		}
	}
}
