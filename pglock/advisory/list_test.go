package advisory_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// TestListHolders: List reports the holder's identity and a waiter as not
// granted, so an operator can see who blocks whom.
func TestListHolders(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	cfg, err := pgxpool.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "advisory-list-test"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	key := advisory.Int64(-42)
	before := time.Now()
	holder, err := advisory.TryAcquire(ctx, pool, key, advisory.Exclusive, nil)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		l   *advisory.SessionLock
		err error
	}
	waiter := make(chan result, 1)
	go func() {
		l, err := advisory.Acquire(ctx, pool, key, advisory.Shared, nil)
		waiter <- result{l, err}
	}()
	var locks []advisory.LockInfo
	waitLocks(t, pool, "want the holder and a waiter", func(l []advisory.LockInfo) bool {
		locks = l
		return len(l) == 2
	})
	h, w := locks[0], locks[1]
	if !h.Granted || h.PID != int32(holder.PID()) || h.Mode != advisory.Exclusive || h.Key != key {
		t.Errorf("holder row = %+v, want granted exclusive %v by pid %d", h, key, holder.PID())
	}
	if w.Granted || w.Mode != advisory.Shared || w.Key != key || w.PID == h.PID {
		t.Errorf("waiter row = %+v, want a shared request on %v not granted", w, key)
	}
	for _, r := range locks {
		if r.ApplicationName != "advisory-list-test" || r.User == "" || r.State == "" || r.QueryStart == nil {
			t.Errorf("row lacks holder details: %+v", r)
		}
		if r.BackendStart.IsZero() || r.BackendStart.After(time.Now()) || r.BackendStart.Before(before.Add(-time.Hour)) {
			t.Errorf("BackendStart = %v", r.BackendStart)
		}
		if (r.ClientAddr == "") != (r.ClientPort == -1) {
			t.Errorf("ClientAddr %q with ClientPort %d", r.ClientAddr, r.ClientPort)
		}
	}
	if h.State != "idle" || w.State != "active" {
		t.Errorf("states: holder %q waiter %q, want idle and active", h.State, w.State)
	}

	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-waiter
	if r.err != nil {
		t.Fatalf("waiter: %v", r.err)
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	requireNoLocks(t, pool)
}
