package main

import (
	"context"
	"fmt"
	"time"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/pglock"
)

// b1Env holds what B1's variants share: one Locker (one process, many
// goroutines) and the fenced table.
type b1Env struct {
	locker *pglock.Locker
	table  *fencedwrite.Table
}

// setupB1 creates bench_b1 with one row per (client count, worker): each row
// is written only under its own lock name, so its fence only sees that
// name's tokens.
func (b *bench) setupB1(ctx context.Context) (*b1Env, error) {
	_, err := b.pg.pool.Exec(ctx, `
DROP TABLE IF EXISTS bench_b1;
CREATE TABLE bench_b1 (id bigint PRIMARY KEY, v bigint NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0);`)
	if err != nil {
		return nil, err
	}
	for _, c := range b.allClients() {
		if _, err := b.pg.pool.Exec(ctx, "INSERT INTO bench_b1 (id) SELECT $1::bigint * 1000 + g FROM generate_series(0, $2::int - 1) g", c, c); err != nil {
			return nil, err
		}
	}
	tbl, err := fencedwrite.Prepare(ctx, b.pg.pool, fencedwrite.Spec{Table: "bench_b1", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		return nil, err
	}
	l, err := pglock.New(b.pg.pool, &pglock.Config{Holder: "bench-b1"})
	if err != nil {
		return nil, err
	}
	return &b1Env{locker: l, table: tbl}, nil
}

func (e *b1Env) close() { _ = e.locker.Close() }

// b1Variants returns, for clients, the full cycle (acquire, fenced write
// with the lease's token, release: three commits) and the bare cycle
// (acquire, release: two commits), on names distinct per worker.
func (b *bench) b1Variants(env *b1Env, clients int) []variant {
	if env == nil {
		return nil
	}
	const ttl = 30 * time.Second
	const scen = "B1 distinct names"
	names := func(prefix string) []string {
		out := make([]string, clients)
		for w := range out {
			out[w] = fmt.Sprintf("%s-%d-%d", prefix, clients, w)
		}
		return out
	}
	fullNames, bareNames := names("bench-b1"), names("bench-b1bare")
	fullProbe := newLockProbe(scen, keyB1Full, clients, clients, true, false)
	full := variant{name: keyB1Full, clients: clients, probe: fullProbe, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		pr := fullProbe.start()
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			st := pr.begin()
			lease, err := env.locker.Acquire(ctx, fullNames[w], ttl)
			if err != nil {
				return err
			}
			pr.granted(w, w, lease.Token(), st)
			if _, err := env.table.Update(ctx, b.pg.pool, lease.Token(), []any{int64(clients*1000 + w)}, []any{int64(i)}); err != nil {
				pr.releasing(w, w)
				_ = lease.Release(ctx)
				return err
			}
			pr.releasing(w, w)
			return lease.Release(ctx)
		})
	}}
	bareProbe := newLockProbe(scen, keyB1Bare, clients, clients, true, false)
	bare := variant{name: keyB1Bare, clients: clients, probe: bareProbe, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		pr := bareProbe.start()
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			st := pr.begin()
			lease, err := env.locker.Acquire(ctx, bareNames[w], ttl)
			if err != nil {
				return err
			}
			pr.granted(w, w, lease.Token(), st)
			pr.releasing(w, w)
			return lease.Release(ctx)
		})
	}}
	return []variant{full, bare}
}
