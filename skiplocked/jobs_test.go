package skiplocked_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

func TestEnqueueAndClaim(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)

	low := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "q", Payload: json.RawMessage(`{"a":1}`), Priority: 5})
	if low.State != skiplocked.StateAvailable || low.Attempts != 0 || low.MaxAttempts != 25 || low.ClaimToken != 0 {
		t.Fatalf("enqueued job = %+v", low)
	}
	high := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "q", Priority: -1})
	if string(high.Payload) != "{}" {
		t.Fatalf("default payload = %s, want {}", high.Payload)
	}
	later := enqueueOne(t, pool, skiplocked.EnqueueParams{Queue: "q", RunAt: time.Now().Add(time.Hour)})
	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "other"}); err != nil {
		t.Fatal(err)
	}

	jobs, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "q", Holder: "w1", Limit: 10, TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs) != 2 || jobs[0].ID != high.ID || jobs[1].ID != low.ID {
		t.Fatalf("claimed %+v, want [high, low] and not the future or other-queue job", jobs)
	}
	for _, j := range jobs {
		if j.State != skiplocked.StateRunning || j.Holder != "w1" || j.ClaimToken <= 0 || j.Attempts != 1 ||
			!j.ClaimExpiresAt.After(j.UpdatedAt.Add(59*time.Second)) {
			t.Fatalf("claimed job = %+v", j)
		}
	}
	if jobs[1].ClaimToken == jobs[0].ClaimToken {
		t.Fatalf("tokens not distinct: %d %d", jobs[0].ClaimToken, jobs[1].ClaimToken)
	}
	if string(jobs[1].Payload) != `{"a": 1}` {
		t.Fatalf("payload = %s", jobs[1].Payload)
	}
	again, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "q", Holder: "w2", Limit: 10, TTL: time.Minute})
	if err != nil || len(again) != 0 {
		t.Fatalf("second claim = %v, %v; want nothing (claims held, future job not due)", again, err)
	}
	if err := skiplocked.Complete(ctx, pool, jobs[0].Ref()); err != nil {
		t.Fatal(err)
	}
	done := mustJob(t, pool, high.ID)
	if done.State != skiplocked.StateCompleted || done.FinishedAt.IsZero() || !done.ClaimExpiresAt.IsZero() {
		t.Fatalf("completed job = %+v", done)
	}
	// Completing twice succeeds (a retry after a lost reply), but any other
	// outcome of the ended claim is refused: the claim already ended.
	if err := skiplocked.Complete(ctx, pool, jobs[0].Ref()); err != nil {
		t.Fatalf("second complete err = %v, want nil (idempotent)", err)
	}
	err = skiplocked.Release(ctx, pool, jobs[0].Ref())
	if l := lostErrors(err); len(l) != 1 || l[0].Token != jobs[0].ClaimToken ||
		l[0].Reason != fmt.Sprintf("job %d: claim already ended (completed), state completed", jobs[0].ID) {
		t.Fatalf("release after complete err = %v", err)
	}
	if got := mustJob(t, pool, later.ID); got.State != skiplocked.StateAvailable {
		t.Fatalf("future job = %+v", got)
	}
	if err := skiplocked.Complete(ctx, pool, skiplocked.ClaimRef{JobID: 999999, Token: 1, Key: [16]byte{1}}); !errors.Is(err, pgfence.ErrNotFound) || !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("complete missing job err = %v", err)
	}
}

// TestStaleWorkerCannotLand: A's claim expires, B re-claims the row; A's
// complete, fail, heartbeat and release are refused with ErrLost and the
// row is unchanged; B completes it.
func TestStaleWorkerCannotLand(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "stale", 1, 3)

	a, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "stale", Holder: "A", Limit: 1, TTL: 300 * time.Millisecond})
	if err != nil || len(a) != 1 {
		t.Fatalf("A claim = %v, %v", a, err)
	}
	// Before expiry B gets nothing.
	if b, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "stale", Holder: "B", Limit: 1, TTL: time.Minute}); err != nil || len(b) != 0 {
		t.Fatalf("B claim before expiry = %v, %v", b, err)
	}
	time.Sleep(400 * time.Millisecond) // let A's claim expire on the database clock
	b, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "stale", Holder: "B", Limit: 1, TTL: time.Minute})
	if err != nil || len(b) != 1 || b[0].ID != a[0].ID {
		t.Fatalf("B claim after expiry = %v, %v", b, err)
	}
	if b[0].ClaimToken <= a[0].ClaimToken || b[0].Attempts != 2 || !strings.Contains(b[0].LastError, "expired") {
		t.Fatalf("B's claim %+v does not supersede A's token %d", b[0], a[0].ClaimToken)
	}
	before := mustJob(t, pool, a[0].ID)

	checkLost := func(op string, err error) {
		t.Helper()
		var lost *pgfence.Error
		if !errors.Is(err, pgfence.ErrLost) || !errors.As(err, &lost) {
			t.Fatalf("%s by stale A: err = %v, want ErrLost", op, err)
		}
		if !strings.HasPrefix(lost.Reason, fmt.Sprintf("job %d: reclaimed by token %d,", a[0].ID, b[0].ClaimToken)) ||
			lost.Holder != "B" || lost.Token != a[0].ClaimToken {
			t.Fatalf("%s: lost = %+v", op, lost)
		}
	}
	checkLost("complete", skiplocked.Complete(ctx, pool, a[0].Ref()))
	_, err = skiplocked.Fail(ctx, pool, a[0].Ref(), skiplocked.FailParams{Error: "boom"})
	checkLost("fail", err)
	_, err = skiplocked.Renew(ctx, pool, time.Minute, a[0].Ref())
	checkLost("renew", err)
	checkLost("release", skiplocked.Release(ctx, pool, a[0].Ref()))
	err = skiplocked.Complete(ctx, pool, a[0].Ref())
	if l := lostErrors(err); !errors.Is(err, pgfence.ErrLost) || len(l) != 1 || l[0].Token != a[0].ClaimToken ||
		!strings.HasPrefix(l[0].Reason, fmt.Sprintf("job %d:", a[0].ID)) || l[0].Op != "skiplocked.Complete" {
		t.Fatalf("Complete by A = %v (a refused claim must be an error that names it)", err)
	}
	if exp, err := skiplocked.Renew(ctx, pool, time.Minute, a[0].Ref()); len(lostErrors(err)) != 1 || len(exp) != 1 || !exp[0].IsZero() {
		t.Fatalf("Renew by A = %v, %v", exp, err)
	}
	if err := skiplocked.Release(ctx, pool, a[0].Ref()); len(lostErrors(err)) != 1 {
		t.Fatalf("Release by A = %v", err)
	}
	if after := mustJob(t, pool, a[0].ID); !reflect.DeepEqual(before, after) {
		t.Fatalf("row changed by stale worker:\nbefore %+v\nafter  %+v", before, after)
	}
	if err := skiplocked.Complete(ctx, pool, b[0].Ref()); err != nil {
		t.Fatalf("B complete: %v", err)
	}
	if got := mustJob(t, pool, a[0].ID); got.State != skiplocked.StateCompleted || got.Holder != "B" {
		t.Fatalf("final row %+v", got)
	}
}

// An expired claim that nobody re-claimed can still be completed: the token
// decides, not the clock.
func TestExpiredButNotReclaimedCompletes(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "late", 1, 3)
	a, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "late", Holder: "A", Limit: 1, TTL: 100 * time.Millisecond})
	if err != nil || len(a) != 1 {
		t.Fatal(a, err)
	}
	time.Sleep(150 * time.Millisecond)
	if err := skiplocked.Complete(ctx, pool, a[0].Ref()); err != nil {
		t.Fatalf("late complete with the current token: %v", err)
	}
}

func TestFailRetryBackoffAndDead(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "dl", 1, 2)
	claim := func() skiplocked.Job {
		t.Helper()
		js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "dl", Holder: "w", Limit: 5, TTL: time.Minute})
		if err != nil || len(js) != 1 {
			t.Fatalf("claim = %v, %v", js, err)
		}
		return js[0]
	}
	j := claim()
	var dbNow time.Time
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	got, err := skiplocked.Fail(ctx, pool, j.Ref(), skiplocked.FailParams{Error: "first", RetryIn: skiplocked.DefaultBackoff(j.Attempts) * 3600})
	if err != nil {
		t.Fatal(err)
	}
	if got.State != skiplocked.StateAvailable || got.LastError != "first" || got.Attempts != 1 {
		t.Fatalf("after first failure: %+v", got)
	}
	if d := got.RunAt.Sub(dbNow); d < 59*time.Minute || d > 61*time.Minute {
		t.Fatalf("run_at pushed by %s, want ~1h", d)
	}
	// Not claimable until run_at.
	if js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "dl", Holder: "w", Limit: 5, TTL: time.Minute}); err != nil || len(js) != 0 {
		t.Fatalf("claim during backoff = %v, %v", js, err)
	}
	if _, err := pool.Exec(ctx, "UPDATE pgfence.jobs SET run_at = now() WHERE id = $1", ids[0]); err != nil {
		t.Fatal(err)
	}
	j = claim()
	if j.Attempts != 2 {
		t.Fatalf("attempts = %d, want 2", j.Attempts)
	}
	got, err = skiplocked.Fail(ctx, pool, j.Ref(), skiplocked.FailParams{Error: "second and last"})
	if err != nil {
		t.Fatal(err)
	}
	if got.State != skiplocked.StateDead || got.LastError != "second and last" || got.FinishedAt.IsZero() {
		t.Fatalf("after max attempts: %+v", got)
	}
	if js, _ := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "dl", Holder: "w", Limit: 5, TTL: time.Minute}); len(js) != 0 {
		t.Fatalf("dead job claimed again: %+v", js)
	}

	// GiveUp sends a job to dead on its first failure.
	ids = enqueueN(t, pool, "dl", 1, 10)
	j = claim()
	got, err = skiplocked.Fail(ctx, pool, j.Ref(), skiplocked.FailParams{Error: "bad input", GiveUp: true})
	if err != nil || got.State != skiplocked.StateDead || got.ID != ids[0] {
		t.Fatalf("give up = %+v, %v", got, err)
	}
}

// An expired claim on a job with no attempts left goes dead instead of being
// handed out again.
func TestExpiredClaimOnLastAttemptGoesDead(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "exp", 1, 1)
	if js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "exp", Holder: "crashy", Limit: 1, TTL: 100 * time.Millisecond}); err != nil || len(js) != 1 {
		t.Fatal(js, err)
	}
	time.Sleep(150 * time.Millisecond)
	js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "exp", Holder: "w", Limit: 1, TTL: time.Minute})
	if err != nil || len(js) != 0 {
		t.Fatalf("claim = %v, %v; want nothing", js, err)
	}
	j := mustJob(t, pool, ids[0])
	if j.State != skiplocked.StateDead || !strings.Contains(j.LastError, "crashy") || !strings.Contains(j.LastError, "expired") {
		t.Fatalf("job = %+v", j)
	}
}

func TestHeartbeatAndRelease(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "hb", 2, 5)
	js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "hb", Holder: "w", Limit: 2, TTL: 200 * time.Millisecond})
	if err != nil || len(js) != 2 {
		t.Fatal(js, err)
	}
	exp, err := skiplocked.Renew(ctx, pool, time.Minute, js[0].Ref())
	if err != nil || len(exp) != 1 || !exp[0].After(js[0].ClaimExpiresAt.Add(50*time.Second)) {
		t.Fatalf("heartbeat = %v, %v", exp, err)
	}
	time.Sleep(300 * time.Millisecond)
	// js[1] expired and is claimable; js[0] was extended and is not.
	other, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "hb", Holder: "w2", Limit: 2, TTL: time.Minute})
	if err != nil || len(other) != 1 || other[0].ID != js[1].ID {
		t.Fatalf("claim after heartbeat = %+v, %v", other, err)
	}
	if err := skiplocked.Release(ctx, pool, js[0].Ref()); err != nil {
		t.Fatal(err)
	}
	j := mustJob(t, pool, js[0].ID)
	if j.State != skiplocked.StateAvailable || j.Attempts != 0 || !j.ClaimExpiresAt.IsZero() {
		t.Fatalf("released job = %+v", j)
	}
	again, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "hb", Holder: "w3", Limit: 2, TTL: time.Minute})
	if err != nil || len(again) != 1 || again[0].ID != js[0].ID || again[0].ClaimToken <= other[0].ClaimToken {
		t.Fatalf("claim after release = %+v, %v", again, err)
	}
}

// Killing a worker's connection: in-transaction claims come back at once;
// leased claims come back after expiry; nothing is lost.
func TestKilledWorkerClaimsComeBack(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	enqueueN(t, pool, "txk", 10, 5)
	enqueueN(t, pool, "lease", 10, 5)

	// In-transaction claim on a dedicated connection, then pg_terminate_backend.
	victim, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close(context.Background())
	tx, err := victim.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held, err := skiplocked.ClaimTx(ctx, tx, "txk", 6)
	if err != nil || len(held) != 6 {
		t.Fatalf("victim claim = %v, %v", held, err)
	}
	rest := claimTxIDs(t, pool, "txk", 10)
	if len(rest) != 4 {
		t.Fatalf("while victim holds 6, others claim %d rows, want 4", len(rest))
	}
	var killed bool
	if err := pool.QueryRow(ctx, "SELECT pg_terminate_backend($1)", victim.PgConn().PID()).Scan(&killed); err != nil || !killed {
		t.Fatalf("terminate: %v %v", killed, err)
	}
	// The next statement on the victim fails with a connection error.
	if _, err := skiplocked.ClaimTx(ctx, tx, "txk", 1); !pgfence.IsRetryable(err) || errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("claim on killed connection err = %v, want a retryable connection error", err)
	}
	// The server releases the rows as soon as the backend is gone: poll for it
	// (termination is asynchronous) with no sleep standing in for a signal.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if got := claimTxIDs(t, pool, "txk", 10); len(got) == 10 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("after kill, others claim %d rows, want 10", len(got))
		}
		time.Sleep(10 * time.Millisecond)
	}

	// Leased claims survive the connection: they come back only after expiry.
	victim2, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer victim2.Close(context.Background())
	leased, err := skiplocked.Claim(ctx, victim2, skiplocked.ClaimParams{Queue: "lease", Holder: "victim", Limit: 10, TTL: 500 * time.Millisecond})
	if err != nil || len(leased) != 10 {
		t.Fatal(leased, err)
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", victim2.PgConn().PID()); err != nil {
		t.Fatal(err)
	}
	if js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "lease", Holder: "rescuer", Limit: 10, TTL: time.Minute}); err != nil || len(js) != 0 {
		t.Fatalf("before expiry rescuer claims %d (%v), want 0", len(js), err)
	}
	time.Sleep(600 * time.Millisecond)
	js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "lease", Holder: "rescuer", Limit: 10, TTL: time.Minute})
	if err != nil || len(js) != 10 {
		t.Fatalf("after expiry rescuer claims %d (%v), want 10", len(js), err)
	}
	refs := make([]skiplocked.ClaimRef, len(js))
	for i, j := range js {
		refs[i] = j.Ref()
	}
	if err := skiplocked.Complete(ctx, pool, refs...); err != nil {
		t.Fatalf("complete = %v", err)
	}
	if n := countState(t, pool, "lease", skiplocked.StateCompleted); n != 10 {
		t.Fatalf("completed %d, want 10", n)
	}
}

// claimTxIDs claims up to limit jobs in a transaction and rolls back.
func claimTxIDs(t *testing.T, pool *pgxpool.Pool, queue string, limit int) []int64 {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	js, err := skiplocked.ClaimTx(ctx, tx, queue, limit)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, len(js))
	for i, j := range js {
		ids[i] = j.ID
	}
	return ids
}

func TestJobsInTransaction(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	ids := enqueueN(t, pool, "tx", 3, 2)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	js, err := skiplocked.ClaimTx(ctx, tx, "tx", 2)
	if err != nil || len(js) != 2 || js[0].ID != ids[0] || js[1].ID != ids[1] {
		t.Fatalf("claim = %+v, %v", js, err)
	}
	if err := skiplocked.CompleteTx(ctx, tx, js[0].ID); err != nil {
		t.Fatal(err)
	}
	f, err := skiplocked.FailTx(ctx, tx, js[1].ID, skiplocked.FailParams{Error: "nope", RetryIn: time.Hour})
	if err != nil || f.State != skiplocked.StateAvailable || f.Attempts != 1 {
		t.Fatalf("fail = %+v, %v", f, err)
	}
	if err := skiplocked.CompleteTx(ctx, tx, 424242); !errors.Is(err, pgfence.ErrNotFound) {
		t.Fatalf("complete unknown = %v", err)
	}
	// Another transaction skips the two locked rows and takes the third.
	if other := claimTxIDs(t, pool, "tx", 5); len(other) != 1 || other[0] != ids[2] {
		t.Fatalf("other tx claimed %v, want [%d]", other, ids[2])
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if j := mustJob(t, pool, ids[0]); j.State != skiplocked.StateCompleted {
		t.Fatalf("job 0 = %+v", j)
	}
	// A rollback changes nothing.
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	js, err = skiplocked.ClaimTx(ctx, tx2, "tx", 5)
	if err != nil || len(js) != 1 || js[0].ID != ids[2] {
		t.Fatalf("claim = %+v, %v (job 1 is in backoff)", js, err)
	}
	if err := skiplocked.CompleteTx(ctx, tx2, ids[2]); err != nil {
		t.Fatal(err)
	}
	if err := tx2.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if j := mustJob(t, pool, ids[2]); j.State != skiplocked.StateAvailable || j.Attempts != 0 {
		t.Fatalf("after rollback job = %+v", j)
	}
	// Second failure in a transaction uses the last attempt: dead.
	if _, err := pool.Exec(ctx, "UPDATE pgfence.jobs SET run_at = now() WHERE id = $1", ids[1]); err != nil {
		t.Fatal(err)
	}
	tx3, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx3.Rollback(ctx)
	// FailTx changes only a job this transaction claimed (migration 00026).
	if js, err := skiplocked.ClaimTx(ctx, tx3, "tx", 5); err != nil || !slices.ContainsFunc(js, func(j skiplocked.Job) bool { return j.ID == ids[1] }) {
		t.Fatalf("claim = %+v, %v; want job %d among them", js, err, ids[1])
	}
	f, err = skiplocked.FailTx(ctx, tx3, ids[1], skiplocked.FailParams{Error: "again"})
	if err != nil || f.State != skiplocked.StateDead || f.LastError != "again" {
		t.Fatalf("second fail = %+v, %v", f, err)
	}
}

// TestClaimUsesPartialIndex has auto_explain report, as notices, the plans
// of the statements pgfence.job_claim runs when Claim calls it, over a table
// with 100k finished rows: they must read the partial indexes and never scan
// the table, so claim latency does not grow as finished rows accumulate.
func TestClaimUsesPartialIndex(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(ctx, `
		INSERT INTO pgfence.jobs (queue, state, finished_at, attempts)
		SELECT 'idx', 'completed', now(), 1 FROM generate_series(1, 100000)`); err != nil {
		t.Fatal(err)
	}
	enqueueN(t, pool, "idx", 50, 5)
	if _, err := pool.Exec(ctx, "ANALYZE pgfence.jobs"); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var notices []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		notices = append(notices, n.Message)
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	for _, set := range []string{
		"LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0", "SET auto_explain.log_nested_statements = on",
		"SET auto_explain.log_analyze = on", "SET auto_explain.log_buffers = on", "SET auto_explain.log_level = notice",
		"SET client_min_messages = notice",
	} {
		if _, err := conn.Exec(ctx, set); err != nil {
			t.Fatalf("%s: %v", set, err)
		}
	}
	start := time.Now()
	js, err := skiplocked.Claim(ctx, conn, skiplocked.ClaimParams{Queue: "idx", Holder: "w", Limit: 10, TTL: time.Minute})
	if err != nil || len(js) != 10 {
		t.Fatal(js, err)
	}
	elapsed := time.Since(start)
	mu.Lock()
	var plan string
	for _, n := range notices {
		if strings.Contains(n, "FOR UPDATE SKIP LOCKED") {
			plan = n // the claim statement inside pgfence.job_claim
		}
	}
	mu.Unlock()
	if plan == "" {
		t.Fatalf("auto_explain reported no plan of the claim statement; notices: %q", notices)
	}
	for _, want := range []string{"jobs_available_idx", "jobs_running_expiry_idx", "jobs_pkey"} {
		if !strings.Contains(plan, want) {
			t.Errorf("claim plan does not use %s", want)
		}
	}
	if strings.Contains(plan, "Seq Scan") {
		t.Errorf("claim plan scans the table")
	}
	t.Logf("claim of 10 among 100k finished rows: %s\n%s", elapsed, plan)
}

func TestConcurrentLeasedClaimsNoDuplicates(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	dsn := pgtest.DSN(t)
	// lock_timeout makes any wait for a row lock fail loudly: SKIP LOCKED
	// claimers must never wait for each other, nor for the blocker, which
	// holds 100 rows locked until every worker has finished.
	pool := noWaitPool(t, ctx, dsn, 9)
	const rows, workers, blocked = 20000, 8, 100
	ids := enqueueN(t, pool, "drain", rows, 5)
	unblock := holdRows(t, ctx, pool, "SELECT 1 FROM pgfence.jobs WHERE queue = 'drain' ORDER BY id LIMIT $1 FOR UPDATE", blocked)

	var mu sync.Mutex
	processedBy := make(map[int64]string, rows)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		name := "worker-" + string(rune('A'+w))
		wg.Go(func() {
			for {
				js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "drain", Holder: name, Limit: 50, TTL: time.Minute})
				if err != nil {
					errs <- err
					return
				}
				if len(js) == 0 {
					return
				}
				refs := make([]skiplocked.ClaimRef, len(js))
				mu.Lock()
				for i, j := range js {
					if prev, dup := processedBy[j.ID]; dup {
						mu.Unlock()
						errs <- errors.New("job processed twice: by " + prev + " and " + name)
						return
					}
					processedBy[j.ID] = name
					refs[i] = j.Ref()
				}
				mu.Unlock()
				if err := skiplocked.Complete(ctx, pool, refs...); err != nil {
					errs <- errors.Join(err, errors.New("claims lost while held"))
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// The workers skipped the blocked rows and stopped; free them and drain
	// the rest with one more worker.
	if len(processedBy) != rows-blocked {
		t.Fatalf("processed %d rows while %d were locked, want %d", len(processedBy), blocked, rows-blocked)
	}
	unblock()
	for {
		js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "drain", Holder: "worker-Z", Limit: 50, TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		if len(js) == 0 {
			break
		}
		refs := make([]skiplocked.ClaimRef, len(js))
		for i, j := range js {
			if prev, dup := processedBy[j.ID]; dup {
				t.Fatalf("job %d processed twice: by %s and worker-Z", j.ID, prev)
			}
			processedBy[j.ID] = "worker-Z"
			refs[i] = j.Ref()
		}
		if err := skiplocked.Complete(ctx, pool, refs...); err != nil {
			t.Fatal(err)
		}
	}
	if len(processedBy) != rows {
		t.Fatalf("processed %d rows, want %d", len(processedBy), rows)
	}
	// Per row: completed once, by the worker the test recorded.
	dbRows, err := pool.Query(ctx, "SELECT id, holder, attempts, state FROM pgfence.jobs WHERE queue = 'drain'")
	if err != nil {
		t.Fatal(err)
	}
	perWorker := map[string]int{}
	n := 0
	for dbRows.Next() {
		var id int64
		var by, state string
		var attempts int
		if err := dbRows.Scan(&id, &by, &attempts, &state); err != nil {
			t.Fatal(err)
		}
		if state != "completed" || attempts != 1 || processedBy[id] != by {
			t.Fatalf("job %d: state %s attempts %d holder %s, test saw %s", id, state, attempts, by, processedBy[id])
		}
		perWorker[by]++
		n++
	}
	if err := dbRows.Err(); err != nil {
		t.Fatal(err)
	}
	if n != len(ids) {
		t.Fatalf("%d rows in table, want %d", n, len(ids))
	}
	t.Logf("rows per worker: %v", perWorker)
}

// TestClaimKey: a claim changes only with its own key. With the right job id
// and token but another key, Complete, Renew, Release and Fail, alone and
// in a batch, are refused as lost claims (never taken for a call
// already done, nor for a row locked for a moment) and the job is unchanged;
// then the claimer's own key completes it.
func TestClaimKey(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.Pool(t)
	enqueueN(t, pool, "key", 1, 1)
	js, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "key", Holder: "w", Limit: 1, TTL: time.Minute})
	if err != nil || len(js) != 1 {
		t.Fatal(js, err)
	}
	j := js[0]
	if j.ClaimKey == ([16]byte{}) {
		t.Fatal("Claim returned no claim key")
	}
	var stored []byte
	if err := pool.QueryRow(ctx, "SELECT claim_key_hash FROM pgfence.jobs WHERE id = $1", j.ID).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if h := sha256.Sum256(j.ClaimKey[:]); !bytes.Equal(stored, h[:]) || bytes.Contains(stored, j.ClaimKey[:]) {
		t.Fatalf("claim_key_hash %x is not the SHA-256 of the key", stored)
	}
	forged := j.Ref()
	forged.Key[15] ^= 1
	before := mustJob(t, pool, j.ID)
	errs := map[string]error{
		"complete": skiplocked.Complete(ctx, pool, forged),
		"release":  skiplocked.Release(ctx, pool, forged),
	}
	_, errs["renew"] = skiplocked.Renew(ctx, pool, time.Hour, forged)
	_, errs["fail"] = skiplocked.Fail(ctx, pool, forged, skiplocked.FailParams{Error: "forged", GiveUp: true})
	errs["complete many"] = skiplocked.Complete(ctx, pool, forged, forged)
	_, errs["renew many"] = skiplocked.Renew(ctx, pool, time.Hour, forged, forged)
	for op, err := range errs {
		lost := lostErrors(err)
		ok := len(lost) > 0
		for _, l := range lost { // every refused claim names the key
			ok = ok && strings.Contains(l.Reason, "claim key")
		}
		if !errors.Is(err, pgfence.ErrLost) || !ok {
			t.Errorf("%s with another key: %v, want a lost claim naming the key", op, err)
		}
	}
	after := mustJob(t, pool, j.ID)
	if after.State != skiplocked.StateRunning || !after.ClaimExpiresAt.Equal(before.ClaimExpiresAt) ||
		after.ClaimToken != j.ClaimToken || after.Attempts != before.Attempts || after.LastError != before.LastError {
		t.Fatalf("a call with another key changed the job: before %+v, after %+v", before, after)
	}
	if err := skiplocked.Complete(ctx, pool, j.Ref()); err != nil {
		t.Fatalf("complete with the claim's key: %v", err)
	}
	// Retried with the right key: already done. With another key: not.
	if err := skiplocked.Complete(ctx, pool, j.Ref()); err != nil {
		t.Fatalf("retried complete: %v", err)
	}
	if err := skiplocked.Complete(ctx, pool, forged); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("complete of a completed job with another key: %v, want a lost claim", err)
	}
}
