package main

import (
	"context"
	"fmt"
)

// b4Workers is the concurrency of B4 on both sides.
const b4Workers = 8

// runB4 burns down the same number of no-op jobs with pgfence's SKIP LOCKED
// claims (batch 1, 10, 100) and with River, interleaved.
func (b *bench) runB4(ctx context.Context) error {
	const scen = "B4 queue burn-down"
	env, err := b.setupRiver(ctx)
	if err != nil {
		b.add(notMeasured(scen, "River", b4Workers, "jobs/s", "river setup: "+err.Error()))
		return nil
	}
	defer env.pool.Close()
	var vs []variant
	for _, rc := range riverConfigs(b4Workers) {
		vs = append(vs, b.riverVariant(env, rc, b.cfg.jobs))
	}
	res := b.measure(ctx, "B4", vs)
	for _, batch := range []int{1, 10, 100} {
		b.add(notMeasured(scen, fmt.Sprintf("pgfence skiplocked, batch %d", batch), b4Workers, "jobs/s", "skiplocked not merged yet"))
	}
	for i, v := range vs {
		b.add(rateRow(scen, v.name, v.clients, "jobs/s", res[i]))
		b.keep("B4", v.name, v.clients, res[i].rates)
	}
	return nil
}
