package promobserve_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/observe/promobserve"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// value returns a counter's value or a histogram's sample count for the
// series of name whose labels include want (each of them present).
func value(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.Metric {
			matched := 0
			for _, lp := range m.Label {
				if v, ok := want[lp.GetName()]; ok {
					if v != lp.GetValue() {
						continue next
					}
					matched++
				}
			}
			if matched != len(want) {
				continue // a wanted label is missing
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return float64(m.GetHistogram().GetSampleCount())
		}
	}
	return 0
}

// exists reports whether reg has a series of name whose labels include want.
func exists(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) bool {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.Metric {
			n := 0
			for _, lp := range m.Label {
				if v, ok := want[lp.GetName()]; ok && v == lp.GetValue() {
					n++
				}
			}
			if n == len(want) {
				return true
			}
		}
	}
	return false
}

// TestMetricsFromRealOperations drives pglock and fencedwrite against
// PostgreSQL and checks the recorded metrics and their labels.
func TestMetricsFromRealOperations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	a, err := pglock.New(pool, &pglock.Config{Holder: "a", Metrics: m, PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := pglock.New(pool, &pglock.Config{Holder: "b", Metrics: m, PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()

	// Granted, then locked.
	lease, err := a.TryAcquire(ctx, "job", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.TryAcquire(ctx, "job", time.Minute); !errors.Is(err, pgfence.ErrLocked) {
		t.Fatalf("b: %v", err)
	}
	if v := value(t, reg, metricdefs.LeaseAcquireSeconds, map[string]string{"outcome": "granted"}); v != 1 {
		t.Errorf("acquire{granted} = %v, want 1", v)
	}
	if v := value(t, reg, metricdefs.LeaseAcquireSeconds, map[string]string{"outcome": "locked"}); v != 1 {
		t.Errorf("acquire{locked} = %v, want 1", v)
	}

	// A renewal refused because someone else took over: lost, renewal_refused.
	if _, err := pool.Exec(ctx, "UPDATE pgfence.locks SET expires_at = now() - interval '1 second' WHERE name = 'job'"); err != nil {
		t.Fatal(err)
	}
	taken, err := b.TryAcquire(ctx, "job", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := lease.Renew(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("renew: %v", err)
	}
	if v := value(t, reg, metricdefs.LeasesLostTotal, map[string]string{"reason": metricdefs.LostRenewalRefused}); v != 1 {
		t.Errorf("lost{renewal_refused} = %v, want 1", v)
	}
	if v := value(t, reg, metricdefs.LeaseRenewalsTotal, map[string]string{"outcome": metricdefs.RenewRefused}); v != 1 {
		t.Errorf("renewals{refused} = %v, want 1", v)
	}
	if err := taken.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// A lease that runs out locally: lost, deadline_passed.
	short, err := a.TryAcquire(ctx, "short", 150*time.Millisecond)
	slow := 0
	for ; errors.Is(err, pgfence.ErrSlowGrant) && slow < 5; slow++ {
		short, err = a.TryAcquire(ctx, "short", 150*time.Millisecond) // given back on a loaded machine
	}
	if err != nil {
		t.Fatal(err)
	}
	<-short.Done()
	if v := value(t, reg, metricdefs.LeasesLostTotal, map[string]string{"reason": metricdefs.LostDeadline}); v != 1 {
		t.Errorf("lost{deadline_passed} = %v, want 1", v)
	}
	if v := value(t, reg, metricdefs.LeaseHoldSeconds, nil); v != 3 {
		t.Errorf("hold time samples = %v, want 3 (lost, released, lost)", v)
	}

	// Fenced writes: one applied, then stale, already applied, not found.
	if _, err := pool.Exec(ctx, "CREATE TABLE items (id int PRIMARY KEY, v int, fence bigint NOT NULL DEFAULT 0); INSERT INTO items VALUES (1, 0, 0)"); err != nil {
		t.Fatal(err)
	}
	tbl, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "items", Key: []string{"id"}, Set: []string{"v"}, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Update(ctx, pool, 5, []any{1}, []any{10}); err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Update(ctx, pool, 4, []any{1}, []any{11}); !errors.Is(err, pgfence.ErrStaleToken) {
		t.Fatalf("stale: %v", err)
	}
	if _, err := tbl.Update(ctx, pool, 5, []any{1}, []any{12}); !errors.Is(err, pgfence.ErrAlreadyApplied) {
		t.Fatalf("replay: %v", err)
	}
	if _, err := tbl.Update(ctx, pool, 6, []any{2}, []any{13}); !errors.Is(err, pgfence.ErrNotFound) {
		t.Fatalf("missing: %v", err)
	}
	// The table label is schema.name as resolved, though the spec said "items".
	var schema string
	if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		t.Fatal(err)
	}
	table := schema + ".items"
	// Prepare created the table's series at 0, before any refusal.
	if !exists(t, reg, metricdefs.FencedRefusedTotal, map[string]string{"table": table, "reason": metricdefs.RefusedGuard}) {
		t.Errorf("no %s{table=%q,reason=guard} series after Prepare", metricdefs.FencedRefusedTotal, table)
	}
	for reason, want := range map[string]float64{metricdefs.RefusedStale: 1, metricdefs.RefusedAlreadyApplied: 1, metricdefs.RefusedNotFound: 1, metricdefs.RefusedGuard: 0} {
		if v := value(t, reg, metricdefs.FencedRefusedTotal, map[string]string{"table": table, "reason": reason}); v != want {
			t.Errorf("rejected{%s,%s} = %v, want %v", table, reason, v, want)
		}
	}
	if v := value(t, reg, metricdefs.FencedWritesTotal, map[string]string{"table": table}); v != 1 {
		t.Errorf("fenced writes{%s} = %v, want 1", table, v)
	}
}

// TestWorkerMetrics runs a skiplocked.Worker over three jobs, one of which
// fails permanently, and checks the queue-labelled counters.
func TestWorkerMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{`{"n":1}`, `{"n":2}`, `{"n":3,"bad":true}`} {
		if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "mail", Payload: []byte(p)}); err != nil {
			t.Fatal(err)
		}
	}
	handled := make(chan struct{}, 3)
	w, err := skiplocked.NewWorker(pool, "mail", func(ctx context.Context, j skiplocked.Job) error {
		defer func() { handled <- struct{}{} }()
		if strings.Contains(string(j.Payload), "bad") {
			return skiplocked.Permanent(errors.New("bad payload"))
		}
		return nil
	}, &skiplocked.Config{Metrics: m, Concurrency: 3})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(rctx) }()
	for range 3 {
		select {
		case <-handled:
		case <-time.After(30 * time.Second):
			t.Fatal("jobs not handled")
		}
	}
	// Wait until the outcomes are written, then stop the worker.
	deadline := time.Now().Add(30 * time.Second)
	for {
		var open int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.jobs WHERE state NOT IN ('completed', 'dead')").Scan(&open); err != nil {
			t.Fatal(err)
		}
		if open == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d jobs still open", open)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}
	q := map[string]string{"queue": "mail"}
	if !exists(t, reg, metricdefs.ClaimsLostTotal, q) {
		t.Errorf("no %s{queue=mail} series: NewWorker did not create it", metricdefs.ClaimsLostTotal)
	}
	for name, want := range map[string]float64{
		metricdefs.RowsClaimedTotal: 3, metricdefs.RowsCompletedTotal: 2, metricdefs.RowsFailedTotal: 1,
		metricdefs.RowsDeadTotal: 1, metricdefs.ClaimsLostTotal: 0,
	} {
		if v := value(t, reg, name, q); v != want {
			t.Errorf("%s{queue=mail} = %v, want %v", name, v, want)
		}
	}
	if v := value(t, reg, metricdefs.ClaimSeconds, q); v < 1 {
		t.Errorf("claim latency samples = %v", v)
	}
}

// queueSeries counts the series of reg's Prometheus exposition that carry
// a queue label, by queue: one per counter, and for a histogram one per
// bucket (with +Inf), _sum and _count.
func queueSeries(t *testing.T, reg *prometheus.Registry) map[string]int {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := map[string]int{}
	for _, f := range fams {
		for _, m := range f.Metric {
			for _, lp := range m.Label {
				if lp.GetName() != "queue" {
					continue
				}
				if h := m.GetHistogram(); h != nil {
					n[lp.GetValue()] += len(h.GetBucket()) + 3
				} else {
					n[lp.GetValue()]++
				}
			}
		}
	}
	return n
}

// TestSeriesPerQueueDocumented drains queues with real Workers and checks
// what docs/observability.md and docs/importer.md say each queue costs in
// client-side series: the number per queue a Worker drained with Metrics,
// that a Worker on a queue name already run adds none, and that a Worker
// without Metrics adds none.
func TestSeriesPerQueueDocumented(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	drain := func(queue string, metrics *promobserve.Metrics) {
		t.Helper()
		if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: queue}); err != nil {
			t.Fatal(err)
		}
		cfg := &skiplocked.Config{}
		if metrics != nil {
			cfg.Metrics = metrics
		}
		w, err := skiplocked.NewWorker(pool, queue, func(context.Context, skiplocked.Job) error { return nil }, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Drain(ctx); err != nil {
			t.Fatal(err)
		}
	}
	drain("catalogue/2024-06-01", m)
	perQueue := queueSeries(t, reg)["catalogue/2024-06-01"]
	if perQueue == 0 {
		t.Fatal("no series for the drained queue")
	}
	drain("catalogue/2024-06-01", m) // the same name again: no new series
	drain("catalogue/2024-06-02", nil)
	if got := queueSeries(t, reg); len(got) != 1 || got["catalogue/2024-06-01"] != perQueue {
		t.Errorf("after a second Worker on the same queue and one without Metrics: series by queue %v, want only %d for catalogue/2024-06-01", got, perQueue)
	}
	drain("catalogue/2024-06-03", m)
	if got := queueSeries(t, reg)["catalogue/2024-06-03"]; got != perQueue {
		t.Errorf("a second queue name: %d series, want %d", got, perQueue)
	}

	for _, doc := range []string{"observability.md", "importer.md"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "docs", doc))
		if errors.Is(err, fs.ErrNotExist) {
			t.Skipf("docs/%s not found: the module is outside its repository", doc)
		}
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(strings.Fields(string(b)), " ")
		if want := fmt.Sprintf("%d series", perQueue); !strings.Contains(text, want) {
			t.Errorf("docs/%s does not say a queue costs %q", doc, want)
		}
		if strings.Contains(text, "Queues cost nothing") {
			t.Errorf("docs/%s says queues cost nothing; each costs %d series", doc, perQueue)
		}
	}
}
