package advisory_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

func BenchmarkName(b *testing.B) {
	for b.Loop() {
		if _, err := advisory.Name("invoice:1234567"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLockCycle measures one uncontended take-and-release, side by side:
// a transaction-scoped lock around an empty function, and a session lock
// (Acquire with its pooler checks, then Unlock).
func BenchmarkLockCycle(b *testing.B) {
	pool := pgtest.Pool(b)
	ctx := context.Background()
	key := advisory.MustName("bench")
	noop := func(pgx.Tx) error { return nil }
	b.Run("xact", func(b *testing.B) {
		for b.Loop() {
			if err := advisory.Xact(ctx, pool, key, advisory.Exclusive, noop); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("try-xact", func(b *testing.B) {
		for b.Loop() {
			if err := advisory.TryXact(ctx, pool, key, advisory.Exclusive, noop); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("session", func(b *testing.B) {
		for b.Loop() {
			l, err := advisory.Acquire(ctx, pool, key, advisory.Exclusive, nil)
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}
