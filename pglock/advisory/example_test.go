package advisory_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// The examples that use a database connect to the one named by DATABASE_URL.

// The key of a name is fixed by its definition, so it can be checked here and
// computed from psql with the SQL in Name's documentation.
func ExampleName() {
	k, err := advisory.Name("invoice:42")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(k)
	_, err = advisory.Name("")
	fmt.Println(errors.Is(err, pgfence.ErrInvalid))
	// Output:
	// 6688477336110245193
	// true
}

func ExampleNamespaced() {
	k, _ := advisory.Namespaced(7, "invoice:42")
	a, b, _ := k.Pair()
	fmt.Println(a, b, k)
	// Output: 7 1557282483 7,1557282483
}

// Close a day's payouts exactly once: the lock is held by the transaction
// that does the work, so it cannot outlive it. A second worker trying at the
// same time is refused at once.
func ExampleTryXact() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS payout_days (day date PRIMARY KEY, closed boolean NOT NULL DEFAULT false);
		INSERT INTO payout_days (day) VALUES ('2026-11-29') ON CONFLICT DO NOTHING`); err != nil {
		log.Fatal(err)
	}
	closeDay := func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE payout_days SET closed = true WHERE day = $1 AND NOT closed", "2026-11-29")
		return err
	}

	key := advisory.MustName("payouts:2026-11-29")
	err = advisory.TryXact(ctx, pool, key, advisory.Exclusive, func(tx pgx.Tx) error {
		// Meanwhile, another worker tries the same day.
		other := advisory.TryXact(ctx, pool, key, advisory.Exclusive, closeDay)
		fmt.Println("other worker locked out:", errors.Is(other, pgfence.ErrLocked))
		return closeDay(tx)
	})
	if errors.Is(err, pgfence.ErrLocked) {
		return // another worker is closing the day right now
	}
	if err != nil {
		log.Fatal(err)
	}
	var closed bool
	if err := pool.QueryRow(ctx, "SELECT closed FROM payout_days WHERE day = $1", "2026-11-29").Scan(&closed); err != nil {
		log.Fatal(err)
	}
	fmt.Println("day closed:", closed)
	// Output:
	// other worker locked out: true
	// day closed: true
}

// Rebuild a cache at most once at a time across replicas: a session lock is
// an efficiency lock, which avoids duplicate work but protects no data.
func ExampleTryAcquire() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	key := advisory.MustName("rebuild-search-cache")

	lock, err := advisory.TryAcquire(ctx, pool, key, advisory.Exclusive, nil)
	if errors.Is(err, pgfence.ErrLocked) {
		return // someone else is rebuilding
	}
	if err != nil {
		log.Fatal(err)
	}
	// Another replica, meanwhile:
	_, err = advisory.TryAcquire(ctx, pool, key, advisory.Exclusive, nil)
	fmt.Println("other replica locked out:", errors.Is(err, pgfence.ErrLocked))

	steps := 0
	for ; steps < 100; steps++ {
		select {
		case <-lock.Done():
			log.Fatalf("lock lost after %d steps: %v", steps, lock.Err())
		default:
		}
		// ... one step of the rebuild ...
	}
	if err := lock.Release(ctx); err != nil {
		log.Fatal(err) // pgfence.ErrLost: the rebuild may have run twice
	}
	fmt.Println("rebuilt in", steps, "steps")
	// Output:
	// other replica locked out: true
	// rebuilt in 100 steps
}

// List shows who holds or waits for advisory locks in the database, as
// pg_locks does, with keys made from names recognised.
func ExampleList() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	lock, err := advisory.TryAcquire(ctx, pool, advisory.MustName("nightly-export"), advisory.Exclusive, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer lock.Release(ctx)

	locks, err := advisory.List(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range locks {
		if l.Key == lock.Key() {
			fmt.Printf("key %v %v granted=%v ours=%v\n", l.Key, l.Mode, l.Granted, uint32(l.PID) == lock.PID())
		}
	}
	// Output: key -5287385889299587548 exclusive granted=true ours=true
}
