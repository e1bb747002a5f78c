package pglock

import (
	"context"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// The many-lease functions run with enable_seqscan off, and so does every
// function they call (lock_release, for a handoff). A statement among them
// whose only plan is a sequential scan gets that scan's disable cost (10^10),
// and a plan that costly is JIT-compiled: about 0.4 s per call, once for
// every handoff in a release batch (00010 read pgfence.handoff_secret that
// way before its primary key was used). auto_explain, its plans sent to the
// client as notices, shows the plan of every nested statement: none may
// carry the disable cost, nor JIT.
func TestLeaseStatementsNoDisabledPlan(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, time.Minute)
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	var (
		mu    sync.Mutex
		plans []string
	)
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if strings.HasPrefix(n.Message, "duration:") {
			mu.Lock()
			plans = append(plans, n.Message)
			mu.Unlock()
		}
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		for _, s := range []string{
			"LOAD 'auto_explain'",
			"SET auto_explain.log_min_duration = 0",
			"SET auto_explain.log_nested_statements = on",
			"SET auto_explain.log_level = notice",
		} {
			if _, err := c.Exec(ctx, s); err != nil {
				return err
			}
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	keyA := []byte("0123456789abcdef")
	keyB := []byte("fedcba9876543210")
	const ttl = int64(60_000_000)
	exec := func(sql string, args ...any) {
		t.Helper()
		rows, err := pool.Query(ctx, sql, args...)
		if err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	names := []string{"plan-a", "plan-b"}
	exec("SELECT * FROM pgfence.lock_grant_many($1, 'a', $2, $3)", names, []int64{ttl, ttl}, keyA)
	var tokens []int64
	for _, n := range names {
		var tok int64
		if err := pool.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = $1", n).Scan(&tok); err != nil {
			t.Fatal(err)
		}
		tokens = append(tokens, tok)
	}
	exec("SELECT * FROM pgfence.lock_renew_many($1, $2, $3, $4)", names, tokens, keyA, []int64{ttl, ttl})
	// b queues for plan-a: the batch release hands plan-a to it and frees
	// plan-b.
	exec("SELECT * FROM pgfence.lock_wait('plan-a', 'b', $1, $2, 11, 12)", ttl, keyB)
	exec("SELECT * FROM pgfence.lock_release_many($1, $2, $3)", names, tokens, keyA)
	exec("SELECT pgfence.lock_handoff_key($1)", keyB)
	exec("SELECT * FROM pgfence.lock_handed(11, 12, $1)", keyB)

	mu.Lock()
	defer mu.Unlock()
	if len(plans) < 6 {
		t.Fatalf("%d plans from auto_explain, want one per statement and nested statement", len(plans))
	}
	disabled := regexp.MustCompile(`cost=\d{11,}`)
	for _, p := range plans {
		if disabled.MatchString(p) || strings.Contains(p, "JIT:") {
			t.Errorf("a plan with a disabled node's cost or JIT:\n%s", p)
		}
	}
	joined := strings.Join(plans, "\n")
	if !strings.Contains(joined, "handoff_secret") {
		t.Errorf("no plan reads pgfence.handoff_secret: the handoff was not exercised")
	}
}
