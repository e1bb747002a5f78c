package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// noopArgs is the job River works in B4: nothing to do, so the run measures
// the queue's own cost (fetch, run, complete).
type noopArgs struct {
	N int `json:"n"`
}

func (noopArgs) Kind() string { return "pgfence_bench_noop" }

// riverEnv is River's schema in its own database on the same server.
type riverEnv struct {
	pool *pgxpool.Pool
}

const riverDB = "pgfence_bench_river"

func (b *bench) setupRiver(ctx context.Context) (*riverEnv, error) {
	dsn, err := b.pg.createDB(ctx, riverDB)
	if err != nil {
		return nil, err
	}
	pool, err := newPool(ctx, dsn, 40)
	if err != nil {
		return nil, err
	}
	m, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: quietLogger()})
	if err != nil {
		pool.Close()
		return nil, err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		pool.Close()
		return nil, fmt.Errorf("river migrate: %w", err)
	}
	return &riverEnv{pool: pool}, nil
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// riverConfig is one way of running River's client.
type riverConfig struct {
	name          string
	maxWorkers    int
	fetchCooldown time.Duration
	fetchPoll     time.Duration
}

// burnDownJobs is the queue length of one burn-down: a warm-up run (shorter
// than a timed repetition) burns a tenth of it.
func (b *bench) burnDownJobs(jobs int, dur time.Duration) int {
	if dur < b.cfg.dur {
		return max(200, jobs/10)
	}
	return jobs
}

// burnDownTimeout bounds one burn-down repetition.
func (b *bench) burnDownTimeout() time.Duration {
	if b.cfg.quick {
		return 30 * time.Second
	}
	return 90 * time.Second
}

// riverVariant inserts jobs no-op jobs, starts a client and times it from
// Start until the last completion event (events are sent after the
// completion is committed).
func (b *bench) riverVariant(env *riverEnv, rc riverConfig, jobs int) variant {
	return variant{name: rc.name, clients: rc.maxWorkers, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		jobs := b.burnDownJobs(jobs, dur)
		pool := env.pool
		if _, err := pool.Exec(ctx, "TRUNCATE river_job"); err != nil {
			return runResult{}, err
		}
		workers := river.NewWorkers()
		river.AddWorker(workers, river.WorkFunc(func(context.Context, *river.Job[noopArgs]) error { return nil }))
		client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
			FetchCooldown:     rc.fetchCooldown,
			FetchPollInterval: rc.fetchPoll,
			Logger:            quietLogger(),
			Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: rc.maxWorkers}},
			Workers:           workers,
		})
		if err != nil {
			return runResult{}, err
		}
		params := make([]river.InsertManyParams, 0, 5000)
		for i := 0; i < jobs; i++ {
			params = append(params, river.InsertManyParams{Args: noopArgs{N: i}})
			if len(params) == cap(params) || i == jobs-1 {
				if _, err := client.InsertManyFast(ctx, params); err != nil {
					return runResult{}, fmt.Errorf("river insert: %w", err)
				}
				params = params[:0]
			}
		}
		events, cancelSub := client.SubscribeConfig(&river.SubscribeConfig{
			ChanSize: jobs + 1000,
			Kinds:    []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed, river.EventKindJobCancelled},
		})
		defer cancelSub()

		before := memStats()
		start := time.Now()
		if err := client.Start(ctx); err != nil {
			return runResult{}, err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = client.Stop(sctx)
		}()
		timeout := time.NewTimer(b.burnDownTimeout())
		defer timeout.Stop()
		done, failed := 0, 0
		var last time.Time
		for done+failed < jobs {
			select {
			case ev := <-events:
				if ev == nil {
					return runResult{}, fmt.Errorf("river: subscription closed after %d jobs", done)
				}
				if ev.Kind == river.EventKindJobCompleted {
					done++
				} else {
					failed++
				}
				last = time.Now()
			case <-timeout.C:
				return runResult{}, fmt.Errorf("river: only %d of %d jobs completed in %s", done, jobs, b.burnDownTimeout())
			case <-ctx.Done():
				return runResult{}, ctx.Err()
			}
		}
		after := memStats()
		if failed > 0 {
			return runResult{}, fmt.Errorf("river: %d jobs failed or were cancelled", failed)
		}
		return runResult{ops: int64(done), elapsed: last.Sub(start),
			mallocs: after.Mallocs - before.Mallocs, bytes: after.TotalAlloc - before.TotalAlloc}, nil
	}}
}

// riverConfigs are the River clients B4 compares with. River's defaults
// (100 ms fetch cooldown) cap a queue with few workers far below what it can
// do, so both configurations use the fetch settings of River's own
// benchmark: one with the same worker count as pgfence, one with the worker
// count River's benchmark uses.
func riverConfigs(workers int) []riverConfig {
	return []riverConfig{
		{name: fmt.Sprintf("River, %d workers", workers), maxWorkers: workers, fetchCooldown: 2 * time.Millisecond, fetchPoll: 20 * time.Millisecond},
		{name: "River, 2000 workers (its own bench setup)", maxWorkers: 2000, fetchCooldown: 2 * time.Millisecond, fetchPoll: 20 * time.Millisecond},
	}
}
