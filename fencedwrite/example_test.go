package fencedwrite_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fencedwrite"
)

// The runtime helper on an application table with a bigint fence column.
func ExamplePrepare() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	invoices, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "public.invoices",
		Key:   []string{"id"},
		Set:   []string{"pdf_url", "status"},
	})
	if err != nil {
		panic(err) // unknown table or column, no fence column, ...
	}
	var token int64 = 42 // from the lease on "invoices"
	_, err = invoices.Update(ctx, pool, token, []any{int64(7)}, []any{"s3://bucket/7.pdf", "rendered"})
	var stale *fencedwrite.StaleTokenError
	switch {
	case err == nil:
		fmt.Println("written")
	case errors.As(err, &stale):
		fmt.Printf("lost the lock: row fence %d > token %d\n", stale.Fence, stale.Token)
	case errors.Is(err, fencedwrite.ErrAlreadyApplied):
		fmt.Println("this grant already wrote it")
	case errors.Is(err, fencedwrite.ErrNotFound):
		fmt.Println("no invoice 7")
	default:
		panic(err)
	}
}

// A read-modify-write under one fence check.
func ExampleTable_Modify() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	accounts, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{
		Table: "accounts", Key: []string{"id"}, Set: []string{"balance"},
	})
	if err != nil {
		panic(err)
	}
	var token int64 = 3
	_, err = accounts.Modify(ctx, pool, token, []any{1}, func(cur []any) ([]any, error) {
		return []any{cur[0].(int64) + 50}, nil
	})
	fmt.Println(err)
}

// The fenced key/value table shipped with the migrations.
func ExampleUpsertValue() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	var token int64 = 9
	res, err := fencedwrite.UpsertValue(ctx, pool, token, fencedwrite.Strict, "importer:cursor", json.RawMessage(`{"file": "prices-2026-11-29.csv", "line": 1200}`))
	fmt.Println(res.Inserted, err)
}

// Attach the database-side guard: UPDATEs without a raised fence or with a
// token never issued by the lock "invoices" now fail.
func ExampleGuard() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	err = fencedwrite.Guard(ctx, pool, "public.invoices", fencedwrite.GuardOptions{
		LockName: "invoices",
		Mode:     fencedwrite.Reentrant,
	})
	fmt.Println(err)
}

// Check converts the row of a fencegen-generated query.
func ExampleCheck() {
	// row, err := q.FencedUpdateInvoices(ctx, db.FencedUpdateInvoicesParams{...})
	applied, fence, token := false, int64(8), int64(5)
	err := fencedwrite.Check(fencedwrite.Strict, token, applied, fence, nil)
	fmt.Println(errors.Is(err, fencedwrite.ErrStaleToken), err)
	// Output: true fencedwrite: stale token 5: the row's fence is 8 (a newer grant wrote it)
}

func ExampleCheckIdentifier() {
	fmt.Println(fencedwrite.CheckIdentifier("table", "invoices"))
	err := fencedwrite.CheckIdentifier("table", "x; drop table y")
	fmt.Println(errors.Is(err, fencedwrite.ErrInvalidIdentifier))
	// Output:
	// <nil>
	// true
}
