package pglock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// A Release whose outcome was unknown (its statement may have committed)
// and that is called again: when the row shows the lease released with its
// token (the first attempt's doing), the second Release returns nil, not a
// false pgfence.ErrLost. Once another holder has taken the name, or without
// a failed attempt before, or when the row's grant has the token but
// another acquired_at, a refusal stays pgfence.ErrLost. (The first
// attempt here fails before it is sent; a release with the same key, sent
// in SQL or by another Locker's ReleaseToken, stands for its statement
// committing unseen.)
func TestReleaseAgainAfterUnknownOutcome(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := testCtx(t, time.Minute)
	l := newLocker(t, pool, &Config{Holder: "releaser"})
	other := newLocker(t, pool, &Config{Holder: "other"})
	gone, cancel := context.WithCancel(ctx)
	cancel()

	for _, tc := range []struct {
		name       string
		failFirst  bool // a first Release failed with an unknown outcome
		sharedKey  bool // the release that lands is another Locker's with the lease's key
		handedOn   bool // a waiter is queued: the release that lands hands the lease to it
		takenSince bool // another holder got the name after the release landed
		otherGrant bool // the row's grant has the token but is another (acquired_at): a failover without the HA epoch
		want       error
	}{
		{"landed unseen", true, false, false, false, false, nil},
		{"landed, then taken", true, false, false, true, false, pgfence.ErrLost},
		{"landed and handed on to a waiter", true, false, true, false, false, pgfence.ErrLost},
		{"released by another process", false, true, false, false, false, pgfence.ErrLost},
		{"released by another process after a failed attempt", true, true, false, false, false, nil},
		{"the same token granted again", true, false, false, false, true, pgfence.ErrLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := "release-again-" + tc.name
			lease := mustAcquire(t, l, name, time.Minute)
			if tc.failFirst {
				if err := lease.Release(gone); err == nil || errors.Is(err, pgfence.ErrLost) {
					t.Fatalf("Release on an ended context = %v, want a connection-level error", err)
				}
			}
			releaser := l
			if tc.sharedKey {
				releaser = newLocker(t, pool, &Config{Holder: "releaser", Key: lease.Key()})
			}
			var waited <-chan acquired
			if tc.handedOn {
				sig := waitSignal(other)
				waited = acquireAsync(ctx, other, name, time.Minute)
				<-sig
			}
			if releaser == l {
				// The failed attempt's statement, committed unseen: behind
				// the Locker's back (its ReleaseToken would end the Lease).
				var released bool
				if err := pool.QueryRow(ctx, "SELECT released FROM pgfence.lock_release($1, $2, $3)", name, lease.Token(), lease.Key()).Scan(&released); err != nil || !released {
					t.Fatalf("the release that lands: %v, %v", released, err)
				}
			} else if err := releaser.ReleaseToken(ctx, name, lease.Token()); err != nil {
				t.Fatal(err)
			}
			if tc.handedOn {
				r := <-waited
				if r.err != nil {
					t.Fatalf("the waiter: %v", r.err)
				}
				// The handed lease's own Release, called again after an
				// unknown outcome, is recognised too (its grant's
				// acquired_at is the handoff's).
				defer func() {
					if err := r.lease.Release(gone); err == nil {
						t.Error("the handed lease's Release on an ended context succeeded")
					}
					if err := other.ReleaseToken(ctx, name, r.lease.Token()); err != nil {
						t.Error(err)
					}
					if err := r.lease.Release(ctx); err != nil {
						t.Errorf("the handed lease's Release again = %v, want nil", err)
					}
				}()
			}
			if tc.otherGrant {
				if _, err := pool.Exec(ctx, "UPDATE pgfence.locks SET acquired_at = acquired_at - interval '1 second' WHERE name = $1", name); err != nil {
					t.Fatal(err)
				}
			}
			if tc.takenSince {
				s := mustAcquire(t, other, name, time.Minute)
				defer func() { _ = s.Release(ctx) }()
			}
			err := lease.Release(ctx)
			switch {
			case tc.want == nil && err != nil:
				t.Errorf("Release again = %v, want nil (the earlier attempt released it)", err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Errorf("Release again = %v, want %v", err, tc.want)
			}
			if tc.want == nil && !errors.Is(lease.Err(), pgfence.ErrReleased) {
				t.Errorf("after the Release the Lease's Err is %v, want pgfence.ErrReleased", lease.Err())
			}
		})
	}
}
