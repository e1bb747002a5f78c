package main

import (
	"context"
	"fmt"
	"time"
)

// variant is one configuration of a scenario; run performs one timed
// repetition of it.
type variant struct {
	name    string
	clients int
	run     func(ctx context.Context, dur time.Duration) (runResult, error)
	// emit, when set, adds the variant's rows once its series is complete.
	emit func(series)
	// probe, when set, is the lock variant's safety and contention probe:
	// run starts it, measure folds every run into it and records its
	// safety counters.
	probe *lockProbe
}

// series holds the per-repetition results of one variant.
type series struct {
	rates  []float64
	allocs []float64
	bytes  []float64
	err    error
}

// measure warms every variant up once, then runs the repetitions interleaved
// (rep 1 of every variant, then rep 2, ...), so that ratios between variants
// compare runs made under the same machine conditions. A variant that fails
// is not run again; its error is kept.
func (b *bench) measure(ctx context.Context, scenario string, vs []variant) []series {
	out := make([]series, len(vs))
	if b.cfg.warmup > 0 {
		for i, v := range vs {
			_, err := v.run(ctx, b.cfg.warmup)
			if v.probe != nil {
				v.probe.finish(false, err == nil)
			}
			if err != nil {
				out[i].err = err
				b.progress("%s %s c=%d warm-up: ERROR %v", scenario, v.name, v.clients, err)
			}
		}
	}
	for rep := range b.cfg.reps {
		for i, v := range vs {
			if out[i].err != nil {
				continue
			}
			if err := ctx.Err(); err != nil {
				out[i].err = err
				continue
			}
			res, err := v.run(ctx, b.cfg.dur)
			if v.probe != nil {
				v.probe.finish(true, err == nil)
			}
			if err != nil {
				out[i].err = err
				b.progress("%s %s c=%d rep %d/%d: ERROR %v", scenario, v.name, v.clients, rep+1, b.cfg.reps, err)
				continue
			}
			out[i].rates = append(out[i].rates, res.rate())
			allocs := fmt.Sprintf("%.0f allocs/op", res.allocsPerOp())
			if res.elsewhere {
				allocs = "allocations in the child processes, not counted"
			} else {
				out[i].allocs = append(out[i].allocs, res.allocsPerOp())
				out[i].bytes = append(out[i].bytes, res.bytesPerOp())
			}
			b.progress("%s %s c=%d rep %d/%d: %s/s (%d ops in %s, %s)", scenario, v.name, v.clients,
				rep+1, b.cfg.reps, formatNum(res.rate()), res.ops, res.elapsed.Round(time.Millisecond), allocs)
		}
	}
	for i, v := range vs {
		if v.probe != nil && v.probe.safety.Runs > 0 {
			b.safety = append(b.safety, v.probe.safety)
			if !v.probe.safety.OK() {
				b.progress("%s %s c=%d: SAFETY %d mutual-exclusion violations, %d token regressions", scenario,
					v.name, v.clients, v.probe.safety.Violations, v.probe.safety.Regressions)
			}
		}
		if v.emit != nil {
			v.emit(out[i])
		}
	}
	return out
}

// rateRow turns a series into a table row, or a not-measured row on error.
func rateRow(scenario, variant string, clients int, metric string, s series) Row {
	if s.err != nil && len(s.rates) == 0 {
		return notMeasured(scenario, variant, clients, metric, fmt.Sprintf("error: %v", s.err))
	}
	return newRow(scenario, variant, clients, metric, s.rates)
}
