package fencedwrite_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// BenchmarkFencedUpdate measures, side by side in one run and on the same
// rows, an unconditional UPDATE, the same UPDATE with the fence check, the
// runtime helper's statement (which also explains a refusal), and the fenced
// UPDATE on a table with the guard trigger attached. Each iteration runs every
// variant once on one connection, interleaved, so drift in machine load hits
// all of them alike. Reported: µs per statement for each variant and the
// throughput ratio of each against the unconditional UPDATE.
//
//	go test -run '^$' -bench FencedUpdate -benchtime 20000x ./fencedwrite/
func BenchmarkFencedUpdate(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b)
	const rows = 1000
	for _, tbl := range []string{"bench_plain", "bench_guarded"} {
		mustExec(b, pool, `CREATE TABLE `+tbl+` (id int PRIMARY KEY, v bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
		mustExec(b, pool, `INSERT INTO `+tbl+` (id, v) SELECT g, 0 FROM generate_series(1, $1) g`, rows)
	}
	mustExec(b, pool, `INSERT INTO pgfence.locks (name, token) VALUES ('bench', 1)`)
	if err := fencedwrite.Guard(ctx, pool, "bench_guarded", fencedwrite.GuardOptions{LockName: "bench"}); err != nil {
		b.Fatal(err)
	}
	helper := prepare(b, pool, fencedwrite.Spec{Table: "bench_plain", Key: []string{"id"}, Set: []string{"v"}})
	conn, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Release()

	const (
		plainSQL   = `UPDATE bench_plain SET v = $2 WHERE id = $1`
		fencedSQL  = `UPDATE bench_plain SET v = $2, fence = $3 WHERE id = $1 AND fence < $3`
		guardedSQL = `UPDATE bench_guarded SET v = $2, fence = $3 WHERE id = $1 AND fence < $3`
	)
	one := func(tag pgconn.CommandTag, err error) {
		if err != nil {
			b.Fatal(err)
		}
		if tag.RowsAffected() != 1 {
			b.Fatalf("%d rows updated, want 1", tag.RowsAffected())
		}
	}
	// Warm up plans and caches.
	for i := range 200 {
		one(conn.Exec(ctx, plainSQL, i%rows+1, i))
	}
	var tPlain, tFenced, tHelper, tGuarded time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		id, v := i%rows+1, int64(i)
		var token int64 // set below: grows with every statement, so every fenced write is accepted
		variants := [4]func(){
			func() { one(conn.Exec(ctx, plainSQL, id, v)) },
			func() { one(conn.Exec(ctx, fencedSQL, id, v, token)) },
			func() {
				if _, err := helper.Update(ctx, conn, token, []any{id}, []any{v}); err != nil {
					b.Fatal(err)
				}
			},
			func() { one(conn.Exec(ctx, guardedSQL, id, v, token)) },
		}
		sums := [4]*time.Duration{&tPlain, &tFenced, &tHelper, &tGuarded}
		// Rotate the order every iteration so no variant always runs first
		// (or right after a write to the same row).
		for k := range 4 {
			j := (i + k) % 4
			token = int64(4*i + k + 1)
			if j == 3 {
				// The guard accepts only the lock's latest token: grant it
				// (outside the timed statement).
				grantToken(b, conn, "bench", token)
			}
			s := time.Now()
			variants[j]()
			*sums[j] += time.Since(s)
		}
	}
	b.StopTimer()
	n := float64(b.N)
	us := func(d time.Duration) float64 { return float64(d.Microseconds()) / n }
	b.ReportMetric(us(tPlain), "µs/plain")
	b.ReportMetric(us(tFenced), "µs/fenced")
	b.ReportMetric(us(tHelper), "µs/helper")
	b.ReportMetric(us(tGuarded), "µs/guarded")
	b.ReportMetric(float64(tPlain)/float64(tFenced), "fenced/plain")
	b.ReportMetric(float64(tPlain)/float64(tHelper), "helper/plain")
	b.ReportMetric(float64(tPlain)/float64(tGuarded), "guarded/plain")
}

// BenchmarkGuardBulk isolates the guard's per-row cost: one UPDATE of all
// 1000 rows of a table (fence raised on every row), without and with the guard
// trigger, interleaved on one connection. Reported: µs per row for each and
// their throughput ratio.
//
//	go test -run '^$' -bench GuardBulk -benchtime 300x ./fencedwrite/
func BenchmarkGuardBulk(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b)
	const rows = 1000
	for _, tbl := range []string{"bulk_plain", "bulk_guarded"} {
		mustExec(b, pool, `CREATE TABLE `+tbl+` (id int PRIMARY KEY, v bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`)
		mustExec(b, pool, `INSERT INTO `+tbl+` (id, v) SELECT g, 0 FROM generate_series(1, $1) g`, rows)
	}
	mustExec(b, pool, `INSERT INTO pgfence.locks (name, token) VALUES ('bulk', 1)`)
	if err := fencedwrite.Guard(ctx, pool, "bulk_guarded", fencedwrite.GuardOptions{LockName: "bulk"}); err != nil {
		b.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Release()
	run := func(tbl string, token int64) time.Duration {
		grantToken(b, conn, "bulk", token) // the guard accepts only the lock's latest token
		s := time.Now()
		tag, err := conn.Exec(ctx, `UPDATE `+tbl+` SET v = v + 1, fence = $1 WHERE fence < $1`, token)
		d := time.Since(s)
		if err != nil || tag.RowsAffected() != rows {
			b.Fatalf("%s: %v rows, %v", tbl, tag.RowsAffected(), err)
		}
		return d
	}
	run("bulk_plain", 1)
	run("bulk_guarded", 1)
	// Vacuum between runs is not needed for the comparison: both tables
	// accumulate dead versions at the same rate.
	var tPlain, tGuarded time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tok := int64(i + 2)
		tPlain += run("bulk_plain", tok)
		tGuarded += run("bulk_guarded", tok)
	}
	b.StopTimer()
	perRow := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 / float64(b.N) / rows }
	b.ReportMetric(perRow(tPlain), "µs/row-plain")
	b.ReportMetric(perRow(tGuarded), "µs/row-guarded")
	b.ReportMetric(float64(tPlain)/float64(tGuarded), "guarded/plain")
}

// grantToken sets the lock's latest token as a grant would (the benchmarks
// run as the owner, so they may set it directly).
func grantToken(b *testing.B, db pgfence.DBTX, name string, token int64) {
	b.Helper()
	if _, err := db.Exec(context.Background(), `UPDATE pgfence.locks SET token = $2 WHERE name = $1`, name, token); err != nil {
		b.Fatal(err)
	}
}
