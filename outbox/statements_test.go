package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// stmtCount is what a statementLog saw of one statement: how many times it
// was sent and how many rows its answers had in total.
type stmtCount struct{ calls, rows int }

// statementLog is a pgx.QueryTracer that counts the statements sent through
// a pool by name: the sqlc query name ("-- name: X"), else the first word.
type statementLog struct {
	mu sync.Mutex
	by map[string]*stmtCount
}

type stmtKey struct{}

func (l *statementLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, stmtKey{}, statementName(d.SQL))
}

func (l *statementLog) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	name, _ := ctx.Value(stmtKey{}).(string)
	rows := 0
	if d.Err == nil && d.CommandTag.Select() {
		rows = int(d.CommandTag.RowsAffected())
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.by == nil {
		l.by = map[string]*stmtCount{}
	}
	c := l.by[name]
	if c == nil {
		c = &stmtCount{}
		l.by[name] = c
	}
	c.calls++
	c.rows += rows
}

func (l *statementLog) snapshot() map[string]stmtCount {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]stmtCount{}
	for k, v := range l.by {
		out[k] = *v
	}
	return out
}

func statementName(sql string) string {
	s := strings.TrimSpace(sql)
	if rest, ok := strings.CutPrefix(s, "-- name: "); ok {
		name, _, _ := strings.Cut(rest, " ")
		return name
	}
	if s == "-- ping" || s == ";" {
		return "ping"
	}
	word, _, _ := strings.Cut(s, " ")
	return strings.ToUpper(word)
}

// TestDispatcherStatementsPerDelivery pins the statements a Dispatcher sends
// to deliver intents, counted with a pgx tracer on its pool: one claim
// statement per batch that also returns the intents, one completion
// statement per batch of outcomes, and no statement per delivery besides:
// a delivery does not read its intent again (the claim returned it), so a
// Dispatcher costs the database what the skiplocked.Worker under it costs.
// Each delivery still carries the intent as recorded (key, lock, token,
// payload as PostgreSQL prints the jsonb, attempt).
func TestDispatcherStatementsPerDelivery(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	plain := pgtest.PoolFor(t, dsn)
	locker, err := pglock.New(plain, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = locker.Close() })
	lease, err := locker.Acquire(ctx, "statements", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lease.Release(context.Background()) })
	const n, batch = 200, 8
	err = pgx.BeginFunc(ctx, plain, func(tx pgx.Tx) error {
		for i := range n {
			if _, err := outbox.Enqueue(ctx, tx, lease, outbox.Intent{Topic: "stmts", Key: fmt.Sprintf("k-%d", i),
				Payload: json.RawMessage(fmt.Sprintf(`{ "n":%d, "pad" :"%s" }`, i, strings.Repeat("x", i)))}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	log := &statementLog{}
	cfg.ConnConfig.Tracer = log
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	var mu sync.Mutex
	seen := map[string]int{}
	var bad []string
	var disp *outbox.Dispatcher
	maxKept := 0
	h := func(_ context.Context, d outbox.Delivery) error {
		i, err := strconv.Atoi(strings.TrimPrefix(d.Key, "k-"))
		want := fmt.Sprintf(`{"n": %d, "pad": "%s"}`, i, strings.Repeat("x", i))
		kept := disp.Kept()
		mu.Lock()
		defer mu.Unlock()
		maxKept = max(maxKept, kept)
		seen[d.Key]++
		if err != nil || string(d.Payload) != want || d.LockName != "statements" || d.Token != lease.Token() ||
			d.Topic != "stmts" || d.Attempt != 1 || d.MaxAttempts != 25 || d.ID <= 0 || d.CreatedAt.IsZero() {
			bad = append(bad, fmt.Sprintf("%+v (payload %s, want %s)", d, d.Payload, want))
		}
		return nil
	}
	d, err := outbox.NewDispatcher(pool, "stmts", h, &outbox.Config{Concurrency: batch, BatchSize: batch, PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	disp = d
	sum, err := d.Drain(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Completed != n {
		t.Fatalf("summary %+v, want %d completed", sum, n)
	}
	mu.Lock()
	for i := range n {
		if k := fmt.Sprintf("k-%d", i); seen[k] != 1 {
			t.Errorf("%s delivered %d times, want 1", k, seen[k])
		}
	}
	for _, s := range bad {
		t.Errorf("wrong delivery: %s", s)
	}
	// The intents claimed are kept only until their delivery: at most the
	// claims a Worker holds (Concurrency + 2 × BatchSize), none after Drain.
	if maxKept > 3*batch || d.Kept() != 0 {
		t.Errorf("intents kept: up to %d during the drain (want at most %d), %d after it (want 0)", maxKept, 3*batch, d.Kept())
	}
	mu.Unlock()

	got := log.snapshot()
	names := make([]string, 0, len(got))
	total := 0
	for k, c := range got {
		names = append(names, k)
		if k != "ping" {
			total += c.calls
		}
	}
	slices.Sort(names)
	for _, k := range names {
		t.Logf("%-20s %4d statements, %4d rows", k, got[k].calls, got[k].rows)
	}
	t.Logf("%d statements for %d deliveries (%.3f per delivery)", total, n, float64(total)/n)

	// Only these statements: the claim (with the intents), the batched
	// completions and the drain's checks. A read of the intent per delivery
	// (GetOutboxIntent) is the statement this test exists to keep out.
	allowed := map[string]bool{"ClaimOutboxJobs": true, "CompleteJobs": true, "QueueHasUnfinished": true,
		"QueueHasJobs": true, "HeartbeatJobs": true, "ping": true}
	for _, k := range names {
		if !allowed[k] {
			t.Errorf("the dispatcher sent %s %d times for %d deliveries (%d rows): only claims with their intents, "+
				"completions and the drain's checks are expected", k, got[k].calls, n, got[k].rows)
		}
	}
	claims, completions := got["ClaimOutboxJobs"], got["CompleteJobs"]
	full := (n + batch - 1) / batch
	if claims.rows != n || claims.calls > 2*full+3 {
		t.Errorf("claims: %d statements for %d rows, want %d rows in at most %d statements (batches of %d)",
			claims.calls, claims.rows, n, 2*full+3, batch)
	}
	if completions.rows != n || completions.calls > n {
		t.Errorf("completions: %d statements for %d rows, want %d rows in at most one statement per delivery",
			completions.calls, completions.rows, n)
	}
	if other := total - claims.calls - completions.calls; other > n/10 {
		t.Errorf("%d statements besides claims and completions for %d deliveries, want the drain's few checks (at most %d)",
			other, n, n/10)
	}
}

// TestDispatcherReadsIntentClaimDidNotReturn: a job claimed without its
// intent (the claim statement's snapshot, taken before the claim, did not
// show an intent committed just before the claim took the job) is delivered
// after reading the intent by id, with the same fields; a job that has no
// intent goes to dead with pgfence.ErrNotFound, as before.
func TestDispatcherReadsIntentClaimDidNotReturn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "fallback")
	r, err := outbox.Enqueue(b.ctx, b.pool, l, outbox.Intent{Topic: "fallback", Key: "k-1", Payload: json.RawMessage(`{ "b":1,"a":2 }`),
		MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	var got []outbox.Delivery
	d, err := outbox.NewDispatcher(b.pool, "fallback", func(_ context.Context, d outbox.Delivery) error {
		got = append(got, d)
		return nil
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Claimed with skiplocked.Claim, not by the dispatcher: it kept nothing.
	jobs, err := skiplocked.Claim(b.ctx, b.pool, skiplocked.ClaimParams{Queue: outbox.QueuePrefix + "fallback", Holder: "test",
		Limit: 1, TTL: time.Minute})
	if err != nil || len(jobs) != 1 || jobs[0].ID != r.ID {
		t.Fatalf("claim: %+v, %v; want job %d", jobs, err, r.ID)
	}
	if err := d.Deliver(b.ctx, jobs[0]); err != nil {
		t.Fatal(err)
	}
	want := outbox.Delivery{ID: r.ID, Topic: "fallback", Key: "k-1", LockName: "fallback", Token: l.Token(),
		Payload: json.RawMessage(`{"a": 2, "b": 1}`), Attempt: 1, MaxAttempts: 3, CreatedAt: r.CreatedAt}
	if len(got) != 1 || fmt.Sprint(got[0]) != fmt.Sprint(want) || !got[0].CreatedAt.Equal(r.CreatedAt) {
		t.Fatalf("delivered %+v, want %+v", got, want)
	}

	stray, err := skiplocked.Enqueue(b.ctx, b.pool, skiplocked.EnqueueParams{Queue: outbox.QueuePrefix + "fallback"})
	if err != nil {
		t.Fatal(err)
	}
	jobs, err = skiplocked.Claim(b.ctx, b.pool, skiplocked.ClaimParams{Queue: outbox.QueuePrefix + "fallback", Holder: "test",
		Limit: 1, TTL: time.Minute})
	if err != nil || len(jobs) != 1 || jobs[0].ID != stray[0] {
		t.Fatalf("claim: %+v, %v; want job %d", jobs, err, stray[0])
	}
	err = d.Deliver(b.ctx, jobs[0])
	if !errors.Is(err, pgfence.ErrNotFound) || len(got) != 1 {
		t.Fatalf("job without an intent: %v (handler called %d times), want ErrNotFound and no call", err, len(got))
	}
}
