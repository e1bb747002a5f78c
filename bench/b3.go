package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/pglock"
)

// b3RowsPerWorker is the size of each worker's partition in B3.
const b3RowsPerWorker = 1000

// B3 tables: bench_b3 (no guard) and bench_b3_guarded (guard attached). Row
// ids are clients*100000 + worker*1000 + k; each worker holds one lease for a
// repetition and writes only its own rows, so fenced writes are never
// refused and the comparison measures the cost of the check alone.
func (b *bench) setupB3(ctx context.Context) (plain, guarded *fencedwrite.Table, err error) {
	for _, t := range []string{"bench_b3", "bench_b3_guarded"} {
		_, err := b.pg.pool.Exec(ctx, fmt.Sprintf(`
DROP TABLE IF EXISTS %[1]s;
CREATE TABLE %[1]s (id bigint PRIMARY KEY, lock_name text NOT NULL, v bigint NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0);`, t))
		if err != nil {
			return nil, nil, err
		}
		for _, c := range b.cfg.clients {
			_, err := b.pg.pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %s (id, lock_name)
SELECT $1::bigint * 100000 + w * 1000 + k, $2::text || $1::text || '-' || w
FROM generate_series(0, $1::int - 1) w, generate_series(0, %d) k`, t, b3RowsPerWorker-1), c, t+"-")
			if err != nil {
				return nil, nil, err
			}
		}
		if _, err := b.pg.pool.Exec(ctx, "VACUUM ANALYZE "+t); err != nil {
			return nil, nil, err
		}
	}
	if err := fencedwrite.Guard(ctx, b.pg.pool, "bench_b3_guarded", fencedwrite.GuardOptions{
		LockNameColumn: "lock_name", Mode: fencedwrite.Reentrant}); err != nil {
		return nil, nil, fmt.Errorf("guard: %w", err)
	}
	spec := fencedwrite.Spec{Key: []string{"id"}, Set: []string{"v"}, Mode: fencedwrite.Reentrant}
	spec.Table = "bench_b3"
	if plain, err = fencedwrite.Prepare(ctx, b.pg.pool, spec); err != nil {
		return nil, nil, err
	}
	spec.Table = "bench_b3_guarded"
	if guarded, err = fencedwrite.Prepare(ctx, b.pg.pool, spec); err != nil {
		return nil, nil, err
	}
	return plain, guarded, nil
}

func b3RowID(clients, w int) int64 {
	return int64(clients*100000 + w*1000 + rand.IntN(b3RowsPerWorker))
}

func (b *bench) b3Unconditional(clients int) variant {
	return variant{name: keyB3Uncond, clients: clients, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			_, err := b.pg.pool.Exec(ctx, "UPDATE bench_b3 SET v = $2 WHERE id = $1", b3RowID(clients, w), int64(i))
			return err
		})
	}}
}

// b3FencedSQL is the user's form written by hand: the same UPDATE plus
// "AND fence <= $token" and "fence = $token", one statement, no diagnosis.
func (b *bench) b3FencedSQL(l *pglock.Locker, clients int) variant {
	return b.b3WithLeases(l, "bench_b3", keyB3SQL, clients, func(ctx context.Context, token int64, w, i int) error {
		_, err := b.pg.pool.Exec(ctx, "UPDATE bench_b3 SET v = $2, fence = $3 WHERE id = $1 AND fence <= $3",
			b3RowID(clients, w), int64(i), token)
		return err
	})
}

// b3Fenced takes one lease per worker for the repetition and writes with its
// token through the fencedwrite helper (re-entrant: fence <= token).
func (b *bench) b3Fenced(l *pglock.Locker, tbl *fencedwrite.Table, table, name string, clients int) variant {
	return b.b3WithLeases(l, table, name, clients, func(ctx context.Context, token int64, w, i int) error {
		_, err := tbl.Update(ctx, b.pg.pool, token, []any{b3RowID(clients, w)}, []any{int64(i)})
		return err
	})
}

// b3WithLeases gives each worker one lease for the repetition and runs op
// with its token.
func (b *bench) b3WithLeases(l *pglock.Locker, table, name string, clients int,
	op func(ctx context.Context, token int64, w, i int) error) variant {
	return variant{name: name, clients: clients, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		leases := make([]*pglock.Lease, clients)
		defer func() {
			for _, lease := range leases {
				if lease != nil {
					_ = lease.Release(context.WithoutCancel(ctx))
				}
			}
		}()
		for w := range clients {
			lease, err := l.Acquire(ctx, fmt.Sprintf("%s-%d-%d", table, clients, w), 10*time.Minute)
			if err != nil {
				return runResult{}, err
			}
			leases[w] = lease
		}
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			return op(ctx, leases[w].Token(), w, i)
		})
	}}
}

func (b *bench) runB3(ctx context.Context) {
	const scen = "B3 fenced vs unconditional UPDATE"
	plain, guarded, err := b.setupB3(ctx)
	if err != nil {
		b.add(notMeasured(scen, "", 0, "ops/s", "setup: "+err.Error()))
		return
	}
	l, err := pglock.New(b.pg.pool, &pglock.Config{Holder: "bench-b3"})
	if err != nil {
		b.add(notMeasured(scen, "", 0, "ops/s", err.Error()))
		return
	}
	defer l.Close()
	var vs []variant
	for _, c := range b.cfg.clients {
		vs = append(vs, b.b3Unconditional(c),
			b.b3Fenced(l, plain, "bench_b3", keyB3Fenced, c),
			b.b3FencedSQL(l, c),
			b.b3Fenced(l, guarded, "bench_b3_guarded", keyB3Guard, c))
	}
	const per = 4
	res := b.measure(ctx, "B3", vs)
	for i := 0; i < len(vs); i += per {
		c := vs[i].clients
		uncond := res[i].rates
		b.add(rateRow(scen, keyB3Uncond, c, "ops/s", res[i]))
		for j := 1; j < per; j++ {
			r := rateRow(scen, vs[i+j].name, c, "ops/s", res[i+j])
			if rs := pairedRatios(res[i+j].rates, uncond); len(rs) > 0 && r.Measured() {
				m, _, _ := summarize(rs)
				goal, gc := b3Goal, &b.b3Goal
				if vs[i+j].name == keyB3Guard {
					goal, gc = b3GuardGoal, &b.b3GuardGoal
				}
				r = r.withRatio(m, "÷ unconditional", goal)
				gc.addRatio(fmt.Sprintf("%s c=%d", vs[i+j].name, c), r)
			}
			b.add(r)
			b.keep(keyB3, vs[i+j].name, c, res[i+j].rates)
		}
		if c == 1 {
			b.memRow("B3 fenced UPDATE (helper)", res[i+1])
		}
	}
}
