package cli

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// TestJobsCommand: `pgfence jobs` counts every queue per state, --queue one
// queue, and a queue with no jobs (a misspelt name) is not found, never an
// empty, finished queue.
func TestJobsCommand(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	var ps []skiplocked.EnqueueParams
	for range 3 {
		ps = append(ps, skiplocked.EnqueueParams{Queue: "catalogue/2024-06-01", MaxAttempts: 1})
	}
	ps = append(ps, skiplocked.EnqueueParams{Queue: "emails"})
	if _, err := skiplocked.Enqueue(ctx, pool, ps...); err != nil {
		t.Fatal(err)
	}
	jobs, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{Queue: "catalogue/2024-06-01", Holder: "w", Limit: 3, TTL: time.Minute})
	if err != nil || len(jobs) != 3 {
		t.Fatal(jobs, err)
	}
	if err := skiplocked.Complete(ctx, pool, jobs[0].Ref()); err != nil {
		t.Fatal(err)
	}
	if _, err := skiplocked.Fail(ctx, pool, jobs[1].Ref(), skiplocked.FailParams{Error: "bad file"}); err != nil {
		t.Fatal(err)
	}
	// A queue name written with plain SQL, with a terminal escape in it.
	if _, err := pool.Exec(ctx, "INSERT INTO pgfence.jobs (queue) VALUES (E'evil\\x1b[2J')"); err != nil {
		t.Fatal(err)
	}

	r := run(t, dsn, "jobs")
	if r.code != 0 {
		t.Fatalf("jobs: %+v", r)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	want := [][]string{
		{"QUEUE", "AVAILABLE", "SCHEDULED", "RUNNING", "EXPIRED", "COMPLETED", "DEAD", "DRAINED"},
		{"catalogue/2024-06-01", "0", "0", "1", "0", "1", "1", "no"},
		{"emails", "1", "0", "0", "0", "0", "0", "no"},
		{`"evil\x1b[2J"`, "1", "0", "0", "0", "0", "0", "no"},
	}
	if len(lines) != len(want) {
		t.Fatalf("jobs printed:\n%s", r.stdout)
	}
	for i, l := range lines {
		if got := strings.Fields(l); strings.Join(got, " ") != strings.Join(want[i], " ") {
			t.Errorf("line %d = %q, want %q", i, got, want[i])
		}
	}
	if strings.Contains(r.stdout, "\x1b") {
		t.Errorf("a terminal escape reached the output: %q", r.stdout)
	}

	if err := skiplocked.Complete(ctx, pool, jobs[2].Ref()); err != nil {
		t.Fatal(err)
	}
	r = run(t, dsn, "jobs", "--queue", "catalogue/2024-06-01", "--json")
	var views []jobsView
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &views) != nil || len(views) != 1 {
		t.Fatalf("jobs --queue --json: %+v", r)
	}
	if v := views[0]; v.Completed != 2 || v.Dead != 1 || v.Unfinished != 0 || !v.Drained || v.Queue != "catalogue/2024-06-01" {
		t.Fatalf("view %+v, want 2 completed, 1 dead, drained", v)
	}

	r = run(t, dsn, "jobs", "--queue", "catalog/2024-06-01")
	if r.code != ExitNotFound || !strings.Contains(r.stderr, "has no jobs") {
		t.Fatalf("misspelt queue: %+v, want exit %d", r, ExitNotFound)
	}
	r = run(t, dsn, "jobs", "--queue", "")
	if r.code != ExitUsage {
		t.Fatalf("empty queue name: %+v, want exit %d", r, ExitUsage)
	}
	r = run(t, pgtest.EmptyDSN(t), "jobs")
	if r.code != ExitNotMigrated {
		t.Fatalf("unmigrated database: %+v", r)
	}
}
