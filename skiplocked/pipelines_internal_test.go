package skiplocked

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The claim and outcome statements a worker overlaps stay within its pool:
// one connection is the listener's and one the renewals', and a TxHandler
// worker's handlers hold one each. NewWorker's godoc promises the full three
// claims and two outcomes from MaxConns 7 and one of each at pgxpool's
// default of 4. No statement is sent: the pool never connects.
func TestPipelinesWithinPool(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		maxConns                int32
		tx                      bool
		concurrency, batch, cap int
		claimers, writers       int
	}{
		{maxConns: 4, concurrency: 4, batch: 4, cap: 100, claimers: 1, writers: 1},
		{maxConns: 6, concurrency: 4, batch: 4, cap: 100, claimers: 2, writers: 2},
		{maxConns: 7, concurrency: 4, batch: 4, cap: 100, claimers: 3, writers: 2},
		{maxConns: 50, concurrency: 4, batch: 4, cap: 100, claimers: 3, writers: 2},
		// Capacity for two whole batches only: two claimers.
		{maxConns: 50, concurrency: 4, batch: 4, cap: 8, claimers: 2, writers: 2},
		// TxHandler: 4 handler transactions + 2 leave 1 connection.
		{maxConns: 7, tx: true, concurrency: 4, batch: 4, cap: 100, claimers: 1, writers: 1},
		{maxConns: 11, tx: true, concurrency: 4, batch: 4, cap: 100, claimers: 3, writers: 2},
	} {
		cfg, err := pgxpool.ParseConfig("postgres://pgfence-test.invalid/none")
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = c.maxConns
		pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		wc := &Config{Concurrency: c.concurrency, BatchSize: c.batch}
		var w *Worker
		if c.tx {
			w, err = NewTxWorker(pool, "q", func(context.Context, pgx.Tx, Job) error { return nil }, wc)
		} else {
			w, err = NewWorker(pool, "q", func(context.Context, Job) error { return nil }, wc)
		}
		if err != nil {
			t.Fatalf("MaxConns %d tx %v: %v", c.maxConns, c.tx, err)
		}
		claimers, writers := w.pipelines(c.cap)
		if claimers != c.claimers || writers != c.writers {
			t.Errorf("MaxConns %d tx %v capacity %d: %d claimers, %d writers; want %d, %d",
				c.maxConns, c.tx, c.cap, claimers, writers, c.claimers, c.writers)
		}
		// Never more statements than connections left for them.
		left := int(c.maxConns) - 2
		if c.tx {
			left -= c.concurrency
		}
		if left >= 2 && claimers+writers > left {
			t.Errorf("MaxConns %d tx %v: %d + %d statements over %d connections", c.maxConns, c.tx, claimers, writers, left)
		}
	}
}
