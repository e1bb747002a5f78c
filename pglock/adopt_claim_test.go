package pglock

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// orphanGrant leaves a grant of name under a key nobody holds a Lease for
// (its Locker closed) and returns a Locker with that key, as after a grant
// with an unknown outcome, and the grant's token.
func orphanGrant(t *testing.T, name string) (*Locker, int64) {
	t.Helper()
	pool := pgtest.Pool(t)
	earlier := newLocker(t, pool, &Config{Holder: "claimer"})
	orphan := mustAcquire(t, earlier, name, time.Minute)
	_ = earlier.Close() // the Lease ends locally; the grant stays in the row
	return newLocker(t, pool, &Config{Holder: "claimer", Key: orphan.Key()}), orphan.Token()
}

// holdClaim makes the first claim of kind on name in l wait, once taken,
// until proceed is closed; claimed is closed when it is taken.
func holdClaim(l *Locker, kind claimKind, name string) (claimed, proceed chan struct{}) {
	claimed, proceed = make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	l.claimHook = func(k claimKind, n string, _ int64) {
		if k == kind && n == name && first.CompareAndSwap(false, true) {
			close(claimed)
			<-proceed
		}
	}
	return claimed, proceed
}

// A give-back of a grant nobody asked for any more (releaseOrphan,
// finishDetached, leaveQueue) and an Adopt of the same grant exclude each
// other: before, the give-back checked that no Lease held the grant, an
// Adopt then renewed it into a Lease, and the give-back's release ended the
// grant under that Lease. Each order is held at the claim, with the other
// side run in that window.
func TestAdoptExcludesGiveBack(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)

	t.Run("give-back first", func(t *testing.T) {
		const name = "claim-giveback-first"
		l, token := orphanGrant(t, name)
		claimed, proceed := holdClaim(l, claimGiveBack, name)
		done := make(chan struct{})
		go func() {
			defer close(done)
			l.releaseOrphan(grantReq{name: name}, grantRes{fastGrantRow: fastGrantRow{Token: token}})
		}()
		waitClosed(t, claimed, "the give-back's claim")
		lease, err := l.Adopt(ctx, name, token, time.Minute)
		if !errors.Is(err, pgfence.ErrLost) || lease != nil {
			t.Errorf("Adopt while the grant is given back = (lease %t, %v); want pgfence.ErrLost", lease != nil, err)
		}
		close(proceed)
		waitClosed(t, done, "the give-back")
		if info := inspect(t, l.pool, name); info.Held {
			t.Errorf("after the give-back the row is %+v, want released", info)
		}
	})

	t.Run("adopt first", func(t *testing.T) {
		const name = "claim-adopt-first"
		l, token := orphanGrant(t, name)
		claimed, proceed := holdClaim(l, claimAdopt, name)
		type result struct {
			lease *Lease
			err   error
		}
		adopted := make(chan result, 1)
		go func() {
			lease, err := l.Adopt(ctx, name, token, time.Minute)
			adopted <- result{lease, err}
		}()
		waitClosed(t, claimed, "Adopt's claim")
		// The give-back leaves the grant alone, at once (no statement: it
		// would wait for nothing, so a release would show below).
		l.releaseOrphan(grantReq{name: name}, grantRes{fastGrantRow: fastGrantRow{Token: token}})
		// A second Adopt of the grant is refused while the first makes its Lease.
		if s, err := l.Adopt(ctx, name, token, time.Minute); !isInvalid(err, "token") || s != nil {
			t.Errorf("a second Adopt during the first = (lease %t, %v); want ErrInvalid (token)", s != nil, err)
		}
		close(proceed)
		r := <-adopted
		if r.err != nil {
			t.Fatalf("Adopt = %v", r.err)
		}
		if err := r.lease.Err(); err != nil {
			t.Errorf("adopted lease ended: %v", err)
		}
		if info := inspect(t, l.pool, name); !info.Held || info.Token != token {
			t.Errorf("after Adopt and the skipped give-back the row is %+v, want held with token %d", info, token)
		}
		// Now a live Lease holds it: a give-back still leaves it alone.
		l.claimHook = nil
		l.releaseOrphan(grantReq{name: name}, grantRes{fastGrantRow: fastGrantRow{Token: token}})
		if info := inspect(t, l.pool, name); !info.Held || info.Token != token {
			t.Errorf("a give-back of a live Lease's grant changed the row to %+v", info)
		}
		if err := r.lease.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("adopt first, and it fails", func(t *testing.T) {
		// The give-back left the grant to an Adopt that then made no Lease
		// (its context ended): the Adopt gives the grant back.
		const name = "claim-adopt-fails"
		l, token := orphanGrant(t, name)
		claimed, proceed := holdClaim(l, claimAdopt, name)
		actx, cancel := context.WithCancel(ctx)
		adopted := make(chan error, 1)
		go func() {
			_, err := l.Adopt(actx, name, token, time.Minute)
			adopted <- err
		}()
		waitClosed(t, claimed, "Adopt's claim")
		l.releaseOrphan(grantReq{name: name}, grantRes{fastGrantRow: fastGrantRow{Token: token}})
		if info := inspect(t, l.pool, name); !info.Held {
			t.Fatalf("the give-back released the grant an Adopt was making a Lease of: %+v", info)
		}
		cancel()
		close(proceed)
		if err := <-adopted; !errors.Is(err, context.Canceled) {
			t.Fatalf("Adopt with its context ended = %v, want context.Canceled", err)
		}
		if info := inspect(t, l.pool, name); info.Held {
			t.Errorf("the Adopt failed and the give-back it was left is not done: the row is %+v", info)
		}
	})
}
