package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgserver"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// The history checker is shown to catch real bugs: each mutation below is
// one of pgfence's own statements with one condition changed, in a directed
// scenario that the bug breaks. A statement of the door (a lease function)
// is mutated in the test's own database: its definition, read back with
// pg_get_functiondef, is replaced with one edit (CREATE OR REPLACE), and the
// library calls it as it always does. A client statement (read from
// queries/) is sent by a test client in place of the library's. With the
// mutation the checker must report the history illegal and name the
// operation that broke it; with the statement as shipped, the same scenario
// must be legal. The switch is the mutant argument of each scenario: nothing
// in the library's code changes.

// query is one statement of queries/, with its parameters as $n.
type query struct {
	sql    string
	params []string // the parameter names, in $n order
}

var (
	sqlcArg = regexp.MustCompile(`sqlc\.arg\(([a-z_]+)\)|@([a-z_]+)`)
)

// shipped reads statement name from queries/file and applies the edits
// (pairs of old, new; each old must be there): a mutant, or with no edits
// the statement as shipped.
func shipped(t *testing.T, file, name string, edits ...string) query {
	t.Helper()
	b, err := os.ReadFile("../../../queries/" + file)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	i := strings.Index(text, "-- name: "+name+" ")
	if i < 0 {
		t.Fatalf("no statement %s in queries/%s", name, file)
	}
	text = text[i+len("-- name: "):]
	if j := strings.Index(text, "-- name: "); j >= 0 {
		text = text[:j]
	}
	var lines []string
	for _, l := range strings.Split(text, "\n")[1:] {
		if !strings.HasPrefix(strings.TrimSpace(l), "--") {
			lines = append(lines, l)
		}
	}
	sql := strings.Join(lines, "\n")
	for k := 0; k+1 < len(edits); k += 2 {
		if !strings.Contains(sql, edits[k]) {
			t.Fatalf("mutation of %s: %q is not in the statement", name, edits[k])
		}
		sql = strings.Replace(sql, edits[k], edits[k+1], 1)
	}
	q := query{}
	q.sql = sqlcArg.ReplaceAllStringFunc(sql, func(m string) string {
		sub := sqlcArg.FindStringSubmatch(m)
		p := sub[1] + sub[2]
		for n, have := range q.params {
			if have == p {
				return fmt.Sprintf("$%d", n+1)
			}
		}
		q.params = append(q.params, p)
		return fmt.Sprintf("$%d", len(q.params))
	})
	return q
}

// mutateFunction replaces the definition of the function fn (a
// regprocedure, e.g. "pgfence.lock_grant(text, text, bigint, bytea)") in
// pool's database with its definition as migrated with the edits applied
// (pairs of old, new; every occurrence of old is replaced, and old must be
// there), and returns a func that restores the definition as migrated
// through db (pool, or another pool on the same database).
func mutateFunction(t *testing.T, ctx context.Context, pool *pgxpool.Pool, fn string, edits ...string) (restore func(db *pgxpool.Pool)) {
	t.Helper()
	var def string
	if err := pool.QueryRow(ctx, "SELECT pg_catalog.pg_get_functiondef($1::pg_catalog.regprocedure)", fn).Scan(&def); err != nil {
		t.Fatalf("definition of %s: %v", fn, err)
	}
	mutant := def
	for k := 0; k+1 < len(edits); k += 2 {
		if !strings.Contains(mutant, edits[k]) {
			t.Fatalf("mutation of %s: %q is not in its definition:\n%s", fn, edits[k], def)
		}
		mutant = strings.ReplaceAll(mutant, edits[k], edits[k+1])
	}
	if _, err := pool.Exec(ctx, mutant); err != nil {
		t.Fatalf("mutant of %s: %v", fn, err)
	}
	return func(db *pgxpool.Pool) {
		t.Helper()
		if _, err := db.Exec(ctx, def); err != nil {
			t.Fatalf("restoring %s: %v", fn, err)
		}
	}
}

// The door's functions the mutations edit.
const (
	fnLockGrant   = "pgfence.lock_grant(text, text, bigint, bytea)"
	fnLockRelease = "pgfence.lock_release(text, bigint, bytea)"
	fnJobComplete = "pgfence.job_complete(bigint[], bigint[], bytea[])"

	fnFencedValueUpsert = "pgfence.fenced_value_upsert(text, jsonb, bigint, boolean)"
)

// args orders the values of named by q's parameters.
func (q query) args(t *testing.T, named map[string]any) []any {
	t.Helper()
	out := make([]any, len(q.params))
	for i, p := range q.params {
		v, ok := named[p]
		if !ok {
			t.Fatalf("no value for parameter %s", p)
		}
		out[i] = v
	}
	return out
}

// caught asserts that the history of ops is illegal for check and that the
// violation names the operation want (matched by kind, token and call).
func caught(t *testing.T, ops []history.Op, check string, want history.Op) {
	t.Helper()
	vs, _ := history.Check(ops)
	for _, v := range vs {
		if v.Check == check && v.Op.Input.Kind == want.Input.Kind && v.Op.Call == want.Call {
			t.Logf("caught: %v", v)
			return
		}
	}
	dir, _ := history.Save(ops, vs)
	t.Fatalf("the checker did not report %s at %v; it reported %v (history in %s)", check, want, vs, dir)
}

func legal(t *testing.T, ops []history.Op) {
	t.Helper()
	if vs, _ := history.Check(ops); len(vs) != 0 {
		dir, _ := history.Save(ops, vs)
		t.Fatalf("the shipped statements gave an illegal history: %v (history in %s)", vs, dir)
	}
}

// last returns the last recorded operation of kind.
func last(ops []history.Op, kind history.Kind) history.Op {
	for i := len(ops) - 1; i >= 0; i-- {
		if ops[i].Input.Kind == kind {
			return ops[i]
		}
	}
	return history.Op{}
}

func TestHistoryMutationsCaught(t *testing.T) {
	t.Parallel()
	for _, m := range []struct {
		name  string
		check string
		kind  history.Kind
		run   func(t *testing.T, pool *pgxpool.Pool, mutant bool) []history.Op
	}{
		{"release not conditional on the token", "lease", history.Release, releaseAnyToken},
		{"grant ignoring expiry", "lease", history.Acquire, grantIgnoringExpiry},
		{"strict write with <=", "row", history.Write, strictLessOrEqual},
		{"handoff to an ended wait", "lease", history.Inspect, handoffToEndedWait},
		{"completion under a stale claim", "job", history.Complete, completeStaleClaim},
	} {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			for _, mutant := range []bool{false, true} {
				pool := pgtest.PoolFor(t, pgtest.DSN(t))
				ops := m.run(t, pool, mutant)
				if mutant {
					caught(t, ops, m.check, last(ops, m.kind))
				} else {
					legal(t, ops)
				}
			}
		})
	}
}

// releaseAnyToken: holder m's lease 1 expires, m takes lease 2, and a late
// release of lease 1 runs; without the token condition it ends lease 2.
func releaseAnyToken(t *testing.T, pool *pgxpool.Pool, mutant bool) []history.Op {
	ctx := testCtx(t)
	if mutant {
		mutateFunction(t, ctx, pool, fnLockRelease, "AND l.token = lock_release.token", "")
	}
	rec := history.New()
	c := rec.NewClient()
	l := newPollLocker(t, pool, "m")
	first := tryUntilGranted(t, ctx, c, l, "mut", 300*time.Millisecond)
	<-first.Done() // its local deadline passed
	for {
		second, err := c.Acquire(ctx, l, "mut", time.Minute, false)
		if err == nil {
			defer second.Release(ctx)
			break
		}
		if !errors.Is(err, pgfence.ErrLocked) {
			t.Fatal(err)
		}
		sleep(ctx, 5*time.Millisecond) // the database's expiry is a little later than the local deadline
	}
	if err := c.ReleaseToken(ctx, l, "mut", first.Token()); err != nil && !errors.Is(err, pgfence.ErrLost) {
		t.Fatal(err)
	}
	return rec.Ops()
}

// grantIgnoringExpiry: a holds the lease for a minute and b's grant runs;
// without the expiry condition it is granted.
func grantIgnoringExpiry(t *testing.T, pool *pgxpool.Pool, mutant bool) []history.Op {
	ctx := testCtx(t)
	rec := history.New()
	a, b := rec.NewClient(), rec.NewClient()
	held, err := a.Acquire(ctx, newPollLocker(t, pool, "a"), "mut", time.Minute, false)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release(ctx)
	if mutant {
		mutateFunction(t, ctx, pool, fnLockGrant, "AND (l.holder IS NULL OR l.expires_at <= now())", "")
	}
	if _, err := b.Acquire(ctx, newPollLocker(t, pool, "b"), "mut", time.Minute, false); err != nil && !errors.Is(err, pgfence.ErrLocked) {
		t.Fatal(err)
	}
	return rec.Ops()
}

// strictLessOrEqual: one grant writes a row twice in strict mode; with <=
// the second write is accepted.
func strictLessOrEqual(t *testing.T, pool *pgxpool.Pool, mutant bool) []history.Op {
	ctx := testCtx(t)
	rec := history.New()
	c := rec.NewClient()
	lease, err := c.Acquire(ctx, newPollLocker(t, pool, "a"), "mut", time.Minute, false)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)
	if mutant {
		mutateFunction(t, ctx, pool, fnFencedValueUpsert, "WHERE t.fence < excluded.fence", "WHERE t.fence <= excluded.fence")
	}
	q := shipped(t, "fencedwrite.sql", "FencedValueUpsert")
	for i, v := range []string{"first", "second"} {
		p := rec.Begin(c.ID(), history.Input{Kind: history.Write, Key: history.RowKey("row"), Lock: "mut", Token: lease.Token(), Mode: "strict", Value: v})
		var (
			applied, inserted bool
			fence             int64
			at                time.Time
		)
		if err := pool.QueryRow(ctx, q.sql, q.args(t, map[string]any{"key": "row", "value": fmt.Sprintf("%q", v), "token": lease.Token()})...).Scan(&applied, &fence, &at, &inserted); err != nil {
			t.Fatal(err)
		}
		switch {
		case applied:
			p.End(history.Output{Outcome: history.OK})
		case fence == lease.Token():
			p.End(history.Output{Outcome: history.Applied})
		default:
			p.End(history.Output{Outcome: history.Stale, Fence: fence})
		}
		if i == 0 && !applied {
			t.Fatalf("the first write was refused (fence %d)", fence)
		}
	}
	return rec.Ops()
}

// handoffToEndedWait: b waits and is handed the lease by a's release; b's
// release then runs; without the condition that a queued wait is still
// waiting, it hands the lease to b's own ended wait, and a read of the lock
// sees a grant nobody asked for.
func handoffToEndedWait(t *testing.T, pool *pgxpool.Pool, mutant bool) []history.Op {
	ctx := testCtx(t)
	rec := history.New()
	ca, cb, cr := rec.NewClient(), rec.NewClient(), rec.NewClient()
	la := newPollLocker(t, pool, "a")
	lb, err := pglock.New(pool, &pglock.Config{Holder: "b"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lb.Close() })
	held, err := ca.Acquire(ctx, la, "mut", time.Minute, false)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		lease *pglock.Lease
		err   error
	}
	res := make(chan result, 1)
	go func() {
		l, err := cb.Acquire(ctx, lb, "mut", time.Minute, true)
		res <- result{l, err}
	}()
	waitFor(t, time.Minute, "b's wait in the queue", func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.lock_queue WHERE name = 'mut' AND granted_token IS NULL").Scan(&n)
		return n == 1, err
	})
	if err := ca.Release(ctx, held); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	if mutant {
		// b's wait marked the lock row, so its release takes the full path
		// (the queue lookup), where the mutation is.
		mutateFunction(t, ctx, pool, fnLockRelease, "WHERE q.name = lock_release.name COLLATE \"default\" AND q.granted_token IS NULL AND q.alive_until > now()",
			"WHERE q.name = lock_release.name COLLATE \"default\" AND q.alive_until > now()")
	}
	if err := cb.Release(ctx, r.lease); err != nil {
		t.Fatal(err)
	}
	if _, err := cr.Inspect(ctx, pool, "mut"); err != nil {
		t.Fatal(err)
	}
	return rec.Ops()
}

// completeStaleClaim: x's claim expires, y claims the job, and x completes
// it; without the claim conditions of pgfence.job_complete x's completion is
// accepted.
func completeStaleClaim(t *testing.T, pool *pgxpool.Pool, mutant bool) []history.Op {
	ctx := testCtx(t)
	rec := history.New()
	x, y := rec.NewClient(), rec.NewClient()
	jobIDs, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "mut"})
	if err != nil {
		t.Fatal(err)
	}
	known := []int64{jobIDs[0]}
	xs, err := x.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "mut", Holder: "x", Limit: 1, TTL: 100 * time.Millisecond}, known)
	if err != nil || len(xs) != 1 {
		t.Fatalf("x's claim: %v, %v", xs, err)
	}
	for {
		ys, err := y.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "mut", Holder: "y", Limit: 1, TTL: time.Minute}, known)
		if err != nil {
			t.Fatal(err)
		}
		if len(ys) == 1 {
			break
		}
		sleep(ctx, 10*time.Millisecond) // x's claim has not expired on the database clock yet
	}
	if mutant {
		// Both claim conditions go: y's claim replaced the token and the
		// key's hash, and either alone refuses x.
		mutateFunction(t, ctx, pool, fnJobComplete, "AND j.claim_token = c.t AND j.claim_key_hash = sha256(c.k)", "")
	}
	q := shipped(t, "skiplocked.sql", "CompleteJobs")
	p := rec.Begin(x.ID(), history.Input{Kind: history.Complete, Key: history.JobKey(jobIDs[0]), Token: xs[0].ClaimToken})
	rows, err := pool.Query(ctx, q.sql, q.args(t, map[string]any{"ids": []int64{jobIDs[0]}, "claim_tokens": []int64{xs[0].ClaimToken},
		"keys": [][]byte{xs[0].ClaimKey[:]}})...)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) == 1 {
		p.End(history.Output{Outcome: history.OK})
	} else {
		p.End(history.Output{Outcome: history.Lost})
	}
	return rec.Ops()
}

// TestHistoryMutationTokenTwiceAfterCrash: a grant committed without waiting
// for the WAL flush (synchronous_commit off, the mutation) is lost in a
// crash, and the token is issued again after the restart; the checker
// reports the second grant of the same token.
func TestHistoryMutationTokenTwiceAfterCrash(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	// The WAL writer waits 10 s: an asynchronous commit is not flushed
	// before the crash that follows it by a few milliseconds.
	srv, err := pgserver.Start(ctx, pgserver.Options{NoContainers: true, Settings: map[string]string{
		"wal_writer_delay": "10s", "wal_writer_flush_after": "1GB",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Stop() })
	setup, err := pgxpool.New(ctx, srv.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if err := migrations.UpPool(ctx, setup); err != nil {
		t.Fatal(err)
	}
	setup.Close()
	rec := history.New()
	var restore func(*pgxpool.Pool) // the mutant grant of the attempt before
	for attempt := 1; ; attempt++ {
		pool, err := pgxpool.New(ctx, srv.DSN)
		if err != nil {
			t.Fatal(err)
		}
		if restore != nil {
			restore(pool) // the first grant of each attempt is durable
		}
		c := rec.NewClient()
		l := newPollLocker(t, pool, "a")
		// A durable grant that expires: the mutant grants the next token.
		first := tryUntilGranted(t, ctx, c, l, "crash", 100*time.Millisecond)
		<-first.Done()
		// Mutated after the durable grant, restored only after the crash:
		// the restoring commit would flush the mutant grant.
		restore = mutateFunction(t, ctx, pool, fnLockGrant,
			"PERFORM set_config('synchronous_commit', 'on', true);", "PERFORM set_config('synchronous_commit', 'off', true);")
		lb := newPollLocker(t, pool, "b")
		var token int64
		for {
			lease, err := c.Acquire(ctx, lb, "crash", time.Minute, false)
			if err == nil {
				token = lease.Token()
				break
			}
			if !errors.Is(err, pgfence.ErrLocked) && !errors.Is(err, pgfence.ErrSlowGrant) {
				t.Fatal(err)
			}
			sleep(ctx, 5*time.Millisecond)
		}
		if err := srv.Kill(syscall.SIGQUIT); err != nil {
			t.Fatal(err)
		}
		l.Close()
		lb.Close()
		pool.Close()
		if err := srv.Restart(ctx); err != nil {
			t.Fatal(err)
		}
		check, err := pgx.Connect(ctx, srv.DSN)
		if err != nil {
			t.Fatal(err)
		}
		var now int64
		err = check.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = 'crash'").Scan(&now)
		check.Close(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if now < token {
			break // the grant was lost: the bug is there to be caught
		}
		if attempt == 5 {
			t.Fatalf("the asynchronous grant survived 5 crashes: the mutation could not be shown")
		}
	}
	pool, err := pgxpool.New(ctx, srv.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	c := rec.NewClient()
	again, err := c.Acquire(ctx, newPollLocker(t, pool, "c"), "crash", time.Minute, false)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Release(ctx)
	caught(t, rec.Ops(), "lease", last(rec.Ops(), history.Acquire))
}

// tryUntilGranted takes name for ttl, again while a loaded machine returns
// the grant too late to use (ErrSlowGrant, given back).
func tryUntilGranted(t *testing.T, ctx context.Context, c *history.Client, l *pglock.Locker, name string, ttl time.Duration) *pglock.Lease {
	t.Helper()
	for {
		lease, err := c.Acquire(ctx, l, name, ttl, false)
		if err == nil {
			return lease
		}
		if !errors.Is(err, pgfence.ErrSlowGrant) {
			t.Fatal(err)
		}
	}
}

// newPollLocker returns a polling Locker of holder on pool, closed when t
// ends.
func newPollLocker(t *testing.T, pool *pgxpool.Pool, holder string) *pglock.Locker {
	t.Helper()
	l, err := pglock.New(pool, &pglock.Config{Holder: holder, PollOnly: true, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// testCtx is a minute-long context ended with t.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}
