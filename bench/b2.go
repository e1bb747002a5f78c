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
	epoch        time.Time
	lastRelease  atomic.Int64 // ns since epoch when the latest Release was called; 0 = none yet
	lastReleased atomic.Int64 // ns since epoch when the latest Release returned; 0 = none yet
	mu           sync.Mutex
	lat          []time.Duration // Release called → next grant
	call         []time.Duration // Release called → Release returned
	wake         []time.Duration // Release returned → next grant
}

func (h *handoff) granted() {
	now := time.Since(h.epoch)
	rel, done := h.lastRelease.Swap(0), h.lastReleased.Swap(0)
	if rel == 0 {
		return
	}
	h.mu.Lock()
	h.lat = append(h.lat, now-time.Duration(rel))
	if done >= rel {
		// The grant came after that Release returned (a handoff's grant is
		// committed before the Release that made it returns).
		h.wake = append(h.wake, now-time.Duration(done))
	}
	h.mu.Unlock()
}

// releasing is called just before Release; released just after it returned,
// with the time releasing returned.
func (h *handoff) releasing() time.Duration {
	now := time.Since(h.epoch)
	h.lastRelease.Store(int64(now))
	return now
}

func (h *handoff) released(start time.Duration) {
	now := time.Since(h.epoch)
	h.lastReleased.Store(int64(now))
	h.mu.Lock()
	h.call = append(h.call, now-start)
	h.mu.Unlock()
}

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
type latSeries struct{ p50, p99, callP50, callP99, wakeP50, cpu []float64 }

func (b *bench) b2Variant(poll bool, clients int, lat *latSeries, probe *lockProbe) variant {
	name := b2VariantName(poll)
	lockName := fmt.Sprintf("bench-b2-hot-%t-%d", poll, clients)
	return variant{name: name, clients: clients, probe: probe, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
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
		// The LISTEN connection opens before the timed loop, as etcd's
		// sessions and Redis's connections do: a service opens it once, at
		// start-up (Locker.Listen), not per run.
		for _, l := range lockers {
			if err := l.Listen(ctx); err != nil {
				return runResult{}, err
			}
		}
		h := &handoff{epoch: time.Now()}
		busy0, cpuOK := machineBusy()
		pr := probe.start()
		res, err := closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			st := pr.begin()
			lease, err := lockers[w].Acquire(ctx, lockName, 30*time.Second)
			if err != nil {
				return err
			}
			h.granted()
			pr.granted(w, 0, lease.Token(), st)
			pr.releasing(w, 0)
			rs := h.releasing()
			err = lease.Release(ctx)
			h.released(rs)
			return err
		})
		if err == nil && dur == b.cfg.dur {
			lat.p50 = append(lat.p50, percentile(h.lat, 0.50))
			lat.p99 = append(lat.p99, percentile(h.lat, 0.99))
			lat.callP50 = append(lat.callP50, percentile(h.call, 0.50))
			lat.callP99 = append(lat.callP99, percentile(h.call, 0.99))
			lat.wakeP50 = append(lat.wakeP50, percentile(h.wake, 0.50))
			if busy1, ok := machineBusy(); ok && cpuOK && res.ops > 0 {
				lat.cpu = append(lat.cpu, float64(busy1-busy0)/float64(time.Millisecond)/float64(res.ops))
			}
		}
		return res, err
	}}
}

func b2VariantName(poll bool) string {
	if poll {
		return fmt.Sprintf("polling every %s", b2PollInterval)
	}
	return keyB2Listen
}

func (b *bench) runB2(ctx context.Context) {
	const scen = "B2 contended handoff, one name"
	var (
		vs     []variant
		lats   = map[int]*latSeries{} // by index in vs
		probes = map[int]*lockProbe{}
	)
	for _, c := range b.cfg.clients {
		if c < 2 {
			continue // no contention with one client
		}
		if b.want("B2") {
			for _, poll := range []bool{false, true} {
				lat := &latSeries{}
				lats[len(vs)] = lat
				probe := newLockProbe(scen, b2VariantName(poll), c, 1, true, true)
				probes[len(vs)] = probe
				vs = append(vs, b.b2Variant(poll, c, lat, probe))
			}
		}
		if b.etcd != nil {
			vs = append(vs, b.p1Variant(true, c))
		}
		vs = append(vs, b.redisVariants(true, c)...)
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
				newRow(scen, v.name, v.clients, "release→grant p99 ms", lat.p99),
				newRow(scen, v.name, v.clients, "release call p50 ms", lat.callP50),
				newRow(scen, v.name, v.clients, "release call p99 ms", lat.callP99),
				newRow(scen, v.name, v.clients, "release returned→grant p50 ms", lat.wakeP50))
			if len(lat.cpu) == len(lat.p50) {
				b.add(newRow(scen, v.name, v.clients, "machine CPU ms per grant", lat.cpu))
			} else {
				b.add(notMeasured(scen, v.name, v.clients, "machine CPU ms per grant", "/proc/stat not readable, or a repetition made no grant"))
			}
		}
		listen := v.name == keyB2Listen
		if listen {
			b.keep(keyB2WaitP99, v.name, v.clients, probes[i].cont.waitP99)
		}
		rows := b.addContentionRows(scen, v.name, v.clients, &probes[i].cont, listen)
		if listen {
			b.b2ContentionGoals(v.clients, rows)
		}
	}
}

// b2ContentionGoals adds B2 LISTEN's hot-name rows that carry a goal
// (fairness index, acquire wait p99 against the grant interval, bypass) to
// the goal summary, one goal per metric over the client counts.
func (b *bench) b2ContentionGoals(clients int, rows []Row) {
	for _, r := range rows {
		if r.GoalMet == nil {
			continue
		}
		var g *goalCheck
		for _, x := range b.b2Goals {
			if x.metric == r.Metric {
				g = x
			}
		}
		if g == nil {
			g = &goalCheck{name: "B2 hot name, LISTEN: " + r.Metric, target: r.Goal, metric: r.Metric}
			if r.Metric == "bypass max (grants to others during one acquire)" {
				g.target = "≤ 2 × waiters (N − 1)"
			}
			b.b2Goals = append(b.b2Goals, g)
		}
		g.addValue(fmt.Sprintf("c=%d", clients), formatNum(r.Median), *r.GoalMet)
	}
}
