package advisory_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/pglock/advisory"
)

// The key of a name is fixed by its definition, so it can be checked here and
// computed from psql with advisory.NameKeySQL.
func ExampleName() {
	k, err := advisory.Name("invoice:42")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(k)
	_, err = advisory.Name("")
	fmt.Println(errors.Is(err, advisory.ErrEmptyName))
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

// Close a day's payouts exactly once: the lock and the writes commit together.
func ExampleXact() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@db/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	key := advisory.MustName("payouts:2026-11-29")
	err = advisory.TryXact(ctx, pool, key, advisory.Exclusive, func(tx pgx.Tx) error {
		var closed bool
		if err := tx.QueryRow(ctx, "SELECT closed FROM payout_days WHERE day = $1", "2026-11-29").Scan(&closed); err != nil {
			return err
		}
		if closed {
			return nil
		}
		_, err := tx.Exec(ctx, "UPDATE payout_days SET closed = true WHERE day = $1", "2026-11-29")
		return err
	})
	if errors.Is(err, advisory.ErrLocked) {
		return // another worker is closing the day right now
	}
	if err != nil {
		log.Fatal(err)
	}
}

// Rebuild a cache at most once at a time across replicas: an efficiency lock.
func ExampleAcquire() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@db/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	lock, err := advisory.TryAcquire(ctx, pool, advisory.MustName("rebuild-search-cache"), advisory.Exclusive, nil)
	if errors.Is(err, advisory.ErrLocked) {
		return // someone else is rebuilding
	}
	if err != nil {
		log.Fatal(err)
	}
	defer lock.Release(ctx)
	for step := 0; step < 100; step++ {
		select {
		case <-lock.Done():
			log.Printf("lock lost, stopping: %v", lock.Err())
			return
		default:
		}
		// ... one step of the rebuild ...
	}
}

func ExampleList() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@db/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	locks, err := advisory.List(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range locks {
		fmt.Printf("key %v %v granted=%v pid=%d app=%q since %v\n",
			l.Key, l.Mode, l.Granted, l.PID, l.ApplicationName, l.BackendStart)
	}
}
