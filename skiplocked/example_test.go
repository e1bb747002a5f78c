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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/skiplocked"
)

// The examples that use a database connect to the one named by DATABASE_URL,
// where pgfence's migrations have been applied (package migrations).

// In-transaction claims on pgfence.jobs: the transaction is the lock. Each
// batch is claimed, worked and completed in one transaction; concurrent
// workers skip the jobs locked by others, and a rollback gives them back
// without counting an attempt.
func ExampleClaimTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS imported (job_id bigint PRIMARY KEY, payload jsonb NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	if _, err := skiplocked.Enqueue(ctx, pool, []skiplocked.EnqueueParams{
		{Queue: "price-files", Payload: json.RawMessage(`{"file":"a.csv"}`)},
		{Queue: "price-files", Payload: json.RawMessage(`{"file":"b.csv"}`)},
		{Queue: "price-files", Payload: json.RawMessage(`{"file":"c.csv"}`)},
	}...); err != nil {
		log.Fatal(err)
	}
	for {
		var n int
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			jobs, err := skiplocked.ClaimTx(ctx, tx, "price-files", 2)
			if err != nil {
				return err
			}
			n = len(jobs)
			for _, j := range jobs {
				// ... import the file, writing through tx ...
				if _, err := tx.Exec(ctx, "INSERT INTO imported (job_id, payload) VALUES ($1, $2)", j.ID, j.Payload); err != nil {
					return err
				}
				if err := skiplocked.CompleteTx(ctx, tx, j.ID); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			log.Fatal(err)
		}
		if n == 0 {
			fmt.Println("drained")
			return
		}
		fmt.Println("imported", n)
	}
	// Output:
	// imported 2
	// imported 1
	// drained
}

// Leased claims, for work done outside a transaction: claim, work, complete.
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
		// ... long work, calling skiplocked.Renew(ctx, pool, time.Minute, j.Ref()) now and then ...
		if err := skiplocked.Complete(ctx, pool, j.Ref()); err != nil {
			log.Fatal(err) // pgfence.ErrLost: see ExampleComplete_claimLost
		}
		fmt.Printf("completed %s\n", j.Payload)
	}
	// Output: completed {"file": "prices-0042.csv"}
}

// A worker whose claim ended (it expired while the worker was paused, and
// another worker claimed the job) cannot complete the job: Complete changes
// nothing and says who holds it now.
func ExampleComplete_claimLost() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	claim := func(holder string) skiplocked.Job {
		jobs, err := skiplocked.Claim(ctx, pool, skiplocked.ClaimParams{
			Queue: "reports", Holder: holder, Limit: 1, TTL: time.Minute,
		})
		if err != nil || len(jobs) != 1 {
			log.Fatalf("claim: %d jobs, %v", len(jobs), err)
		}
		return jobs[0]
	}
	if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "reports"}); err != nil {
		log.Fatal(err)
	}

	first := claim("reporter-1")
	// reporter-1 stalls and its claim ends (here: released for it) ...
	if err := skiplocked.Release(ctx, pool, first.Ref()); err != nil {
		log.Fatal(err)
	}
	// ... and reporter-2 claims the job.
	second := claim("reporter-2")

	err = skiplocked.Complete(ctx, pool, first.Ref())
	var lost *pgfence.Error
	if errors.As(err, &lost) {
		fmt.Println("claim lost:", errors.Is(err, pgfence.ErrLost), "now held by", lost.Holder)
	}
	if err := skiplocked.Complete(ctx, pool, second.Ref()); err != nil {
		log.Fatal(err)
	}
	// Output: claim lost: true now held by reporter-2
}

// A worker loop that runs until its context is cancelled (here by SIGINT, or
// once three jobs are handled), then shuts down gracefully.
func ExampleWorker() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	for _, file := range []string{"a.jpg", "b.jpg", "c.jpg"} {
		payload, _ := json.Marshal(map[string]string{"file": file})
		if _, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: "thumbnails", Payload: payload}); err != nil {
			log.Fatal(err)
		}
	}

	handled := make(chan struct{}, 3)
	w, err := skiplocked.NewWorker(pool, "thumbnails", func(ctx context.Context, j skiplocked.Job) error {
		var args struct{ File string }
		if err := json.Unmarshal(j.Payload, &args); err != nil {
			return skiplocked.Permanent(err) // dead at once, no retry
		}
		// ... make the thumbnail of args.File, honouring ctx ...
		handled <- struct{}{}
		return nil
	}, &skiplocked.Config{Concurrency: 8, ClaimTTL: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		for range 3 {
			<-handled
		}
		stop()
	}()
	if err := w.Run(ctx); err != nil { // returns after a graceful stop
		log.Fatal(err)
	}
	fmt.Println("completed:", w.Summary().Completed)
	// Output: completed: 3
}

// Exactly-once effects: the handler writes through tx, and the Worker
// completes the job in the same transaction. Drain returns when the batch's
// queue is empty.
func ExampleNewTxWorker() {
	ctx := context.Background()
	const concurrency = 4
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	cfg.MaxConns = concurrency + 2 // a transaction per handler, plus claims, renewals and outcomes
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS applied_files (job_id bigint PRIMARY KEY, payload jsonb NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	ids, err := skiplocked.Enqueue(ctx, pool, []skiplocked.EnqueueParams{
		{Queue: "catalogue/2024-06-01", Payload: json.RawMessage(`{"file":"part-1.csv"}`)},
		{Queue: "catalogue/2024-06-01", Payload: json.RawMessage(`{"file":"part-2.csv"}`)},
		{Queue: "catalogue/2024-06-01", Payload: json.RawMessage(`{"file":"part-3.csv"}`)},
	}...)
	if err != nil {
		log.Fatal(err)
	}

	w, err := skiplocked.NewTxWorker(pool, "catalogue/2024-06-01", func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
		// The effect: commits with the job's completion, or not at all.
		_, err := tx.Exec(ctx, "INSERT INTO applied_files (job_id, payload) VALUES ($1, $2)", j.ID, j.Payload)
		return err
	}, &skiplocked.Config{
		Concurrency: concurrency,
		OnClaimLost: func(ctx context.Context, j skiplocked.Job, err *pgfence.Error) {
			log.Printf("job %d taken over by %s: %v", j.ID, err.Holder, err)
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	sum, err := w.Drain(ctx)
	if err != nil {
		log.Fatal(err) // not drained, or pgfence.ErrNotFound: the batch is not known to be done
	}
	var effects int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM applied_files WHERE job_id = ANY($1)", ids).Scan(&effects); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("completed %d jobs, %d effects\n", sum.Completed, effects)
	// Output: completed 3 jobs, 3 effects
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
