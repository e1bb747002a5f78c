package fencedwrite_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// grant issues the next fencing token of lock name, the way the lease
// package does (token = token + 1), without taking a lease.
func grant(t testing.TB, db pgfence.DBTX, name string) int64 {
	t.Helper()
	var tok int64
	err := db.QueryRow(context.Background(), `
		INSERT INTO pgfence.locks(name, token) VALUES ($1, 1)
		ON CONFLICT (name) DO UPDATE SET token = locks.token + 1
		RETURNING token`, name).Scan(&tok)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func mustExec(t testing.TB, db pgfence.DBTX, sql string, args ...any) {
	t.Helper()
	if _, err := db.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func queryInt(t testing.TB, db pgfence.DBTX, sql string, args ...any) int64 {
	t.Helper()
	var v int64
	if err := db.QueryRow(context.Background(), sql, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

func queryString(t testing.TB, db pgfence.DBTX, sql string, args ...any) string {
	t.Helper()
	var v string
	if err := db.QueryRow(context.Background(), sql, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

// wantStale checks err is pgfence.ErrStaleToken refusing token with the
// row's fence in its Reason.
func wantStale(t testing.TB, err error, token, fence int64) {
	t.Helper()
	var pe *pgfence.Error
	if !errors.Is(err, pgfence.ErrStaleToken) || !errors.As(err, &pe) || pe.Kind != pgfence.ErrStaleToken {
		t.Fatalf("err = %v, want ErrStaleToken", err)
	}
	if pe.Token != token || !strings.HasPrefix(pe.Reason, fmt.Sprintf("row fence %d > token %d", fence, token)) {
		t.Fatalf("stale error = %+v, want token %d fence %d", pe, token, fence)
	}
}

// invalidArg stands for pgfence.ErrInvalid naming the argument (the start
// of the Reason) in the tests' expectations.
type invalidArg string

func (a invalidArg) Error() string { return "invalid " + string(a) }

// matches reports whether err is a *pgfence.Error of kind target (for an
// invalidArg: ErrInvalid whose Reason names the argument).
func matches(err, target error) bool {
	var pe *pgfence.Error
	if !errors.As(err, &pe) {
		return false
	}
	if a, ok := target.(invalidArg); ok {
		return pe.Kind == pgfence.ErrInvalid && errors.Is(err, pgfence.ErrInvalid) && (strings.HasPrefix(pe.Reason, string(a)+":") || strings.HasPrefix(pe.Reason, string(a)+"."))
	}
	return pe.Kind == target && errors.Is(err, target)
}

func wantIs(t testing.TB, err, target error) {
	t.Helper()
	if !matches(err, target) {
		t.Fatalf("err = %v, want %v", err, target)
	}
}

// invoicesPool returns a migrated database with a sample application table.
func invoicesPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t)
	mustExec(t, pool, `
		CREATE TABLE invoices (
			id      bigint PRIMARY KEY,
			pdf_url text,
			status  text NOT NULL DEFAULT 'new',
			store   text NOT NULL DEFAULT 'store-1',
			fence   bigint NOT NULL DEFAULT 0
		)`)
	mustExec(t, pool, `INSERT INTO invoices (id) SELECT g FROM generate_series(1, 3) g`)
	return pool
}
