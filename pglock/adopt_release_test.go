package pglock

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// endedWithGrantHeld returns a Lease of name that has ended locally (its
// deadline passed) while the database still holds its grant for a minute
// (as after a slow renewal, or RenewToken from a process with the values).
func endedWithGrantHeld(t *testing.T, ctx context.Context, l *Locker, name string) *Lease {
	t.Helper()
	s := mustAcquire(t, l, name, 2*time.Second)
	if _, err := l.RenewToken(ctx, name, s.Token(), time.Minute); err != nil {
		t.Fatal(err)
	}
	<-s.Done()
	if !errors.Is(s.Err(), pgfence.ErrLost) {
		t.Fatalf("the first lease ended with %v, want ErrLost (its deadline)", s.Err())
	}
	return s
}

// A Lease that ended locally can still release its grant, after Adopt made
// a new Lease of it: that Lease ends with it (ErrLost), and is not left
// live while another holder takes the name.
func TestReleaseOfEndedLeaseEndsAdopted(t *testing.T) {
	ctx := testCtx(t, time.Minute)
	pool := pgtest.Pool(t)
	l := newLocker(t, pool, &Config{PollOnly: true})
	other := newLocker(t, pool, &Config{PollOnly: true})
	const name = "adopt-then-release"
	first := endedWithGrantHeld(t, ctx, l, name)
	adopted, err := l.Adopt(ctx, name, first.Token(), time.Minute)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	if err := first.Release(ctx); err != nil { // a deferred Release of the first lease
		t.Fatalf("the ended lease's Release: %v", err)
	}
	if err := adopted.Err(); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("the adopted lease after its grant was released: Err %v, want ErrLost", err)
	}
	select {
	case <-adopted.Done():
	default:
		t.Fatal("the adopted lease's Done is open after its grant was released")
	}
	s, err := other.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("another Locker after the release: %v", err)
	}
	defer s.Release(ctx)
	if s.Token() <= first.Token() {
		t.Fatalf("token %d after %d", s.Token(), first.Token())
	}
	// The adopted lease's own Release finds the grant gone.
	if err := adopted.Release(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("the adopted lease's Release: %v, want ErrLost", err)
	}
}

// ReleaseToken of a grant a live Lease holds ends that Lease.
func TestReleaseTokenEndsLease(t *testing.T) {
	ctx := testCtx(t, time.Minute)
	l := newLocker(t, pgtest.Pool(t), &Config{PollOnly: true, KeepAlive: true})
	const name = "release-token-live"
	s := mustAcquire(t, l, name, time.Minute)
	if err := l.ReleaseToken(ctx, name, s.Token()); err != nil {
		t.Fatal(err)
	}
	if err := s.Err(); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("the lease after ReleaseToken of its grant: Err %v, want ErrLost", err)
	}
	if err := s.Context().Err(); err == nil {
		t.Fatal("the lease's Context is live after ReleaseToken of its grant")
	}
	if info := inspect(t, l.pool, name); info.Held {
		t.Fatalf("%s held by %q after ReleaseToken", name, info.Holder)
	}
}

// renewHook runs hook once, after the next lock_renew statement answered
// (armed), on the goroutine that sent it.
type renewHook struct {
	armed atomic.Bool
	hook  func()
}

func (r *renewHook) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (r *renewHook) TraceQueryEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if d.Err == nil && strings.Contains(d.CommandTag.String(), "SELECT") && r.armed.CompareAndSwap(true, false) {
		r.hook()
	}
}

// A release of the grant that succeeds after Adopt's renewal answered, but
// before Adopt registered its Lease, makes Adopt end that Lease and return
// ErrLost: the grant is not held any more.
func TestReleaseDuringAdopt(t *testing.T) {
	ctx := testCtx(t, time.Minute)
	dsn := pgtest.DSN(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	rh := &renewHook{}
	cfg.ConnConfig.Tracer = rh
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	l := newLocker(t, pool, &Config{PollOnly: true})
	const name = "release-during-adopt"
	first := endedWithGrantHeld(t, ctx, l, name)
	var released error = errors.New("the hook did not run")
	rh.hook = func() { released = first.Release(context.WithoutCancel(ctx)) }
	var renewing atomic.Bool
	l.claimHook = func(kind claimKind, n string, tok int64) {
		if kind == claimAdopt && n == name {
			renewing.Store(true)
			rh.armed.Store(true) // the next statement answered is Adopt's renewal
		}
	}
	adopted, err := l.Adopt(ctx, name, first.Token(), time.Minute)
	if !renewing.Load() {
		t.Fatal("Adopt did not claim the grant")
	}
	if released != nil {
		t.Fatalf("the ended lease's Release during Adopt: %v", released)
	}
	if err == nil {
		t.Fatalf("Adopt returned a lease (token %d, Err %v) of a grant released while it renewed it", adopted.Token(), adopted.Err())
	}
	if !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("Adopt: %v, want ErrLost", err)
	}
	if info := inspect(t, pool, name); info.Held {
		t.Fatalf("%s held by %q after the release", name, info.Holder)
	}
}
