package fencedwrite_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
)

// waitBlocked returns once some other backend of this database waits for a
// lock (the signal that the statement under test is parked behind tx).
func waitBlocked(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("the fenced write never blocked")
}

// TestRefusalAfterConcurrentCommit: a fenced write waits for a newer grant's
// uncommitted write to the same row; when that commits, the write is refused
// although its statement snapshot still saw the old fence. The explanation
// comes from a second look and is still exact.
func TestRefusalAfterConcurrentCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := invoicesPool(t)
	tbl := prepare(t, pool, fencedwrite.Spec{Table: "invoices", Key: []string{"id"}, Set: []string{"status"}})
	old := grant(t, pool, "l")
	newer := grant(t, pool, "l")

	cases := []struct {
		name  string
		begin func(tx pgfence.DBTX) // the newer grant's write, left uncommitted
		write func() error          // the older grant's write, which blocks
	}{
		{"update", func(tx pgfence.DBTX) {
			mustExec(t, tx, "UPDATE invoices SET status = 'newer', fence = $1 WHERE id = 1", newer)
		}, func() error {
			_, err := tbl.Update(ctx, pool, old, []any{1}, []any{"older"})
			return err
		}},
		{"upsert of a row inserted concurrently", func(tx pgfence.DBTX) {
			mustExec(t, tx, "INSERT INTO invoices (id, status, fence) VALUES (50, 'newer', $1)", newer)
		}, func() error {
			_, err := tbl.Upsert(ctx, pool, old, []any{50}, []any{"older"})
			return err
		}},
		{"fenced_values upsert", func(tx pgfence.DBTX) {
			mustExec(t, tx, `INSERT INTO pgfence.fenced_values (key, value, fence) VALUES ('k', '"newer"', $1)`, newer)
		}, func() error {
			_, err := fencedwrite.UpsertValue(ctx, pool, old, fencedwrite.Strict, "k", json.RawMessage(`"older"`))
			return err
		}},
	}
	for _, c := range cases {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		c.begin(tx)
		done := make(chan error, 1)
		go func() { done <- c.write() }()
		waitBlocked(t, pool)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		wantStale(t, <-done, old, newer)
	}
}
