package main

import (
	"math"
	"slices"
	"sync/atomic"
	"time"
)

// noToken is passed to probeRun.granted by locks that issue no fencing token
// (Redis); their grants are checked for mutual exclusion only.
const noToken = math.MinInt64

// lockProbe watches every run of one lock variant:
//
//   - safety, in every run (warm-ups included): an in-process holder registry
//     per lock name (set atomically when a grant returns, cleared before the
//     release is sent) counts mutual-exclusion violations (a grant while the
//     registry says another client holds the name), and the latest token per
//     name counts token regressions (a grant whose token is not greater than
//     the previous grant's token of that name, across the variant's runs);
//   - contention, in timed runs when the variant is on one hot name: the wait
//     of every acquire (from the call to its return), how many grants went to
//     others during that wait (bypass), the grants per client (for Jain's
//     fairness index) and the interval between successive grants.
//
// Each worker writes only its own per-worker slots during a run; they are
// read after the run, once closedLoop has waited for every worker.
type lockProbe struct {
	scenario, variant string
	clients           int
	hot               bool // measure contention (one name shared by all clients)

	slots []probeSlot // one per lock name
	cur   *probeRun   // the run in progress

	safety SafetyCount
	cont   contentionSeries
}

type probeSlot struct {
	holder atomic.Int64 // worker+1 of the client the registry says holds the name; 0: free
	last   atomic.Int64 // token of the latest grant of the name; 0: none yet
}

// probeRun is the state of one run.
type probeRun struct {
	p           *lockProbe
	seq         atomic.Int64 // grants so far in this run (hot variants)
	lastGrant   atomic.Int64 // ns since epoch of the latest grant; 0: none
	epoch       time.Time
	grants      atomic.Int64
	violations  atomic.Int64
	regressions atomic.Int64
	workers     []probeWorker
}

type probeWorker struct {
	grants  int64
	arrival time.Duration   // wait of the worker's first acquire of the run
	waits   []time.Duration // waits of its later acquires
	bypass  []int64
	gaps    []time.Duration
	_       [64]byte // keep workers' counters off each other's cache lines
}

// contentionSeries holds one value per timed repetition of each contention
// metric.
type contentionSeries struct {
	waitP50, waitP99, waitMax []float64 // ms, every acquire but each client's first of the run
	arrivalMax                []float64 // ms, the longest first acquire of a client in the run
	fairness                  []float64 // Jain's index over per-client grants
	bypassP99, bypassMax      []float64 // grants to others during one acquire
	gapMean                   []float64 // mean ms between successive grants
	waitP99PerNGap            []float64 // acquire wait p99 ÷ (clients × mean gap)
}

// newLockProbe returns the probe of a variant with clients workers on names
// lock names; tokens says whether the lock issues fencing tokens (checked
// for regressions), hot whether all clients share one name (contention
// measured).
func newLockProbe(scenario, variant string, clients, names int, tokens, hot bool) *lockProbe {
	return &lockProbe{
		scenario: scenario, variant: variant, clients: clients, hot: hot,
		slots:  make([]probeSlot, names),
		safety: SafetyCount{Scenario: scenario, Variant: variant, Clients: clients, Tokens: tokens},
	}
}

// start begins a run; the returned probeRun is used by the run's workers.
func (p *lockProbe) start() *probeRun {
	r := &probeRun{p: p, epoch: time.Now(), workers: make([]probeWorker, p.clients)}
	p.cur = r
	return r
}

// finish folds the run that just ended into the variant's totals; timed says
// whether it was a timed repetition (its contention figures are kept) and ok
// whether it completed without error.
func (p *lockProbe) finish(timed, ok bool) {
	r := p.cur
	p.cur = nil
	if r == nil {
		return
	}
	p.safety.Runs++
	p.safety.Grants += r.grants.Load()
	p.safety.Violations += r.violations.Load()
	p.safety.Regressions += r.regressions.Load()
	if !timed || !ok || !p.hot {
		return
	}
	var (
		waits    []time.Duration
		arrivals []time.Duration
		bypass   []int64
		gaps     []time.Duration
		counts   = make([]float64, len(r.workers))
	)
	for i := range r.workers {
		w := &r.workers[i]
		if w.grants > 0 {
			arrivals = append(arrivals, w.arrival)
		}
		waits = append(waits, w.waits...)
		bypass = append(bypass, w.bypass...)
		gaps = append(gaps, w.gaps...)
		counts[i] = float64(w.grants)
	}
	if len(waits) == 0 {
		return
	}
	c := &p.cont
	c.waitP50 = append(c.waitP50, percentile(waits, 0.50))
	c.waitP99 = append(c.waitP99, percentile(waits, 0.99))
	c.waitMax = append(c.waitMax, percentile(waits, 1))
	c.arrivalMax = append(c.arrivalMax, percentile(arrivals, 1))
	c.fairness = append(c.fairness, jainIndex(counts))
	slices.Sort(bypass)
	c.bypassP99 = append(c.bypassP99, float64(bypass[int(0.99*float64(len(bypass)-1))]))
	c.bypassMax = append(c.bypassMax, float64(bypass[len(bypass)-1]))
	if len(gaps) > 0 {
		var sum time.Duration
		for _, g := range gaps {
			sum += g
		}
		g := float64(sum) / float64(len(gaps)) / float64(time.Millisecond)
		c.gapMean = append(c.gapMean, g)
		if g > 0 {
			c.waitP99PerNGap = append(c.waitP99PerNGap, percentile(waits, 0.99)/(float64(p.clients)*g))
		}
	}
}

// acquireStart is what a worker notes before it calls Acquire.
type acquireStart struct {
	at  time.Time
	seq int64
}

// begin is called by worker w right before it asks for the lock.
func (r *probeRun) begin() acquireStart {
	if !r.p.hot {
		return acquireStart{}
	}
	return acquireStart{at: time.Now(), seq: r.seq.Load()}
}

// granted is called by worker w as soon as the lock on name slot was granted
// with token (noToken for a lock without tokens), before anything else.
func (r *probeRun) granted(w, slot int, token int64, s acquireStart) {
	r.grants.Add(1)
	sl := &r.p.slots[slot]
	if !sl.holder.CompareAndSwap(0, int64(w)+1) {
		r.violations.Add(1)
	}
	if token != noToken {
		if prev := sl.last.Swap(token); prev != 0 && token <= prev {
			r.regressions.Add(1)
		}
	}
	if !r.p.hot {
		return
	}
	now := time.Now()
	n := r.seq.Add(1) // this grant's number in the run
	pw := &r.workers[w]
	if pw.grants == 0 {
		// Every client arrives at once when the run starts: its first wait
		// is the arrival, reported apart from the steady contention.
		pw.arrival = now.Sub(s.at)
	} else {
		pw.waits = append(pw.waits, now.Sub(s.at))
	}
	pw.grants++
	pw.bypass = append(pw.bypass, n-1-s.seq)
	at := int64(now.Sub(r.epoch))
	if prev := r.lastGrant.Swap(at); prev != 0 {
		pw.gaps = append(pw.gaps, time.Duration(at-prev))
	}
}

// releasing is called by worker w right before it releases name slot (also
// when the release follows a failed operation).
func (r *probeRun) releasing(w, slot int) {
	r.p.slots[slot].holder.CompareAndSwap(int64(w)+1, 0)
}

// jainIndex is Jain's fairness index (Σx)² / (n·Σx²): 1 when every client got
// the same share, 1/n when one client got everything.
func jainIndex(xs []float64) float64 {
	var sum, sq float64
	for _, x := range xs {
		sum += x
		sq += x * x
	}
	if len(xs) == 0 || sq == 0 {
		return math.NaN()
	}
	return sum * sum / (float64(len(xs)) * sq)
}

// addContentionRows adds the hot-name rows of a probe: per-acquire wait
// percentiles, the fairness index and the bypass counts. With goals set they
// carry the targets: fairness index ≥ 0.9, acquire wait p99 ≤ 2 × N ×
// the grant interval, bypass ≤ 2 × waiters. It returns the rows.
//
// The interval is the mean, not the median: by Little's law the mean wait of
// N clients in a closed loop is about N × the mean interval whatever the
// order of grants, so the ratio measures the tail against a fair share; a
// lock that grants in bursts (etcd's Mutex, woken by a watch) has a median
// interval far below its mean and would look unfair by the median alone.
func (b *bench) addContentionRows(scen, variant string, clients int, c *contentionSeries, goals bool) []Row {
	if len(c.waitP50) == 0 {
		return nil
	}
	waiters := float64(clients - 1)
	fair := newRow(scen, variant, clients, "fairness index", c.fairness)
	perGap := newRow(scen, variant, clients, "acquire wait p99 ÷ (N × mean grant interval)", c.waitP99PerNGap)
	bypassMax := newRow(scen, variant, clients, "bypass max (grants to others during one acquire)", c.bypassMax)
	if goals {
		fair = fair.withGoal("≥ 0.9", fair.Median >= 0.9)
		perGap = perGap.withGoal("≤ 2", perGap.Median <= 2)
		bypassMax = bypassMax.withGoal("≤ 2 × waiters = "+formatNum(2*waiters), bypassMax.Median <= 2*waiters)
	}
	rows := []Row{
		newRow(scen, variant, clients, "acquire wait p50 ms", c.waitP50),
		newRow(scen, variant, clients, "acquire wait p99 ms", c.waitP99),
		newRow(scen, variant, clients, "acquire wait max ms", c.waitMax),
		newRow(scen, variant, clients, "first acquire wait max ms (all clients arriving together)", c.arrivalMax),
		newRow(scen, variant, clients, "mean grant interval ms", c.gapMean),
		perGap,
		fair,
		newRow(scen, variant, clients, "bypass p99 (grants to others during one acquire)", c.bypassP99),
		bypassMax,
	}
	b.add(rows...)
	return rows
}

// merge folds the counts of a child process (B1 across processes) into the
// run: its grants, violations and regressions, found by the child's own
// probe over its names, and per worker the first and last token it was
// granted, for names slot base+k. A name whose first token of this run is
// not greater than its last token of an earlier run is a token regression.
func (r *probeRun) merge(base int, grants, violations, regressions int64, first, last []int64) {
	r.grants.Add(grants)
	r.violations.Add(violations)
	r.regressions.Add(regressions)
	for k := range min(len(first), len(last)) {
		if first[k] == 0 {
			continue // no grant
		}
		sl := &r.p.slots[base+k]
		if prev := sl.last.Load(); prev != 0 && first[k] <= prev {
			r.regressions.Add(1)
		}
		sl.last.Store(last[k])
	}
}
