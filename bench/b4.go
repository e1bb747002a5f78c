package main

import (
	"context"
	"fmt"
	"strings"
)

// b4Workers is the concurrency of B4 on both sides.
const b4Workers = 8

// b4Batches are the claim batch sizes of pgfence's side of B4.
var b4Batches = []int{1, 10, 100}

// runB4 burns down the same number of no-op jobs with pgfence's SKIP LOCKED
// claims (batch 1, 10, 100), with skiplocked.Worker (8, 100 and 1,000
// handlers) and with River (8 and 2,000 workers), repetitions interleaved.
func (b *bench) runB4(ctx context.Context) error {
	const scen = "B4 queue burn-down"
	env, err := b.setupRiver(ctx)
	if err != nil {
		b.add(notMeasured(scen, "River", b4Workers, "jobs/s", "river setup: "+err.Error()))
		return nil
	}
	defer env.pool.Close()
	vs := b.pgfenceB4Variants(b.cfg.jobs)
	nPgfence := len(vs)
	if nPgfence == 0 {
		for _, batch := range b4Batches {
			b.add(notMeasured(scen, fmt.Sprintf("pgfence skiplocked, batch %d", batch), b4Workers, "jobs/s", "skiplocked not merged yet"))
		}
	}
	rcs := riverConfigs(b4Workers)
	for _, rc := range rcs {
		vs = append(vs, b.riverVariant(env, rc, b.cfg.jobs))
	}
	res := b.measure(ctx, "B4", vs)
	riverSame := res[nPgfence].rates // River with the same worker count
	riverOwn := res[nPgfence+1].rates
	workerGoal := goalCheck{name: "B4 skiplocked.Worker vs River", target: "≥ 1.5 × River at 8 workers (8 handlers) and at its best (2,000 workers; the Worker at its best size)"}
	var ratios []Row
	var workerRates [][]float64 // the Worker variants, for its best size
	for i, v := range vs {
		r := rateRow(scen, v.name, v.clients, "jobs/s", res[i])
		isWorker := strings.HasPrefix(v.name, b4WorkerPrefix)
		if i < nPgfence && r.Measured() {
			if rs := pairedRatios(res[i].rates, riverSame); len(rs) > 0 {
				m, _, _ := summarize(rs)
				switch {
				case !isWorker:
					r = r.withRatio(m, "÷ "+rcs[0].name, 1)
					b.b4Goal.addRatio(strings.TrimPrefix(v.name, "pgfence skiplocked, ")+" vs "+rcs[0].name, r)
				case v.clients == b4Workers:
					r = r.withRatio(m, "÷ "+rcs[0].name, 1.5)
					workerGoal.addRatio(strings.TrimPrefix(v.name, "pgfence ")+" vs "+rcs[0].name, r)
				default:
					r = r.withRatio(m, "÷ "+rcs[0].name, 0)
				}
			}
			if rs := pairedRatios(res[i].rates, riverOwn); len(rs) > 0 {
				rr := newRow("R ratio", v.name+" ÷ "+rcs[1].name, v.clients, "ratio", rs)
				ratios = append(ratios, rr.withRatio(rr.Median, "÷ River 2000 workers", 0))
			}
			if isWorker {
				workerRates = append(workerRates, res[i].rates)
			}
		}
		b.add(r)
		b.keep(keyB4, v.name, v.clients, res[i].rates)
	}
	if best := bestPerRep(workerRates); len(best) > 0 {
		if rs := pairedRatios(best, riverOwn); len(rs) > 0 {
			rr := newRow("R ratio", "pgfence skiplocked.Worker at its best size ÷ "+rcs[1].name, 0, "ratio", rs)
			rr = rr.withRatio(rr.Median, "÷ River 2000 workers", 1.5)
			ratios = append(ratios, rr)
			workerGoal.addRatio("Worker at its best size vs River, 2000 workers", rr)
		}
	}
	b.add(ratios...)
	b.goals = append(b.goals, workerGoal.goal())
	return nil
}

// b4WorkerPrefix starts the names of the skiplocked.Worker variants of B4.
const b4WorkerPrefix = "pgfence skiplocked.Worker"

// bestPerRep returns, for each repetition, the highest rate among the
// series (which ran interleaved, repetition by repetition); nil unless every
// series has the same number of repetitions.
func bestPerRep(series [][]float64) []float64 {
	if len(series) == 0 {
		return nil
	}
	best := make([]float64, len(series[0]))
	for _, s := range series {
		if len(s) != len(best) {
			return nil
		}
		for i, x := range s {
			best[i] = max(best[i], x)
		}
	}
	return best
}
