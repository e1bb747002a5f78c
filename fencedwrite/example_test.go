package fencedwrite_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/pglock"
)

// The examples connect to the database named by DATABASE_URL, where pgfence's
// migrations have been applied (package migrations), and take their tokens
// from leases of package pglock.

// The runtime helper on an application table with a bigint fence column: the
// write carries the lease's token and raises the row's fence to it.
func ExamplePrepare() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS invoices (id bigint PRIMARY KEY, pdf_url text, status text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices (id) VALUES (7) ON CONFLICT DO NOTHING`); err != nil {
		log.Fatal(err)
	}

	invoices, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "public.invoices",
		Key:   []string{"id"},
		Set:   []string{"pdf_url", "status"},
	})
	if err != nil {
		log.Fatal(err) // unknown table or column, no fence column, ...
	}
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "invoice:7", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	res, err := invoices.Update(ctx, pool, lease.Token(), []any{7}, []any{"s3://bucket/7.pdf", "rendered"})
	if err != nil {
		log.Fatal(err) // pgfence.ErrStaleToken, ErrAlreadyApplied, ErrNotFound, ...
	}
	fmt.Println("written; fence is the token:", res.Fence == lease.Token())
	// Output: written; fence is the token: true
}

// A holder whose lease ended while it was paused writes with its old token:
// the row has accepted a newer grant's token, so the write is refused with a
// pgfence.ErrStaleToken with the token refused and the row's fence in its Reason.
func ExampleTable_Update() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS invoices (id bigint PRIMARY KEY, pdf_url text, status text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices (id) VALUES (8) ON CONFLICT DO NOTHING`); err != nil {
		log.Fatal(err)
	}
	invoices, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "invoices", Key: []string{"id"}, Set: []string{"status"},
	})
	if err != nil {
		log.Fatal(err)
	}
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()

	old, err := locker.Acquire(ctx, "invoice:8", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	// The holder stalls; its lease ends (here: released for it) and the lock
	// is granted again.
	if err := old.Release(ctx); err != nil {
		log.Fatal(err)
	}
	current, err := locker.Acquire(ctx, "invoice:8", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer current.Release(context.Background())
	if _, err := invoices.Update(ctx, pool, current.Token(), []any{8}, []any{"paid"}); err != nil {
		log.Fatal(err)
	}

	_, err = invoices.Update(ctx, pool, old.Token(), []any{8}, []any{"cancelled"})
	var stale *pgfence.Error
	if errors.As(err, &stale) {
		fmt.Println("stale token refused:", errors.Is(err, pgfence.ErrStaleToken), stale.Token == old.Token())
		fmt.Println(stale.Reason == fmt.Sprintf("row fence %d > token %d", current.Token(), old.Token()))
	}
	// Output:
	// stale token refused: true true
	// true
}

// In strict mode (the default) a grant writes a row once: a write retried
// after a timeout, whose first attempt did land, gets ErrAlreadyApplied
// instead of being applied twice.
func ExampleTable_Update_retry() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS invoices (id bigint PRIMARY KEY, pdf_url text, status text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO invoices (id) VALUES (9) ON CONFLICT DO NOTHING`); err != nil {
		log.Fatal(err)
	}
	invoices, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "invoices", Key: []string{"id"}, Set: []string{"status"},
	})
	if err != nil {
		log.Fatal(err)
	}
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "invoice:9", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	for attempt := 1; attempt <= 2; attempt++ {
		_, err := invoices.Update(ctx, pool, lease.Token(), []any{9}, []any{"sent"})
		switch {
		case err == nil:
			fmt.Println("attempt", attempt, "applied")
		case errors.Is(err, pgfence.ErrAlreadyApplied):
			fmt.Println("attempt", attempt, "already applied by this grant")
		default:
			log.Fatal(err)
		}
	}
	// Output:
	// attempt 1 applied
	// attempt 2 already applied by this grant
}

// A read-modify-write under one fence check: the read raises the row's fence
// to the token, so an older holder cannot write between the read and the
// write.
func ExampleTable_Modify() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS accounts (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`); err != nil {
		log.Fatal(err)
	}
	var id int64
	if err := pool.QueryRow(ctx, "INSERT INTO accounts (balance) VALUES (100) RETURNING id").Scan(&id); err != nil {
		log.Fatal(err)
	}
	accounts, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "accounts", Key: []string{"id"}, Set: []string{"balance"},
	})
	if err != nil {
		log.Fatal(err)
	}
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, fmt.Sprintf("account:%d", id), time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	_, err = accounts.Modify(ctx, pool, lease.Token(), []any{id}, func(cur []any) ([]any, error) {
		return []any{cur[0].(int64) + 50}, nil
	})
	if err != nil {
		log.Fatal(err)
	}
	var balance int64
	if err := pool.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = $1", id).Scan(&balance); err != nil {
		log.Fatal(err)
	}
	fmt.Println("balance:", balance)
	// Output: balance: 150
}

// The fenced key/value table shipped with the migrations, for small state
// such as an importer's cursor.
func ExampleUpsertValue() {
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
	lease, err := locker.Acquire(ctx, "importer", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	_, err = fencedwrite.UpsertValue(ctx, pool, lease.Token(), fencedwrite.Strict, "importer:cursor",
		json.RawMessage(`{"file": "prices-2026-11-29.csv", "line": 1200}`))
	if err != nil {
		log.Fatal(err)
	}
	v, err := fencedwrite.GetValue(ctx, pool, "importer:cursor")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(v.Value), v.Fence == lease.Token())
	// Output: {"file": "prices-2026-11-29.csv", "line": 1200} true
}

// Attach the database-side guard: from then on the table refuses any change
// that does not carry the latest token of lock "ledger", whoever sends it.
func ExampleGuard() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS ledger (day date PRIMARY KEY, total bigint NOT NULL, fence bigint NOT NULL DEFAULT 0)`); err != nil {
		log.Fatal(err)
	}
	locker, err := pglock.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer locker.Close()
	lease, err := locker.Acquire(ctx, "ledger", time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	defer lease.Release(context.Background())

	if err := fencedwrite.Guard(ctx, pool, "ledger", fencedwrite.GuardOptions{LockName: "ledger"}); err != nil {
		log.Fatal(err)
	}
	ledger, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "ledger", Key: []string{"day"}, Set: []string{"total"},
	})
	if err != nil {
		log.Fatal(err)
	}
	_, err = ledger.Upsert(ctx, pool, lease.Token(), []any{"2026-11-29"}, []any{1200})
	fmt.Println("fenced upsert:", err)

	// A writer that knows nothing about tokens:
	_, err = pool.Exec(ctx, "UPDATE ledger SET total = 0 WHERE day = '2026-11-29'")
	fmt.Println("plain update refused:", errors.Is(fencedwrite.TranslateError(err), pgfence.ErrGuard))
	// Output:
	// fenced upsert: <nil>
	// plain update refused: true
}

// Check converts the row of a hand-written fenced statement that returns
// "applied, fence".
func ExampleCheck() {
	// var applied bool; var fence int64
	// err := tx.QueryRow(ctx, myFencedUpdate, ...).Scan(&applied, &fence)
	applied, fence, token := false, int64(8), int64(5)
	err := fencedwrite.Check(fencedwrite.Strict, token, applied, fence, nil)
	fmt.Println(errors.Is(err, pgfence.ErrStaleToken), err)
	// Output: true fencedwrite.Check: stale token: a newer grant came first token 5: row fence 8 > token 5
}
