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
// claims (batch 1, 10, 100) and with River, repetitions interleaved.
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
	var ratios []Row
	for i, v := range vs {
		r := rateRow(scen, v.name, v.clients, "jobs/s", res[i])
		if i < nPgfence && r.Measured() {
			if rs := pairedRatios(res[i].rates, riverSame); len(rs) > 0 {
				m, _, _ := summarize(rs)
				r = r.withRatio(m, "÷ "+rcs[0].name, 1)
				b.b4Goal.addRatio(strings.TrimPrefix(v.name, "pgfence skiplocked, ")+" vs "+rcs[0].name, r)
			}
			if rs := pairedRatios(res[i].rates, riverOwn); len(rs) > 0 {
				rr := newRow("R ratio", v.name+" ÷ "+rcs[1].name, b4Workers, "ratio", rs)
				ratios = append(ratios, rr.withRatio(rr.Median, "÷ River 2000 workers", 0))
			}
		}
		b.add(r)
		b.keep(keyB4, v.name, v.clients, res[i].rates)
	}
	b.add(ratios...)
	return nil
}
