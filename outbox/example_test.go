package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
)

// The examples that use a database connect to the one named by DATABASE_URL,
// where pgfence's migrations have been applied (package migrations).

// A settlement records its payment intent in the transaction of its fenced
// writes; a Dispatcher delivers it after the commit, at least once, with its
// idempotency key.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "settle:store-7", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx)
	// ... the settlement's fenced writes through tx, with lease.Token() ...
	_, err = outbox.Enqueue(ctx, tx, lease, outbox.Intent{
		Topic:   "payments",
		Key:     "settle:store-7:2024-06-01",
		Payload: json.RawMessage(`{"store":7,"day":"2024-06-01","amount_cents":123456}`),
	})
	if err != nil {
		log.Fatal(err) // ErrStaleToken: a newer holder exists; pgfence.ErrLost: the lease ended. Nothing was recorded
	}
	// The token is checked again at COMMIT.
	if err := outbox.TranslateError(tx.Commit(ctx)); err != nil {
		log.Fatal(err)
	}

	// Usually in another process: deliver the topic's intents.
	d, err := outbox.NewDispatcher(pool, "payments", func(ctx context.Context, d outbox.Delivery) error {
		fmt.Printf("pay %s (attempt %d): %s\n", d.Key, d.Attempt, d.Payload)
		return nil // the provider has the effect (or already had this key)
	}, nil)
	if err != nil {
		log.Fatal(err)
	}
	sum, err := d.Drain(ctx) // Run(ctx) for a long-running dispatcher
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("delivered:", sum.Completed)
	// Output:
	// pay settle:store-7:2024-06-01 (attempt 1): {"day": "2024-06-01", "store": 7, "amount_cents": 123456}
	// delivered: 1
}

// A holder that paused past its lease while the lock was granted to another
// Locker is refused: its intent is not recorded, so the effect is never sent
// on its behalf.
func ExampleEnqueue_staleHolder() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	old, err := locker.Acquire(ctx, "settle:store-8", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	// The holder stalls; its lease ends (here: released for it) and another
	// process's Locker is granted the lock.
	if err := old.Release(ctx); err != nil {
		log.Fatal(err)
	}
	other, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer other.Close()
	current, err := other.Acquire(ctx, "settle:store-8", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer current.Release(context.Background())

	_, err = outbox.Enqueue(ctx, pool, old, outbox.Intent{
		Topic:   "payments",
		Key:     "settle:store-8:2024-06-01",
		Payload: json.RawMessage(`{"store":8,"day":"2024-06-01","amount_cents":4200}`),
	})
	fmt.Println("stale holder refused:", errors.Is(err, pgfence.ErrStaleToken))
	// Output: stale holder refused: true
}

// NewHTTPHandler POSTs each intent to a receiver that deduplicates by the
// Idempotency-Key header (here a test server standing in for a payment
// provider).
func ExampleNewHTTPHandler() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println(r.Method, r.URL.Path, "key:", r.Header.Get("Idempotency-Key"))
		w.WriteHeader(http.StatusCreated)
	}))
	defer provider.Close()

	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "refunds:order-31", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())
	if _, err := outbox.Enqueue(ctx, pool, lease, outbox.Intent{
		Topic: "refunds", Key: "refund:order-31",
		Payload: json.RawMessage(`{"order":31,"amount_cents":1999}`),
	}); err != nil {
		log.Fatal(err)
	}

	h, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: provider.URL + "/v1/refunds", Timeout: 5 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	d, err := outbox.NewDispatcher(pool, "refunds", h, nil)
	if err != nil {
		log.Fatal(err)
	}
	sum, err := d.Drain(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("delivered:", sum.Completed)
	// Output:
	// POST /v1/refunds key: refund:order-31
	// delivered: 1
}

// Validation runs before any SQL: a bad intent is refused with a typed error
// and nothing is recorded.
func ExampleEnqueue_badInput() {
	ctx := context.Background()
	var db pgfence.DBTX // nil here: validation fails before it is used
	_, err := outbox.Enqueue(ctx, db, nil, outbox.Intent{Topic: "payments", Key: "settle:7:2024-06-01"})
	fmt.Println(errors.Is(err, pgfence.ErrInvalid))
	fmt.Println(err)
	// Output:
	// true
	// outbox.Enqueue: invalid argument: db: nil: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx
}
