package pglock_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/pglock"
)

// The examples connect to the database named by DATABASE_URL, where pgfence's
// migrations have been applied (package migrations).

// A lease, its token, and a fenced write: the row takes the write only if
// its fence is lower than the token, so a holder that paused past its lease
// cannot overwrite a newer holder's work.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// The fence column holds the highest token each row accepted.
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS invoices (id bigint PRIMARY KEY, pdf_url text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices (id) VALUES (42) ON CONFLICT DO NOTHING`); err != nil {
		log.Fatal(err)
	}

	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	lease, err := locker.Acquire(ctx, "invoice:42", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	tag, err := pool.Exec(lease.Context(),
		`UPDATE invoices SET pdf_url = $2, fence = $3 WHERE id = $1 AND fence < $3`,
		42, "s3://bucket/inv-42-v2.pdf", lease.Token())
	if err != nil {
		log.Fatal(err)
	}
	// 0 rows: fenced out, a holder with a newer token already wrote invoice 42.
	fmt.Println("written:", tag.RowsAffected() == 1)
	if err := lease.Release(ctx); err != nil {
		log.Fatal(err)
	}
	// Output: written: true
}

// A holder whose lease ended while it was paused comes back with its old
// token: the row it wants to write has already accepted the newer holder's
// token, so the late write changes nothing.
func Example_fencedOut() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS invoices (id bigint PRIMARY KEY, pdf_url text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices (id) VALUES (43) ON CONFLICT DO NOTHING`); err != nil {
		log.Fatal(err)
	}
	write := func(token int64, url string) bool {
		tag, err := pool.Exec(ctx,
			`UPDATE invoices SET pdf_url = $2, fence = $3 WHERE id = $1 AND fence < $3`, 43, url, token)
		if err != nil {
			log.Fatal(err)
		}
		return tag.RowsAffected() == 1
	}
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	first, err := locker.Acquire(ctx, "invoice:43", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	// The first holder stalls and its lease ends (here: released for it).
	if err := first.Release(ctx); err != nil {
		log.Fatal(err)
	}
	second, err := locker.Acquire(ctx, "invoice:43", 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	defer second.Release(context.Background())
	fmt.Println("token increased:", second.Token() > first.Token())
	fmt.Println("second holder writes:", write(second.Token(), "s3://bucket/inv-43-v2.pdf"))
	fmt.Println("first holder, waking up, writes:", write(first.Token(), "s3://bucket/inv-43-v1.pdf"))
	// Output:
	// token increased: true
	// second holder writes: true
	// first holder, waking up, writes: false
}

// TryAcquire does not wait: a lock held by another process (here another
// Locker) gives a *pgfence.Error matching pgfence.ErrLocked, naming the
// holder.
func ExampleLocker_TryAcquire() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	billing, err := pglock.New(pool, &pglock.Config{Holder: "billing-7f9c"})
	if err != nil {
		log.Fatal(err)
	}
	defer billing.Close()
	reports, err := pglock.New(pool, &pglock.Config{Holder: "reports-1a2b"})
	if err != nil {
		log.Fatal(err)
	}
	defer reports.Close()

	lease, err := billing.TryAcquire(ctx, "nightly-settlement", time.Hour)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	_, err = reports.TryAcquire(ctx, "nightly-settlement", time.Hour)
	var locked *pgfence.Error
	if errors.Is(err, pgfence.ErrLocked) && errors.As(err, &locked) {
		fmt.Println("busy: held by", locked.Holder)
	}
	// Output: busy: held by billing-7f9c
}

// A worker opens its LISTEN connection at start-up, before it takes work, so
// that its first wait on a busy lock is woken like every later one.
func ExampleLocker_Listen() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	locker, err := pglock.New(pool, &pglock.Config{Holder: "worker-3c1d"})
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	readyCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := locker.Listen(readyCtx); err != nil {
		log.Fatal("not ready: ", err)
	}
	fmt.Println("listening")

	lease, err := locker.Acquire(ctx, "ledger-export", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())
	fmt.Println("holding", lease.Name())
	// Output:
	// listening
	// holding ledger-export
}

// A process that stopped without releasing (or whose acquisition had an
// unknown outcome) finds its grant with Inspect and adopts it with the same
// lease key (Config.Key, kept in a secret store across runs) and the same
// token. The holder's name alone adopts nothing.
func ExampleLocker_Adopt() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	key := make([]byte, 16) // in production: the process's secret, kept across runs
	if _, err := rand.Read(key); err != nil {
		log.Fatal(err)
	}
	cfg := &pglock.Config{Holder: "settler@host-3", Key: key}

	previous, err := pglock.New(pool, cfg)
	if err != nil {
		log.Fatal(err)
	}
	earlier, err := previous.Acquire(ctx, "settlement:adopt", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	previous.Close() // no release: the grant stays held until its TTL

	locker, err := pglock.New(pool, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	info, err := pglock.Inspect(ctx, pool, "settlement:adopt")
	if err != nil {
		log.Fatal(err)
	}
	if !info.Held || info.Holder != locker.Holder() {
		return // not ours: acquire as usual
	}
	lease, err := locker.Adopt(ctx, "settlement:adopt", info.Token, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())
	fmt.Println("same grant:", lease.Token() == earlier.Token())
	// Output: same grant: true
}

// Releasing a lease frees the lock but keeps its token, so the next grant
// gets a larger one.
func ExampleInspect() {
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

	lease, err := locker.Acquire(ctx, "import:prices", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	if err := lease.Release(ctx); err != nil {
		log.Fatal(err)
	}
	info, err := pglock.Inspect(ctx, pool, "import:prices")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("held:", info.Held)
	fmt.Println("token kept:", info.Token == lease.Token())
	// Output:
	// held: false
	// token kept: true
}

// Keep-alive renews in the background; the work stops when the lease is lost.
func ExampleConfig_keepAlive() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	locker, err := pglock.New(pool, &pglock.Config{KeepAlive: true})
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	lease, err := locker.Acquire(ctx, "rebuild-search-index", 20*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())
	work := lease.Context() // cancelled when the lease is lost
	steps := 0
	for ; steps < 100 && work.Err() == nil; steps++ {
		// ... one step, its writes fenced with lease.Token() ...
	}
	if err := lease.Err(); errors.Is(err, pgfence.ErrLost) {
		log.Printf("lease lost after %d steps: %v", steps, err)
		return
	}
	fmt.Println("steps done:", steps)
	// Output: steps done: 100
}

// AcquireMany takes several locks in one order (sorted by name), all or
// nothing, so callers asking for overlapping sets cannot deadlock. The leases
// come back in the order asked for.
func ExampleLocker_AcquireMany() {
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

	leases, err := locker.AcquireMany(ctx, []string{"account:9", "account:3"}, 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range leases {
		defer l.Release(context.Background())
		fmt.Println(l.Name(), "held")
	}
	// Output:
	// account:9 held
	// account:3 held
}

// Leader election: the leader's writes carry its term's token. Cancelling
// Run's context resigns: the lease is released and the other candidates wake.
func ExampleElector() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
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

	elected := make(chan *pglock.Lease, 1)
	elector, err := locker.NewElector("rider-assigner:bengaluru", &pglock.ElectionConfig{
		OnStartedLeading: func(ctx context.Context, lease *pglock.Lease) {
			elected <- lease
			<-ctx.Done() // lead until the term ends; fence every write with lease.Token()
		},
		OnStoppedLeading: func(lease *pglock.Lease, err error) {
			fmt.Println("term ended by resigning:", errors.Is(err, pgfence.ErrReleased))
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- elector.Run(ctx) }()

	term := <-elected
	holder, token, err := pglock.Leader(ctx, pool, "rider-assigner:bengaluru")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("leader is this process:", holder == locker.Holder())
	fmt.Println("leader's token is the term's:", token == term.Token())
	cancel()
	fmt.Println("Run:", <-done)
	// Output:
	// leader is this process: true
	// leader's token is the term's: true
	// term ended by resigning: true
	// Run: context canceled
}
