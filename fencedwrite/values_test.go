package fencedwrite_test

import (
	"context"
	"encoding/json"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestValuesStrict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)

	t1 := grant(t, pool, "cfg")
	res, err := fencedwrite.UpsertValue(ctx, pool, t1, fencedwrite.Strict, "cfg", json.RawMessage(`{"v":1}`))
	if err != nil || !res.Inserted || res.Fence != t1 {
		t.Fatalf("first upsert = %+v, %v", res, err)
	}
	// Replay by the same grant: refused as already applied, row unchanged.
	_, err = fencedwrite.UpdateValue(ctx, pool, t1, fencedwrite.Strict, "cfg", json.RawMessage(`{"v":"replay"}`))
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	_, err = fencedwrite.UpsertValue(ctx, pool, t1, fencedwrite.Strict, "cfg", json.RawMessage(`{"v":"replay"}`))
	wantIs(t, err, pgfence.ErrAlreadyApplied)

	t2 := grant(t, pool, "cfg")
	res, err = fencedwrite.UpdateValue(ctx, pool, t2, fencedwrite.Strict, "cfg", json.RawMessage(`{"v":2}`))
	if err != nil || res.Fence != t2 || res.Inserted {
		t.Fatalf("update with newer token = %+v, %v", res, err)
	}
	// The older grant wakes up: stale, with both numbers, row unchanged.
	_, err = fencedwrite.UpdateValue(ctx, pool, t1, fencedwrite.Strict, "cfg", json.RawMessage(`{"v":"old"}`))
	wantStale(t, err, t1, t2)
	_, err = fencedwrite.UpsertValue(ctx, pool, t1, fencedwrite.Reentrant, "cfg", json.RawMessage(`{"v":"old"}`))
	wantStale(t, err, t1, t2)
	_, err = fencedwrite.DeleteValue(ctx, pool, t1, "cfg")
	wantStale(t, err, t1, t2)
	v, err := fencedwrite.GetValue(ctx, pool, "cfg")
	if err != nil || string(v.Value) != `{"v": 2}` || v.Fence != t2 {
		t.Fatalf("row after refused writes = %+v %s, %v", v, v.Value, err)
	}

	// Missing rows.
	_, err = fencedwrite.UpdateValue(ctx, pool, t2, fencedwrite.Strict, "nope", json.RawMessage(`1`))
	wantIs(t, err, pgfence.ErrNotFound)
	_, err = fencedwrite.DeleteValue(ctx, pool, t2, "nope")
	wantIs(t, err, pgfence.ErrNotFound)
	_, err = fencedwrite.ReadValue(ctx, pool, t2, "nope")
	wantIs(t, err, pgfence.ErrNotFound)
	_, err = fencedwrite.GetValue(ctx, pool, "nope")
	wantIs(t, err, pgfence.ErrNotFound)

	// Delete by the grant that wrote it is allowed (fence <= token).
	if _, err := fencedwrite.DeleteValue(ctx, pool, t2, "cfg"); err != nil {
		t.Fatal(err)
	}
	_, err = fencedwrite.GetValue(ctx, pool, "cfg")
	wantIs(t, err, pgfence.ErrNotFound)
}

func TestValuesReentrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	t1 := grant(t, pool, "k")
	if _, err := fencedwrite.UpsertValue(ctx, pool, t1, fencedwrite.Reentrant, "k", json.RawMessage(`1`)); err != nil {
		t.Fatal(err)
	}
	// Equal token: accepted under <=, refused under <.
	res, err := fencedwrite.UpdateValue(ctx, pool, t1, fencedwrite.Reentrant, "k", json.RawMessage(`2`))
	if err != nil || res.Fence != t1 {
		t.Fatalf("re-entrant rewrite = %+v, %v", res, err)
	}
	res, err = fencedwrite.UpsertValue(ctx, pool, t1, fencedwrite.Reentrant, "k", json.RawMessage(`3`))
	if err != nil || res.Inserted {
		t.Fatalf("re-entrant upsert = %+v, %v", res, err)
	}
	_, err = fencedwrite.UpdateValue(ctx, pool, t1, fencedwrite.Strict, "k", json.RawMessage(`4`))
	wantIs(t, err, pgfence.ErrAlreadyApplied)
	if v, _ := fencedwrite.GetValue(ctx, pool, "k"); string(v.Value) != "3" {
		t.Fatalf("value = %s, want 3", v.Value)
	}
}

func TestValuesBadInputChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	tok := grant(t, pool, "k")
	if _, err := fencedwrite.UpsertValue(ctx, pool, tok, fencedwrite.Strict, "k", json.RawMessage(`1`)); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		run  func() error
		want error
	}{
		{"zero token", func() error {
			_, err := fencedwrite.UpdateValue(ctx, pool, 0, fencedwrite.Strict, "k", json.RawMessage(`2`))
			return err
		}, invalidArg("token")},
		{"negative token", func() error {
			_, err := fencedwrite.UpsertValue(ctx, pool, -5, fencedwrite.Strict, "k", json.RawMessage(`2`))
			return err
		}, invalidArg("token")},
		{"negative token delete", func() error { _, err := fencedwrite.DeleteValue(ctx, pool, -1, "k"); return err }, invalidArg("token")},
		{"negative token read", func() error { _, err := fencedwrite.ReadValue(ctx, pool, -1, "k"); return err }, invalidArg("token")},
		{"empty key", func() error {
			_, err := fencedwrite.UpdateValue(ctx, pool, tok+1, fencedwrite.Strict, "", json.RawMessage(`2`))
			return err
		}, invalidArg("key")},
		{"huge key", func() error {
			_, err := fencedwrite.UpsertValue(ctx, pool, tok+1, fencedwrite.Strict, strings.Repeat("k", 513), json.RawMessage(`2`))
			return err
		}, invalidArg("key")},
		{"bad json", func() error {
			_, err := fencedwrite.UpdateValue(ctx, pool, tok+1, fencedwrite.Strict, "k", json.RawMessage(`{`))
			return err
		}, invalidArg("value")},
		{"bad mode", func() error {
			_, err := fencedwrite.UpdateValue(ctx, pool, tok+1, fencedwrite.Mode(7), "k", json.RawMessage(`2`))
			return err
		}, invalidArg("mode")},
		{"nil modify func", func() error {
			_, err := fencedwrite.ModifyValue(ctx, pool, tok+1, "k", nil)
			return err
		}, invalidArg("fn")},
		// What PostgreSQL would refuse is refused first, typed.
		{"key with a NUL byte", func() error {
			_, err := fencedwrite.UpsertValue(ctx, pool, tok+1, fencedwrite.Strict, "k\x00", json.RawMessage(`2`))
			return err
		}, invalidArg("key")},
		{"key not UTF-8", func() error { _, err := fencedwrite.DeleteValue(ctx, pool, tok+1, "k\xff"); return err }, invalidArg("key")},
		{"get: key with a NUL byte", func() error { _, err := fencedwrite.GetValue(ctx, pool, "\x00"); return err }, invalidArg("key")},
		{"get: empty key", func() error { _, err := fencedwrite.GetValue(ctx, pool, ""); return err }, invalidArg("key")},
		{"value with \\u0000", func() error {
			_, err := fencedwrite.UpdateValue(ctx, pool, tok+1, fencedwrite.Strict, "k", json.RawMessage(`{"a":"\u0000"}`))
			return err
		}, invalidArg("value")},
		{"value not UTF-8", func() error {
			_, err := fencedwrite.UpsertValue(ctx, pool, tok+1, fencedwrite.Strict, "k", json.RawMessage("\"\xff\""))
			return err
		}, invalidArg("value")},
		{"value with an unpaired surrogate", func() error {
			_, err := fencedwrite.UpsertValue(ctx, pool, tok+1, fencedwrite.Reentrant, "k", json.RawMessage(`"\ud800"`))
			return err
		}, invalidArg("value")},
		{"modify returning \\u0000", func() error {
			_, err := fencedwrite.ModifyValue(ctx, pool, tok+1, "k", func(json.RawMessage) (json.RawMessage, error) {
				return json.RawMessage(`"\u0000"`), nil
			})
			return err
		}, invalidArg("value")},
	}
	for _, c := range cases {
		if err := c.run(); !matches(err, c.want) {
			t.Errorf("%s: err = %v, want %v", c.name, err, c.want)
		}
	}
	v, err := fencedwrite.GetValue(ctx, pool, "k")
	if err != nil || string(v.Value) != "1" || v.Fence != tok {
		t.Fatalf("row changed by bad input: %+v %s, %v", v, v.Value, err)
	}
	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgfence.fenced_values").Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("%d rows in pgfence.fenced_values after bad input (%v), want 1", rows, err)
	}
}

func TestModifyValue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	t1 := grant(t, pool, "n")
	if _, err := fencedwrite.UpsertValue(ctx, pool, t1, fencedwrite.Strict, "n", json.RawMessage(`10`)); err != nil {
		t.Fatal(err)
	}
	add := func(d int) func(json.RawMessage) (json.RawMessage, error) {
		return func(cur json.RawMessage) (json.RawMessage, error) {
			var n int
			if err := json.Unmarshal(cur, &n); err != nil {
				return nil, err
			}
			return json.Marshal(n + d)
		}
	}
	t2 := grant(t, pool, "n")
	if _, err := fencedwrite.ModifyValue(ctx, pool, t2, "n", add(5)); err != nil {
		t.Fatal(err)
	}
	// Same grant again (re-entrant write after the fenced read).
	if _, err := fencedwrite.ModifyValue(ctx, pool, t2, "n", add(1)); err != nil {
		t.Fatal(err)
	}
	// An older grant is refused before fn runs.
	called := false
	_, err := fencedwrite.ModifyValue(ctx, pool, t1, "n", func(json.RawMessage) (json.RawMessage, error) {
		called = true
		return json.RawMessage(`0`), nil
	})
	wantStale(t, err, t1, t2)
	if called {
		t.Fatal("fn ran for a stale token")
	}
	// fn failing rolls everything back, including the fence raise.
	t3 := grant(t, pool, "n")
	boom := errors.New("boom")
	if _, err := fencedwrite.ModifyValue(ctx, pool, t3, "n", func(json.RawMessage) (json.RawMessage, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	v, _ := fencedwrite.GetValue(ctx, pool, "n")
	if string(v.Value) != "16" || v.Fence != t2 {
		t.Fatalf("after modify: %s fence %d, want 16 fence %d", v.Value, v.Fence, t2)
	}
}

// TestValuesConcurrentWriters runs writers with different tokens on one row at
// once: every writer gets applied or a reason, never a lost or unexplained
// answer, and the row ends with the highest token that was applied.
func TestValuesConcurrentWriters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	const n = 24
	toks := make([]int64, n)
	for i := range toks {
		toks[i] = grant(t, pool, "race")
	}
	if _, err := fencedwrite.UpsertValue(ctx, pool, toks[0], fencedwrite.Strict, "race", json.RawMessage(`0`)); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := 1; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = fencedwrite.UpdateValue(ctx, pool, toks[i], fencedwrite.Strict, "race", json.RawMessage(`1`))
		}()
	}
	wg.Wait()
	var maxApplied int64
	for i := 1; i < n; i++ {
		switch {
		case errs[i] == nil:
			maxApplied = max(maxApplied, toks[i])
		case errors.Is(errs[i], pgfence.ErrStaleToken):
		default:
			t.Errorf("writer %d: %v", i, errs[i])
		}
	}
	v, _ := fencedwrite.GetValue(ctx, pool, "race")
	if v.Fence != maxApplied || maxApplied != toks[n-1] {
		t.Fatalf("final fence %d, highest applied %d, highest token %d", v.Fence, maxApplied, toks[n-1])
	}
}

func TestDroppedConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.PoolFor(t, pgtest.DSN(t))
	tok := grant(t, pool, "k")
	pool.Close()
	_, err := fencedwrite.UpsertValue(ctx, pool, tok, fencedwrite.Strict, "k", json.RawMessage(`1`))
	var pe *pgfence.Error
	if !errors.As(err, &pe) || pe.Kind != nil || pe.Err == nil || !strings.HasPrefix(err.Error(), `fencedwrite.UpsertValue "k": `) {
		t.Fatalf("err = %v, want a database failure of fencedwrite.UpsertValue", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	live := pgtest.Pool(t)
	_, err = fencedwrite.UpsertValue(cctx, live, 1, fencedwrite.Strict, "k", json.RawMessage(`1`))
	if !errors.Is(err, context.Canceled) || !errors.As(err, &pe) || pe.Kind != nil {
		t.Fatalf("err = %v, want a database failure caused by context.Canceled", err)
	}
}

// A ModifyValue whose fn ends its goroutine (runtime.Goexit, as t.Fatal
// does in a test) rolls its transaction back and gives its connection back:
// before, the connection stayed out of the pool, idle in a transaction that
// held the value's row lock.
func TestModifyValueGoexitRollsBack(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tok := grant(t, pool, "goexit")
	if _, err := fencedwrite.UpsertValue(ctx, pool, tok, fencedwrite.Strict, "goexit", json.RawMessage(`1`)); err != nil {
		t.Fatal(err)
	}
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		_, _ = fencedwrite.ModifyValue(ctx, pool, tok, "goexit", func(json.RawMessage) (json.RawMessage, error) {
			runtime.Goexit()
			return nil, nil
		})
	}()
	<-ended
	actx, acancel := context.WithTimeout(ctx, 10*time.Second)
	defer acancel()
	conn, err := pool.Acquire(actx)
	if err != nil {
		t.Fatalf("the pool's one connection after fn's Goexit: %v (not given back)", err)
	}
	var v string
	if err := conn.QueryRow(ctx, `SELECT value::text FROM pgfence.fenced_values WHERE key = 'goexit'`).Scan(&v); err != nil || v != "1" {
		t.Errorf("value after the rolled-back ModifyValue: %q, %v; want 1", v, err)
	}
	conn.Release()
	pool.Close()
}
