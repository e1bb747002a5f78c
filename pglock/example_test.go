package pglock_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/pglock"
)

// A lease, its token, and a fenced write: the row refuses a token lower than
// the one it has seen, so a holder that paused past its lease cannot
// overwrite a newer holder's work.
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

	lease, err := locker.Acquire(ctx, "invoice:42", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	tag, err := pool.Exec(lease.Context(),
		`UPDATE invoices SET pdf_url = $2, fence = $3 WHERE id = $1 AND fence < $3`,
		42, "s3://bucket/inv-42-v2.pdf", lease.Token())
	switch {
	case err != nil:
		log.Fatal(err)
	case tag.RowsAffected() == 0:
		log.Printf("fenced out: a holder with a newer token already wrote invoice 42")
	}
}

// TryAcquire does not wait; a held lock gives a *LockedError naming the holder.
func ExampleLocker_TryAcquire() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	locker, _ := pglock.New(pool, &pglock.Config{Holder: "billing-7f9c"})
	defer locker.Close()

	lease, err := locker.TryAcquire(ctx, "nightly-settlement", time.Hour)
	var locked *pglock.LockedError
	switch {
	case errors.As(err, &locked):
		fmt.Printf("busy: %s holds it until %v\n", locked.Holder, locked.ExpiresAt)
		return
	case err != nil:
		log.Fatal(err)
	}
	defer lease.Release(context.Background())
	// ... fenced writes with lease.Token() ...
}

// An acquire whose outcome is unknown (the connection failed during the
// grant): once the old connection is gone, look at the row, and adopt the
// grant if it landed, or let the next attempt decide.
func ExampleLocker_Adopt() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	locker, _ := pglock.New(pool, &pglock.Config{Holder: "billing-7f9c", KeepAlive: true})
	defer locker.Close()

	lease, err := locker.TryAcquire(ctx, "nightly-settlement", time.Minute)
	var dbErr *pglock.DBError
	if errors.As(err, &dbErr) && dbErr.Transient() {
		info, ierr := pglock.Inspect(ctx, pool, "nightly-settlement")
		if ierr == nil && info.Held && info.Holder == locker.Holder() {
			lease, err = locker.Adopt(ctx, "nightly-settlement", info.Token, time.Minute)
		}
	}
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())
	// ... fenced writes with lease.Token() ...
}

// Keep-alive renews in the background; the work stops when the lease is lost.
func ExampleConfig_keepAlive() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	locker, _ := pglock.New(pool, &pglock.Config{KeepAlive: true})
	defer locker.Close()

	lease, err := locker.Acquire(ctx, "rebuild-search-index", 20*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())
	work := lease.Context() // cancelled when the lease is lost
	for step := 0; step < 100 && work.Err() == nil; step++ {
		// ... each write fenced with lease.Token() ...
	}
	if err := lease.Err(); errors.Is(err, pglock.ErrLeaseLost) {
		log.Printf("lease lost: %v", err)
	}
}

// AcquireMany takes several locks in sorted order, all or nothing.
func ExampleLocker_AcquireMany() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	locker, _ := pglock.New(pool, nil)
	defer locker.Close()

	leases, err := locker.AcquireMany(ctx, []string{"account:9", "account:3"}, 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range leases {
		defer l.Release(context.Background())
	}
	fmt.Println(leases[0].Name(), leases[0].Token(), leases[1].Name(), leases[1].Token())
}

// Leader election: the leader's writes carry its term's token.
func ExampleElector() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // resigns
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	locker, _ := pglock.New(pool, nil)
	defer locker.Close()

	elector, err := locker.NewElector("rider-assigner:bengaluru", &pglock.ElectionConfig{
		OnStartedLeading: func(ctx context.Context, lease *pglock.Lease) {
			// Lead until ctx ends; fence every write with lease.Token().
			<-ctx.Done()
		},
		OnStoppedLeading: func(lease *pglock.Lease, err error) {
			log.Printf("term %d ended: %v", lease.Token(), err)
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = elector.Run(ctx) }()

	holder, token, err := pglock.Leader(ctx, pool, "rider-assigner:bengaluru")
	fmt.Println(holder, token, err)
}

// Bad input is rejected before any SQL runs.
func ExampleValidateName() {
	fmt.Println(pglock.ValidateName(""))
	fmt.Println(errors.Is(pglock.ValidateName(string(make([]byte, 513))), pglock.ErrInvalidName))
	fmt.Println(pglock.ValidateName("x'; DROP TABLE pgfence.locks; --")) // fine: a bind parameter
	fmt.Println(pglock.ValidateTTL(0))
	// Output:
	// pglock: invalid lock name: empty name
	// true
	// <nil>
	// pglock: invalid lease duration: 0s is outside [1ms, 24h0m0s]
}
