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
// a failed attempt before, a refusal stays pgfence.ErrLost. (The first
// attempt here fails before it is sent; ReleaseToken with the same key
// stands for its statement committing unseen.)
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
		takenSince bool // another holder got the name after the release landed
		want       error
	}{
		{"landed unseen", true, false, nil},
		{"landed, then taken", true, true, pgfence.ErrLost},
		{"released by another process", false, false, pgfence.ErrLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := "release-again-" + tc.name
			lease := mustAcquire(t, l, name, time.Minute)
			if tc.failFirst {
				if err := lease.Release(gone); err == nil || errors.Is(err, pgfence.ErrLost) {
					t.Fatalf("Release on an ended context = %v, want a connection-level error", err)
				}
			}
			if err := l.ReleaseToken(ctx, name, lease.Token()); err != nil {
				t.Fatal(err)
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
