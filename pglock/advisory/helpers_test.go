package advisory_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/pglock/advisory"
)

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// newCounter creates a one-row counter table at 0.
func newCounter(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(testCtx(t), `CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL);
		INSERT INTO counter VALUES (1, 0)`)
	if err != nil {
		t.Fatal(err)
	}
}

func counterValue(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(testCtx(t), "SELECT n FROM counter WHERE id = 1").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// advisoryLocks returns the advisory locks of the pool's database as seen by
// List.
func advisoryLocks(t *testing.T, pool *pgxpool.Pool) []advisory.LockInfo {
	t.Helper()
	locks, err := advisory.List(testCtx(t), pool)
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	return locks
}

func requireNoLocks(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if locks := advisoryLocks(t, pool); len(locks) != 0 {
		t.Fatalf("advisory locks still held: %+v", locks)
	}
}

// requireLocked asserts that another session cannot take key exclusively
// right now.
func requireLocked(t *testing.T, pool *pgxpool.Pool, key advisory.Key) {
	t.Helper()
	err := advisory.TryXact(testCtx(t), pool, key, advisory.Exclusive, func(pgx.Tx) error { return nil })
	if !errors.Is(err, pgfence.ErrLocked) {
		t.Fatalf("TryXact on %v: got %v, want ErrLocked", key, err)
	}
}

// requireFree asserts that another session can take key exclusively right now.
func requireFree(t *testing.T, pool *pgxpool.Pool, key advisory.Key) {
	t.Helper()
	if err := advisory.TryXact(testCtx(t), pool, key, advisory.Exclusive, func(pgx.Tx) error { return nil }); err != nil {
		t.Fatalf("TryXact on %v: %v, want the key free", key, err)
	}
}

// waitLocks polls List until want(locks) holds or 10s pass. Used where the
// server changes state on its own after a cancel request (no client-side
// signal exists).
func waitLocks(t *testing.T, pool *pgxpool.Pool, what string, want func([]advisory.LockInfo) bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		locks := advisoryLocks(t, pool)
		if want(locks) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10s, %s: List = %+v", what, locks)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// pfError returns err as a *pgfence.Error, or nil.
func pfError(err error) *pgfence.Error {
	var pe *pgfence.Error
	if !errors.As(err, &pe) {
		return nil
	}
	return pe
}

// isInvalid reports whether err is pgfence.ErrInvalid whose Reason names
// the argument arg.
func isInvalid(err error, arg string) bool {
	pe := pfError(err)
	return errors.Is(err, pgfence.ErrInvalid) && pe != nil && strings.HasPrefix(pe.Reason, arg+": ")
}

// isLocked reports whether err is pgfence.ErrLocked for key in mode.
func isLocked(err error, key advisory.Key, mode advisory.Mode) bool {
	pe := pfError(err)
	return errors.Is(err, pgfence.ErrLocked) && pe != nil && pe.Name == key.String() &&
		strings.HasSuffix(strings.TrimSuffix(pe.Reason, " (lock_timeout ended the wait)"), "conflicting with "+mode.String())
}
