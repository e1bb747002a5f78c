package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
)

// o1Topic is the outbox topic of O1.
const o1Topic = "bench"

// runO1 measures fenced-outbox dispatch (intents delivered per second by an
// outbox.Dispatcher with b4Workers no-op handlers) beside the
// skiplocked.Worker burn-down of B4 that it is built on, repetitions
// interleaved.
func (b *bench) runO1(ctx context.Context) {
	const scen = "O1 outbox dispatch"
	vs := []variant{b.pgfenceWorkerB4Variant(b.cfg.jobs), b.outboxO1Variant(b.cfg.jobs)}
	res := b.measure(ctx, "O1", vs)
	b.add(rateRow(scen, vs[0].name, vs[0].clients, "jobs/s", res[0]))
	r := rateRow(scen, vs[1].name, vs[1].clients, "intents/s", res[1])
	if rs := pairedRatios(res[1].rates, res[0].rates); len(rs) > 0 && r.Measured() {
		m, _, _ := summarize(rs)
		r = r.withRatio(m, "÷ Worker", o1Goal)
		b.o1Goal.addRatio("Dispatcher ÷ Worker", r)
	}
	b.add(r)
}

// enqueueO1 empties the outbox and records n intents under one lease, in
// transactions of 500.
func (b *bench) enqueueO1(ctx context.Context, n int) error {
	pool := b.pg.pool
	if _, err := pool.Exec(ctx, "TRUNCATE pgfence.outbox, pgfence.jobs"); err != nil {
		return err
	}
	locker, err := pglock.New(pool, nil)
	if err != nil {
		return err
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "bench:o1", time.Hour)
	if err != nil {
		return err
	}
	defer func() { _ = lease.Release(context.Background()) }()
	payload := json.RawMessage(`{"amount_cents":12345,"currency":"EUR"}`)
	for i := 0; i < n; i += 500 {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for j := i; j < min(n, i+500); j++ {
				if _, err := outbox.Enqueue(ctx, tx, lease, outbox.Intent{Topic: o1Topic,
					Key: fmt.Sprintf("o1:%d:%d", lease.Token(), j), Payload: payload}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	_, err = pool.Exec(ctx, "VACUUM ANALYZE pgfence.jobs, pgfence.outbox")
	return err
}

// outboxO1Variant delivers the intents with an outbox.Dispatcher of
// b4Workers no-op handlers (each claim statement returns the intents of the
// jobs it claims, each delivery calls the handler, and its completion is
// batched by the skiplocked Worker). Timed from Run until every delivery is
// recorded.
func (b *bench) outboxO1Variant(jobs int) variant {
	return variant{name: fmt.Sprintf("pgfence outbox.Dispatcher, %d handlers", b4Workers), clients: b4Workers,
		run: func(ctx context.Context, dur time.Duration) (runResult, error) {
			jobs := b.burnDownJobs(jobs, dur)
			if err := b.enqueueO1(ctx, jobs); err != nil {
				return runResult{}, fmt.Errorf("enqueue intents: %w", err)
			}
			m := &completions{want: int64(jobs), done: make(chan struct{})}
			d, err := outbox.NewDispatcher(b.pg.pool, o1Topic, func(context.Context, outbox.Delivery) error { return nil },
				&outbox.Config{Concurrency: b4Workers, ClaimTTL: 5 * time.Minute, Metrics: m})
			if err != nil {
				return runResult{}, err
			}
			return b.timeBurnDown(ctx, d.Run, m, jobs, "dispatcher", "intents delivered")
		}}
}
