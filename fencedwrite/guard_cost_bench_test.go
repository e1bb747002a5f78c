package fencedwrite_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// guardCostVersion is the version of migration 00007_pgfence_guard_cost.sql
// (the cheaper generated trigger functions); BenchmarkGuardCost rolls its
// "before" database back to the version before it.
const guardCostVersion = 7

// BenchmarkGuardCost measures the guard's cost before and after migration
// 00007 (the cheaper generated trigger functions), side by side in one run:
// one database is rolled back to migration 6 (guardCostVersion-1), so its
// guards come from the first version's generator ("before"), the other has
// every migration ("after"). Each has an unguarded table, a strict guard (fixed lock name), a
// reentrant guard (lock name from a column) written with a new token, and the
// same reentrant guard written again with the token the rows already carry
// (the fence kept equal). Every iteration runs each of the eight (database,
// table) statements once, in an order that rotates, on one connection per
// database, so drift in machine load hits all of them alike.
//
//   - single-row: one UPDATE of one row by primary key per statement (row i
//     mod 1000; a new token every 1000 iterations, granted outside the timing);
//   - 1000-row: one UPDATE of all 1000 rows per statement (a new token every
//     iteration).
//
// Reported: µs per statement of each, and the throughput ratio of each guarded
// table against the unguarded one of its database (plain time ÷ guarded
// time: 1 is free). When the harness runs the server from local binaries,
// also the CPU time the server process of each statement used (cpu-µs/...,
// from /proc/<pid>/schedstat) and the same ratios of it (cpu:...): on a busy
// machine the time a statement waits for a CPU swamps what it costs, and the
// CPU time does not count the wait.
//
//	go test -run '^$' -bench GuardCost/single-row -benchtime 3000x ./fencedwrite/
//	go test -run '^$' -bench GuardCost/1000-row -benchtime 100x ./fencedwrite/
//
// PGFENCE_GUARDCOST_BEFORE=N rolls the "before" database back to version N
// instead (10: before 00011, the reentrant mark trigger's WHEN clause).
func BenchmarkGuardCost(b *testing.B) {
	b.Run("single-row", func(b *testing.B) { benchGuardCost(b, false) })
	b.Run("1000-row", func(b *testing.B) { benchGuardCost(b, true) })
}

// guardCostDB is one database of BenchmarkGuardCost.
type guardCostDB struct {
	name string
	conn *pgxpool.Conn
	cpu  func() time.Duration // CPU time of the connection's server process; nil when not measurable
}

// serverCPU returns a function reading the CPU time the server process of
// conn has used, or nil when the server is not a local process of this
// machine (a container, another host) or /proc has no schedstat.
func serverCPU(b *testing.B, conn *pgxpool.Conn) func() time.Duration {
	if !pgtest.Server(b).Local() {
		return nil
	}
	path := fmt.Sprintf("/proc/%d/schedstat", conn.Conn().PgConn().PID())
	read := func() (time.Duration, bool) {
		raw, err := os.ReadFile(path)
		if err != nil {
			return 0, false
		}
		fields := strings.Fields(string(raw))
		if len(fields) == 0 {
			return 0, false
		}
		ns, err := strconv.ParseInt(fields[0], 10, 64)
		return time.Duration(ns), err == nil
	}
	if _, ok := read(); !ok {
		return nil
	}
	return func() time.Duration {
		d, ok := read()
		if !ok {
			b.Fatalf("read %s", path)
		}
		return d
	}
}

var guardCostVariants = []struct {
	table, cmp string
}{
	{"gc_plain", "<"},
	{"gc_strict", "<"},
	{"gc_reentrant", "<="},
	{"gc_kept", "<="},
}

// guardCostBefore is the version of BenchmarkGuardCost's "before" database.
func guardCostBefore(b *testing.B) int64 {
	v := os.Getenv("PGFENCE_GUARDCOST_BEFORE")
	if v == "" {
		return guardCostVersion - 1
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 1 {
		b.Fatalf("PGFENCE_GUARDCOST_BEFORE=%q: want a migration version", v)
	}
	return n
}

func benchGuardCost(b *testing.B, bulk bool) {
	ctx := context.Background()
	const rows = 1000
	var dbs []guardCostDB
	for _, name := range []string{"before", "after"} {
		pool := pgtest.PoolFor(b, pgtest.DSN(b))
		if name == "before" {
			db := stdlib.OpenDBFromPool(pool)
			if err := migrations.DownTo(ctx, db, guardCostBefore(b)); err != nil {
				b.Fatal(err)
			}
			_ = db.Close()
		}
		mustExec(b, pool, `INSERT INTO pgfence.locks (name, token) VALUES ('bench', 1)`)
		for _, v := range guardCostVariants {
			mustExec(b, pool, `CREATE TABLE `+v.table+` (id int PRIMARY KEY, lock text NOT NULL DEFAULT 'bench',
				v bigint NOT NULL DEFAULT 0, fence bigint NOT NULL DEFAULT 0)`)
			mustExec(b, pool, `INSERT INTO `+v.table+` (id) SELECT g FROM generate_series(1, $1) g`, rows)
		}
		for table, opts := range map[string]fencedwrite.GuardOptions{
			"gc_strict":    {LockName: "bench"},
			"gc_reentrant": {LockNameColumn: "lock", Mode: fencedwrite.Reentrant},
			"gc_kept":      {LockNameColumn: "lock", Mode: fencedwrite.Reentrant},
		} {
			if err := fencedwrite.Guard(ctx, pool, table, opts); err != nil {
				b.Fatal(err)
			}
		}
		mustExec(b, pool, "VACUUM ANALYZE")
		conn, err := pool.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Release()
		dbs = append(dbs, guardCostDB{name, conn, serverCPU(b, conn)})
	}
	if fn := queryString(b, dbs[1].conn, `SELECT array_to_string(p.proconfig, ';') FROM pg_proc p
		JOIN pgfence.guarded_tables g ON p.proname = g.trigger_function WHERE g.relid = 'gc_strict'::regclass`); guardCostBefore(b) < guardCostVersion && fn == queryString(b, dbs[0].conn, `
		SELECT array_to_string(p.proconfig, ';') FROM pg_proc p
		JOIN pgfence.guarded_tables g ON p.proname = g.trigger_function WHERE g.relid = 'gc_strict'::regclass`) {
		b.Fatalf("the databases before and after 00007 generate the same trigger function (%s)", fn)
	}

	token := int64(1)
	// newToken grants the next token in both databases and writes it into
	// every row of gc_kept, whose statements then keep the fence equal.
	newToken := func() {
		token++
		for _, db := range dbs {
			mustExec(b, db.conn, `UPDATE pgfence.locks SET token = $1 WHERE name = 'bench'`, token)
			mustExec(b, db.conn, `UPDATE gc_kept SET fence = $1`, token)
		}
	}
	type stmt struct {
		db  int
		sql string
	}
	var stmts []stmt
	for i := range dbs {
		for _, v := range guardCostVariants {
			where := "fence " + v.cmp + " $1"
			if !bulk {
				where = "id = $2 AND " + where
			}
			stmts = append(stmts, stmt{i, `UPDATE ` + v.table + ` SET v = v + 1, fence = $1 WHERE ` + where})
		}
	}
	cpu := dbs[0].cpu != nil && dbs[1].cpu != nil
	run := func(s stmt, id int) (wall, used time.Duration) {
		args := []any{token}
		if !bulk {
			args = append(args, id)
		}
		var cpu0 time.Duration
		if cpu {
			cpu0 = dbs[s.db].cpu()
		}
		start := time.Now()
		tag, err := dbs[s.db].conn.Exec(ctx, s.sql, args...)
		wall = time.Since(start)
		if cpu {
			used = dbs[s.db].cpu() - cpu0
		}
		want := int64(rows)
		if !bulk {
			want = 1
		}
		if err != nil || tag.RowsAffected() != want {
			b.Fatalf("%s on %s: %d rows, %v", s.sql, dbs[s.db].name, tag.RowsAffected(), err)
		}
		return wall, used
	}
	// Warm up: one round of every statement.
	newToken()
	for _, s := range stmts {
		run(s, 1)
	}
	newToken()
	sums, cpus := make([]time.Duration, len(stmts)), make([]time.Duration, len(stmts))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		id := i%rows + 1
		if bulk || (i > 0 && id == 1) {
			b.StopTimer()
			newToken()
			b.StartTimer()
		}
		for k := range stmts {
			j := (i + k) % len(stmts)
			wall, used := run(stmts[j], id)
			sums[j] += wall
			cpus[j] += used
		}
	}
	b.StopTimer()
	for j, s := range stmts {
		v := guardCostVariants[j%len(guardCostVariants)]
		name := dbs[s.db].name + ":" + v.table[3:]
		plain := j - j%len(guardCostVariants)
		b.ReportMetric(float64(sums[j].Nanoseconds())/1000/float64(b.N), "µs/"+name)
		if j != plain {
			b.ReportMetric(float64(sums[plain])/float64(sums[j]), name+"/plain")
		}
		if cpu {
			b.ReportMetric(float64(cpus[j].Nanoseconds())/1000/float64(b.N), "cpu-µs/"+name)
			if j != plain {
				b.ReportMetric(float64(cpus[plain])/float64(cpus[j]), "cpu:"+name+"/plain")
			}
		}
	}
}
