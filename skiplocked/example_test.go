package skiplocked_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"os/signal"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/skiplocked"
)

// In-transaction claims on an application table: the transaction is the lock.
func ExampleClaimTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	claimer, err := skiplocked.NewTxClaimer(ctx, pool, skiplocked.Spec{
		Table:   "import_rows",
		Key:     []string{"id"},
		Where:   []skiplocked.Cond{{Column: "status", Op: skiplocked.OpEq, Value: "pending"}},
		OrderBy: []skiplocked.Order{{Column: "id"}},
		Limit:   100,
	})
	if err != nil {
		log.Fatal(err) // ErrUnknownTable, ErrUnknownColumn, ErrInvalidIdentifier, ...
	}
	for {
		var n int
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			ids, err := skiplocked.ClaimTx(ctx, tx, claimer, pgx.RowTo[int64])
			if err != nil {
				return err
			}
			n = len(ids)
			// ... import the rows, writing through tx ...
			_, err = tx.Exec(ctx, "UPDATE import_rows SET status = 'done' WHERE id = ANY($1)", ids)
			return err
		})
		if err != nil {
			log.Fatal(err)
		}
		if n == 0 {
			return // drained
		}
	}
}

// Leased claims for work done outside a transaction.
func ExampleClaim() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{
		Queue: "imports", Payload: json.RawMessage(`{"file":"prices-0042.csv"}`),
	}); err != nil {
		log.Fatal(err)
	}
	jobs, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{
		Queue: "imports", Holder: "importer-1", Limit: 10, TTL: time.Minute,
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, j := range jobs {
		// ... long work, calling skiplocked.Renew(ctx, pool, j.Ref(), time.Minute) now and then ...
		err := skiplocked.Complete(ctx, pool, j.Ref())
		if errors.Is(err, skiplocked.ErrClaimLost) {
			// The claim expired and another worker holds the job now:
			// nothing was written; do not report success.
			continue
		}
		if err != nil {
			log.Fatal(err)
		}
	}
}

// A worker loop with graceful shutdown on SIGINT.
func ExampleWorker() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	w, err := skiplocked.NewWorker(pool, "imports", func(ctx context.Context, j skiplocked.Job) error {
		var args struct{ File string }
		if err := json.Unmarshal(j.Payload, &args); err != nil {
			return skiplocked.Permanent(err) // dead at once, no retry
		}
		// ... import args.File, honouring ctx ...
		return nil
	}, &skiplocked.Config{Concurrency: 8, BatchSize: 10, ClaimTTL: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.Run(ctx); err != nil { // returns after a graceful stop
		log.Fatal(err)
	}
}

// Exactly-once effects: the handler writes through tx, and the Worker
// completes the job in the same transaction. Drain returns when the batch's
// queue is empty.
func ExampleNewTxWorker() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")) // pool_max_conns >= Concurrency + 2
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	w, err := skiplocked.NewTxWorker(pool, "catalogue/2024-06-01", func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
		// The effect: commits with the job's completion, or not at all.
		_, err := tx.Exec(ctx, "INSERT INTO applied_files (job_id, payload) VALUES ($1, $2)", j.ID, j.Payload)
		return err
	}, &skiplocked.Config{
		Concurrency: 4,
		OnClaimLost: func(ctx context.Context, j skiplocked.Job, err *skiplocked.ClaimLostError) {
			log.Printf("job %d taken over by %s: %v", j.ID, err.Holder, err)
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	sum, err := w.Drain(ctx)
	if err != nil {
		log.Fatal(err) // ErrNotDrained or ErrNoJobs: the batch is not known to be done
	}
	d, err := skiplocked.QueueDepth(ctx, pool, "catalogue/2024-06-01")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("this worker completed %d; the batch: %d completed, %d dead\n", sum.Completed, d.Completed, d.Dead)
}

func ExampleIsRetryable() {
	fmt.Println(skiplocked.IsRetryable(&pgconn.PgError{Code: "40001"}))        // serialization failure
	fmt.Println(skiplocked.IsConnectionError(&pgconn.PgError{Code: "57P01"}))  // terminated backend
	fmt.Println(skiplocked.IsRetryable(fmt.Errorf("x: %w", context.Canceled))) // the caller's own decision
	// Output:
	// true
	// true
	// false
}

func ExampleDefaultBackoff() {
	for _, attempt := range []int{1, 2, 3, 10, 20} {
		fmt.Println(attempt, skiplocked.DefaultBackoff(attempt))
	}
	// Output:
	// 1 1s
	// 2 2s
	// 3 4s
	// 10 8m32s
	// 20 1h0m0s
}

func ExampleClaimLostError() {
	var err error = &skiplocked.ClaimLostError{JobID: 7, Token: 41, CurrentToken: 42, Holder: "importer-2", State: skiplocked.StateRunning}
	fmt.Println(errors.Is(err, skiplocked.ErrClaimLost))
	fmt.Println(err)
	// Output:
	// true
	// skiplocked: claim lost: job 7 was re-claimed with token 42 by "importer-2" (yours: 41), state running
}
